"""Small training fixtures shared by several test files."""

import socket

import numpy as np
import tensorflow as tf

from training import checkpoints as checkpoints_lib
from training.checkpoints import CheckpointCallback, RunCheckpoints
from training.lr_schedule import LearningRateSchedule


def toy_checkpoints(tmp_path, optimizer="adam"):
  """A trained toy model, its RunCheckpoints in `tmp_path`, and the checkpoint callback bound to it."""
  net = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
  net.compile(optimizer=optimizer, loss="mse")
  net.fit(np.zeros((4, 3)), np.zeros((4, 2)), verbose=0)
  checkpoints = RunCheckpoints(str(tmp_path), net, {"model": "toy"})
  callback = CheckpointCallback(checkpoints, LearningRateSchedule(1e-3, 0, 0.1, 1, 0))
  callback.set_model(net)
  return net, checkpoints, callback


def with_first_callback(monkeypatch, callback):
  """Makes training/loop.py run `callback` first among the fit's callbacks (to act on a run in
  process: poison its weights, signal it at a chosen point)."""
  from training import loop  # pylint: disable=import-outside-toplevel
  make_callbacks = loop._make_callbacks  # pylint: disable=protected-access

  def with_callback(*args, **kwargs):
    callbacks, throughput = make_callbacks(*args, **kwargs)
    return [callback] + callbacks, throughput
  monkeypatch.setattr(loop, "_make_callbacks", with_callback)


def free_ports(count):
  """`count` TCP ports free on 127.0.0.1 right now (for multi-worker clusters on this machine)."""
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def readable_state(path):
  """The run state stored in checkpoint `path`, after reading every tensor of it (CRC-checked)."""
  reader = tf.train.load_checkpoint(path)
  for key in reader.get_variable_to_shape_map():
    reader.get_tensor(key)  # CRC-checked: a torn or corrupt file fails here
  return checkpoints_lib.peek_state(path)
