"""Neuron-Inverter network designs and the model builder's convolution options (plain data, so flags
and tools can list and check them without TensorFlow).

From the reference hyper-parameter files: `ontra4` is the production design `a2f791f3a_ontra4`
(2,988,843 trainable parameters), `dev` the small fast-compiling test design (431,683). `dropout` is
the reference's rate: its PyTorch model (tools/reference_torch.py) and the side-by-side tools use it,
while the application takes its rate from `--dropout`.
"""

DESIGNS = {
    "ontra4": {
        "conv_filters": (30, 90, 180),
        "conv_kernels": (4, 4, 4),
        "conv_pools": (4, 4, 4),
        "fc_dims": (512, 512, 512, 256, 128),
        "dropout": 0.05,
    },
    "dev": {
        "conv_filters": (4, 16, 32),
        "conv_kernels": (4, 2, 2),
        "conv_pools": (4, 2, 2),
        "fc_dims": (128, 128),
        "dropout": 0.05,
    },
}

# The convolution options the model builder takes (model/neuron_inverter/conv_layers.py), each with the value it has
# where no measured form applies (GPUs, IPUs), so that a tool can check an option's name and type before
# TensorFlow starts; every form of cpu_forms.py gives each of them.
CONV_OPTION_DEFAULTS = {
    "channel_multiple": 1,
    "input_grad_by_forward_conv": False,
    "kernel_grad_by_matmul": False,
    "pooling": "max_pool",
    "phases_max_in_channels": 0,
    "first_block_library": "",
}
