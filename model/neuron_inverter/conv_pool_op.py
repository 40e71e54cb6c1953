"""The first conv block as one CPU op: relu(maxpool(conv1d(x, kernel)) + bias) and its gradients,
from model/neuron_inverter/kernels/conv_pool1d.cc (compiled for this machine by kernel_build.py).

It computes the function of PooledConv1D's other forms, with the same first-maximum rule on ties,
up to the order of the 16 multiply-adds in each conv value. It gives no gradient for its input, so
the model builder uses it only where the input is the data: the network's first block.
"""

import tensorflow as tf

_LIBRARIES = {}

# What the op's code computes (model/neuron_inverter/kernels/conv_pool1d.cc): output channels in up to 8 vectors of 8,
# a gradient window (width x input channels) of 1 to 4 whole vectors, the winner's position in a byte.
MAX_FILTERS = 64
WINDOW_SIZES = (8, 16, 24, 32)
MAX_POOL = 255


def computes(width: int, in_channels: int, filters: int, pool: int) -> bool:
  """Whether the op computes a block of these sizes (ontra4's and dev's first blocks: 4 x 4 -> 30 and
  4 x 4 -> 4, pools of 4); other blocks stay with TensorFlow's ops."""
  return filters <= MAX_FILTERS and width * in_channels in WINDOW_SIZES and pool <= MAX_POOL


def load(path: str):
  """The op library at `path`, loaded once per process."""
  if path not in _LIBRARIES:
    _LIBRARIES[path] = tf.load_op_library(path)
  return _LIBRARIES[path]


def conv_pool1d(x, kernel, bias, pool: int, library_path: str):
  """relu(max_pool1d(conv1d(x, kernel, VALID), pool, pool, VALID) + bias) for float32 `x` (batch,
  time, in), `kernel` (width, in, out), `bias` (out); gradients for `kernel` and `bias` only."""
  library = load(library_path)
  width = int(kernel.shape[0])

  @tf.custom_gradient
  def block(x, kernel, bias):
    outputs, winners = library.conv_pool1d(x, kernel, bias, pool=pool)

    def grad(upstream):
      kernel_grad, bias_grad = library.conv_pool1d_grad(x, outputs, winners, upstream, pool=pool,
                                                        width=width)
      return None, kernel_grad, bias_grad

    return outputs, grad

  return block(x, kernel, bias)
