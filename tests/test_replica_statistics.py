"""Evaluation under MirroredStrategy uses the moving statistics the saved weights hold."""

import numpy as np
import pytest
import tensorflow as tf

from training import replica_statistics


def _replica_skewed_data():
  """Global batches of 16 whose first half (replica 0) and second half (replica 1) differ in mean and
  scale, so that the two replicas' moving statistics drift apart."""
  rng = np.random.default_rng(0)
  halves = [rng.normal(0, 1, (8, 8, 4)), rng.normal(3, 2, (8, 8, 4))]
  x = np.concatenate([np.concatenate([halves[0][i], halves[1][i]]) for i in range(8)]).astype(np.float32)
  return x, x.sum(axis=1, keepdims=True)


def _trained_on_two_replicas(x, y):
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    inputs = tf.keras.Input((4,))
    norm = tf.keras.layers.BatchNormalization(name="norm")
    net = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(norm(inputs)))
    net.compile("sgd", "mse")
  net.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  return strategy, net, norm


def _saved_model_loss(net, x, y):
  """The loss of the weights a checkpoint holds, on one device."""
  alone = tf.keras.Model.from_config(net.get_config())
  alone.set_weights(net.get_weights())
  alone.compile(loss="mse")
  return alone.evaluate(x, y, batch_size=16, verbose=0)


def test_share_gives_every_replica_the_mean_the_saved_weights_hold():
  x, y = _replica_skewed_data()
  strategy, net, norm = _trained_on_two_replicas(x, y)
  copies = [v.numpy() for v in strategy.experimental_local_results(norm.moving_mean)]
  assert not np.allclose(copies[0], copies[1])                 # each replica kept its own
  saved = _saved_model_loss(net, x, y)
  assert net.evaluate(x, y, batch_size=16, verbose=0) != pytest.approx(saved, rel=1e-3)
  mean = norm.moving_mean.numpy()                                # what get_weights() and checkpoints read
  replica_statistics.share(net)
  for copy in strategy.experimental_local_results(norm.moving_mean):
    np.testing.assert_array_equal(copy.numpy(), mean)
  assert net.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(saved, rel=1e-6)


def test_a_fits_validation_uses_the_shared_statistics():
  x, y = _replica_skewed_data()
  _, net, _ = _trained_on_two_replicas(x, y)
  # One more epoch at a zero learning rate: the weights stay, the moving statistics move on.
  net.optimizer.learning_rate.assign(0.0)
  history = net.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, validation_data=(x, y),
                    validation_batch_size=16, callbacks=[replica_statistics.ShareBeforeEvaluation()])
  assert history.history["val_loss"][0] == pytest.approx(_saved_model_loss(net, x, y), rel=1e-6)


def test_one_device_has_nothing_to_share():
  inputs = tf.keras.Input((4,))
  net = tf.keras.Model(inputs, tf.keras.layers.BatchNormalization()(inputs))
  shared = replica_statistics._per_replica_means(net)  # pylint: disable=protected-access
  assert net.non_trainable_weights and not shared     # plain variables: one copy, nothing to share
  replica_statistics.share(net)
