"""Batch normalisation by each batch's own statistics, in training and in evaluation alike.

This is the Neuron-Inverter reference's IPU model: its poptorch `Model.py` builds
`BatchNorm1d(flat_dim, track_running_stats=False)`, which keeps no moving statistics and normalises
every batch with its own mean and variance, at inference too. The application uses it where Keras'
moving statistics cannot be kept right: in pipelined IPU training, IPU Keras does not update them
(keras/ipu/extensions/extensions_base.py, graphcore/keras r2.6/sdk-release-3.4), so a pipelined run's
validation, test and predictions would normalise with statistics that do not follow its data.

The layer has the scale and offset of Keras' BatchNormalization (gamma, beta), and nothing else to
save. The statistics are those of one replica's batch (as Keras' BatchNormalization without
synchronisation), computed in float32 under mixed precision.
"""

import tensorflow as tf


class BatchStatisticsNormalization(tf.keras.layers.Layer):
  """Normalises each feature of a (batch, features) input with the batch's mean and (biased) variance."""

  def __init__(self, epsilon=1e-5, **kwargs):
    super().__init__(**kwargs)
    self.epsilon = epsilon

  def build(self, input_shape):
    width = int(input_shape[-1])
    # Kept in float32 under mixed precision (no autocast), as Keras' BatchNormalization keeps its own.
    self.gamma = self.add_weight("gamma", shape=(width,), dtype=tf.float32, initializer="ones",
                                 experimental_autocast=False)
    self.beta = self.add_weight("beta", shape=(width,), dtype=tf.float32, initializer="zeros",
                                experimental_autocast=False)
    super().build(input_shape)

  def call(self, inputs):
    x = tf.cast(inputs, tf.float32)
    mean, variance = tf.nn.moments(x, axes=[0])
    y = tf.nn.batch_normalization(x, mean, variance, self.beta, self.gamma, self.epsilon)
    return tf.cast(y, self.compute_dtype)

  def get_config(self):
    return dict(super().get_config(), epsilon=self.epsilon)
