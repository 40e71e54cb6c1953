"""Everything that knows about hardware: start-up environment, backend choice, distribution strategy.

Import order matters: `strategies.environment` is TensorFlow-free and must run before anything imports
TensorFlow; `strategies.select` imports TensorFlow and returns the `Backend` for a run.
"""
