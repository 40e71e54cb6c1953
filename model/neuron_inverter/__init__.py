"""The Neuron-Inverter model and everything that is its own: the network (`network.py`, the module the
registry builds from), its options (`options.py`: `--design`, `--batch_norm_statistics`) and designs
(`designs.py`), plain data; the fast forms of its conv blocks (`conv_layers.py`), the choice of form for
the hardware (`cpu_forms.py`), the compiled first-block op (`conv_pool_op.py`, `kernels/conv_pool1d.cc`)
and its build for this machine (`kernel_build.py`).

Nothing here imports TensorFlow at package level, so that `flags.py` can read the options before
TensorFlow starts.
"""
