"""Gradient accumulation on CPU: the same mathematics as one large batch."""

import numpy as np
import pytest
import tensorflow as tf

from strategies.accumulation import accumulated_gradients, with_accumulation


def _model():
  inputs = tf.keras.Input((6,))
  hidden = tf.keras.layers.Dense(8, activation="tanh")(inputs)
  return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(hidden))


def _batch(n=32):
  rng = np.random.RandomState(0)
  return tf.constant(rng.randn(n, 6).astype(np.float32)), tf.constant(rng.randn(n, 3).astype(np.float32))


@pytest.mark.parametrize("micro_batches", [2, 4, 8])
def test_accumulated_gradient_equals_the_large_batch_gradient(micro_batches):
  tf.random.set_seed(0)
  net = with_accumulation(_model(), micro_batches)
  net.compile(optimizer="sgd", loss="mse")
  x, y = _batch()
  accumulated = tf.function(lambda: accumulated_gradients(net, x, y, micro_batches))()
  with tf.GradientTape() as tape:
    loss = net.compiled_loss(y, net(x, training=True))
  full = tape.gradient(loss, net.trainable_variables)
  for a, b in zip(accumulated, full):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_one_accumulated_step_equals_one_large_batch_step():
  x, y = _batch()
  initial, weights = _model().get_weights(), {}
  for name, micro_batches in (("large", 1), ("accumulated", 4)):
    net = with_accumulation(_model(), micro_batches)
    net.set_weights(initial)
    net.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
    net.fit(tf.data.Dataset.from_tensors((x, y)), epochs=3, verbose=0)
    weights[name] = net.get_weights()
  for a, b in zip(weights["large"], weights["accumulated"]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_under_mixed_float16_each_micro_batch_loss_is_scaled_so_small_gradients_survive():
  """A float32 output over a float16 hidden layer, with the loss weighted by 1e-7: the hidden layer's
  gradients (about 1e-9) flush to zero in float16 unless the loss is scaled, as Keras' own training
  step scales it under the LossScaleOptimizer that compile() adds for mixed_float16."""
  tf.keras.mixed_precision.set_global_policy("mixed_float16")
  inputs = tf.keras.Input((6,))
  hidden = tf.keras.layers.Dense(8, activation="tanh")(inputs)
  net = with_accumulation(tf.keras.Model(inputs, tf.keras.layers.Dense(3, dtype="float32")(hidden)), 4)
  net.compile(optimizer="adam", loss="mse", loss_weights=1e-7)
  assert isinstance(net.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
  x, y = _batch()
  accumulated = tf.function(lambda: accumulated_gradients(net, x, y, 4))()
  with tf.GradientTape() as tape:
    scaled = net.optimizer.get_scaled_loss(net.compiled_loss(y, net(x, training=True)))
  full = net.optimizer.get_unscaled_gradients(tape.gradient(scaled, net.trainable_variables))
  assert net.trainable_variables[0] is net.layers[1].kernel
  assert np.abs(full[0].numpy()).min() > 0  # the hidden kernel's gradient, whole when scaled
  for a, b in zip(accumulated, full):  # float16 rounds each micro-batch's sums its own way
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=0.02 * np.abs(b.numpy()).max())
