"""Everything that knows about hardware: start-up environment, backend choice, distribution strategy.

Import order matters: `strategies.environment` is TensorFlow-free and must run before anything imports
TensorFlow; `strategies.start` then imports it, and `strategies.select` returns the `Backend` for a run.
"""
