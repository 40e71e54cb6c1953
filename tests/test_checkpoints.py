"""Checkpoints: a diverged epoch never replaces the last good one; saves are atomic and keep the last two."""

import math
import os

import numpy as np
import tensorflow as tf

from training import checkpoints as checkpoints_lib
from training.checkpoints import CheckpointCallback, RunCheckpoints, read_index
from training.lr_schedule import WarmupPlateauSchedule


def toy_checkpoints(tmp_path):
  """A trained toy model, its RunCheckpoints in `tmp_path`, and the checkpoint callback bound to it."""
  net = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
  net.compile(optimizer="adam", loss="mse")
  net.fit(np.zeros((4, 3)), np.zeros((4, 2)), verbose=0)
  checkpoints = RunCheckpoints(str(tmp_path), net, {"model": "toy"})
  callback = CheckpointCallback(checkpoints, WarmupPlateauSchedule(1e-3, 0, 0.1, 1, 0))
  callback.set_model(net)
  return net, checkpoints, callback


def test_nan_epoch_is_not_saved(tmp_path):
  net, _, callback = toy_checkpoints(tmp_path)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})
  index = os.path.join(str(tmp_path), "checkpoints", "last", "checkpoint")
  before = open(index).read()
  callback.on_epoch_end(1, {"loss": math.nan, "val_loss": 0.3})
  assert open(index).read() == before and callback.best_epoch == 1


def test_best_follows_validation_and_state_round_trips(tmp_path):
  net, _, callback = toy_checkpoints(tmp_path)
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


def test_saves_are_atomic_keep_two_and_never_overwrite_a_listed_checkpoint(tmp_path):
  net, _, callback = toy_checkpoints(tmp_path)
  checkpoints = callback.checkpoints
  folder = checkpoints.folder("last")
  os.makedirs(folder)
  stale = [os.path.join(folder, ".saving-ckpt-9.x"), os.path.join(folder, "ckpt-7.index")]
  os.makedirs(stale[0])
  open(stale[1], "w").close()
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})
  callback.on_epoch_end(1, {"loss": 0.4, "val_loss": 0.3})
  assert read_index(folder) == ["ckpt-1", "ckpt-2"]
  assert tf.train.latest_checkpoint(folder) == os.path.join(folder, "ckpt-2")
  assert not any(os.path.exists(path) for path in stale)        # leftovers of killed saves are swept
  weights = [w.numpy().copy() for w in net.weights]
  # A resumed run saving epoch 2 again must not rewrite the files the index lists.
  listed = os.path.join(folder, "ckpt-2.data-00000-of-00001")
  inode = os.stat(listed).st_ino
  path = checkpoints.save("last", {"epoch": 2})
  assert path.endswith("ckpt-2-1") and os.stat(listed).st_ino == inode
  assert read_index(folder) == ["ckpt-2", "ckpt-2-1"]
  assert sorted(os.listdir(folder)) == ["checkpoint", "ckpt-2-1.data-00000-of-00001", "ckpt-2-1.index",
                                        "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
  for w in net.weights:
    w.assign(tf.zeros_like(w))
  assert checkpoints.restore_last()["epoch"] == 2
  for restored, saved in zip(net.weights, weights):
    np.testing.assert_array_equal(restored.numpy(), saved)
  state = checkpoints_lib.peek_state(os.path.join(checkpoints.folder("best"), "ckpt-2"))
  assert state["best_epoch"] == 2 and [e["epoch"] for e in state["epoch_logs"]] == [1, 2]
