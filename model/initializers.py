"""PyTorch's default initialisation of Conv1d and Linear layers, as Keras initializers.

The Neuron-Inverter reference is PyTorch code that keeps its layers' default initialisation:
kernels `kaiming_uniform_(a=sqrt(5))`, which is U(+-1/sqrt(fan_in)), and biases U(+-1/sqrt(fan_in)).
Keras' defaults (glorot_uniform kernels, zero biases) start 1.2-2.3x wider in every ontra4 layer;
the network then learns about 10% less per epoch than the reference (docs/performance.md, "Learning
parity and time to quality"). fan_in is kernel_size x input channels for a convolution, the input
width for a dense layer (Keras computes the same for a (kernel, in, out) kernel).

Each layer needs its own instances: an unseeded Keras initializer returns the same values at every
call, so one shared instance would give two equal-shaped layers the same kernel.
"""

import math

import tensorflow as tf


def kernel() -> tf.keras.initializers.Initializer:
  """U(+-1/sqrt(fan_in)): variance scaling with scale 1/3 gives the limit sqrt(3 * scale / fan_in)."""
  return tf.keras.initializers.VarianceScaling(scale=1.0 / 3.0, mode="fan_in", distribution="uniform")


def bias(fan_in: int) -> tf.keras.initializers.Initializer:
  """U(+-1/sqrt(fan_in)), with the fan-in of the layer's kernel."""
  bound = 1.0 / math.sqrt(fan_in)
  return tf.keras.initializers.RandomUniform(-bound, bound)
