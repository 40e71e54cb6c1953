"""The Neuron-Inverter model and everything that is its own: the network (`network.py`, the module the
registry builds from), its designs (`designs.py`, plain data), the fast forms of its conv blocks
(`conv_layers.py`) and the compiled first-block op (`conv_pool_op.py`, `kernels/conv_pool1d.cc`).

Nothing here imports TensorFlow at package level, so that `flags.py` can read the designs before
TensorFlow starts.
"""
