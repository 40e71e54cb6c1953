"""Checkpoint callback: a diverged epoch never replaces the last good checkpoint."""

import math
import os

import numpy as np
import tensorflow as tf

from training.checkpoints import CheckpointCallback, RunCheckpoints
from training.lr_schedule import WarmupPlateauSchedule


def _callback(tmp_path):
  net = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
  net.compile(optimizer="adam", loss="mse")
  net.fit(np.zeros((4, 3)), np.zeros((4, 2)), verbose=0)
  checkpoints = RunCheckpoints(str(tmp_path), net, {"model": "toy"})
  callback = CheckpointCallback(checkpoints, WarmupPlateauSchedule(1e-3, 0, 0.1, 1, 0))
  callback.set_model(net)
  return net, callback


def test_nan_epoch_is_not_saved(tmp_path):
  net, callback = _callback(tmp_path)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})
  index = os.path.join(str(tmp_path), "checkpoints", "last", "checkpoint")
  before = open(index).read()
  callback.on_epoch_end(1, {"loss": math.nan, "val_loss": 0.3})
  assert open(index).read() == before and callback.best_epoch == 1


def test_best_follows_validation_and_state_round_trips(tmp_path):
  net, callback = _callback(tmp_path)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})
  callback.on_epoch_end(1, {"loss": 0.4, "val_loss": 0.6})
  assert callback.best_epoch == 1 and callback.best_val_loss == 0.4
  weights = [w.numpy().copy() for w in net.weights]
  for w in net.trainable_weights:
    w.assign(tf.zeros_like(w))
  state = callback.checkpoints.restore_last()
  assert state["epoch"] == 2 and state["model"] == "toy" and state["best_epoch"] == 1
  for restored, saved in zip(net.weights, weights):
    np.testing.assert_array_equal(restored.numpy(), saved)
