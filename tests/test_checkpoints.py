"""Checkpoints: a diverged epoch never replaces the last good one; saves are atomic and keep the last two,
and the best K epochs (--keep_checkpoints); --init_from loads another run's network weights alone."""

import dataclasses
import errno
import math
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from errors import UserError
from training import checkpoints as checkpoints_lib
from training import optimizers
from training.checkpoints import CheckpointCallback, RunCheckpoints, read_index
from training.lr_schedule import LearningRateSchedule
from strategies import ipu as ipu_backend
from tests.support import fake_ipu
from tests.support.helpers import assert_names
from tests.support.training_parts import readable_state, toy_checkpoints


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
  # An improving epoch's `last` is best's files, linked: written once, on disk once.
  for suffix in (".index", ".data-00000-of-00001"):
    in_last, in_best = (os.stat(os.path.join(checkpoints.folder(which), "ckpt-2" + suffix))
                        for which in ("last", "best"))
    assert in_last.st_ino == in_best.st_ino and in_last.st_nlink == 2
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


@pytest.mark.skipif(not hasattr(tf.keras.optimizers, "legacy"), reason="TensorFlow < 2.11 has one optimizer family")
def test_resume_builds_the_optimizer_family_its_checkpoint_was_written_with(tmp_path):
  """Runs started before Adam became the fused legacy class keep their optimizer state on --resume."""
  written = tf.keras.optimizers.Adam(1e-3)  # the TF >= 2.11 family, as such runs used
  net, _, callback = toy_checkpoints(tmp_path, written)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})
  state = checkpoints_lib.peek_last_state(str(tmp_path), {"model": "toy"})
  assert state["optimizer_format"] == optimizers.KERAS_2_11
  assert optimizers.optimizer_format(optimizers.make_optimizer("adam", 1e-3)) == optimizers.LEGACY

  resumed, _, callback = toy_checkpoints(tmp_path / "new", optimizers.make_optimizer(
      "adam", 1e-3, checkpoint_format=state["optimizer_format"]))
  resumed_checkpoints = checkpoints_lib.RunCheckpoints(str(tmp_path), resumed, {"model": "toy"})
  resumed_checkpoints.restore_last()
  assert int(resumed.optimizer.iterations) == int(written.iterations) == 1
  for old, new in zip(written.variables, resumed.optimizer.variables):
    np.testing.assert_array_equal(new.numpy(), old.numpy())

  fused, _, _ = toy_checkpoints(tmp_path / "fused", optimizers.make_optimizer("adam", 1e-3))
  with pytest.raises(UserError, match="optimizer_2.11.*optimizer_v2"):  # the checkpoint's, then this run's
    checkpoints_lib.RunCheckpoints(str(tmp_path), fused, {"model": "toy"}).restore_last()


def test_adam_steps_exactly_as_pytorchs_adam():
  """The reference trains with torch.optim.Adam: epsilon 1e-8, added after the bias correction."""
  rng = np.random.default_rng(0)
  start = rng.normal(size=50)
  # gradients from 1e-7 to 1: epsilon's placement matters most for the smallest
  gradients = [rng.normal(size=50) * 10.0 ** rng.uniform(-7, 0, size=50) for _ in range(30)]
  variable = tf.Variable(start.astype(np.float32))
  optimizer = optimizers.make_optimizer("adam", 1e-3)
  for gradient in gradients:
    optimizer.apply_gradients([(tf.constant(gradient.astype(np.float32)), variable)])
  expected, m, v = start.copy(), np.zeros(50), np.zeros(50)   # torch.optim.Adam's rule, in float64
  for t, gradient in enumerate(gradients, start=1):
    m, v = 0.9 * m + 0.1 * gradient, 0.999 * v + 0.001 * gradient**2
    expected -= 1e-3 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
  moved = np.abs(expected - start).max()
  assert np.abs(variable.numpy() - expected).max() < 1e-3 * moved


def test_a_mid_epoch_resume_needs_the_same_batch_layout(tmp_path, monkeypatch):
  """Skipping 39 steps of 8 samples is not skipping 39 steps of 4."""
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies.backend import Backend  # pylint: disable=import-outside-toplevel
  from training import loop  # pylint: disable=import-outside-toplevel
  config = RunConfig(model="neuron_inverter", model_options={"design": "dev"}, optimizer="adam", learning_rate=1e-3,
                     batch_size=4, epochs=3, logdir=str(tmp_path), resume=True)
  net = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
  net.compile(optimizer="adam", loss="mse")
  checkpoints = RunCheckpoints(str(tmp_path), net, loop._identity(config))  # pylint: disable=protected-access
  backend = Backend("cpu", tf.distribute.get_strategy(), ("/cpu:0",))
  callback = CheckpointCallback(checkpoints, LearningRateSchedule(1e-3, 0, 0.1, 1, 0),
                                batch_layout=loop._batch_layout(config, backend))  # pylint: disable=protected-access
  callback.save_interrupted(0, 39, {"loss": 0.5})
  assert loop._resume_state(config, backend)["step"] == 39  # pylint: disable=protected-access
  with pytest.raises(UserError, match="batch of 4 .*batch of 8"):  # the checkpoint's, then this run's
    loop._resume_state(dataclasses.replace(config, batch_size=8), backend)  # pylint: disable=protected-access
  # The same global batch on IPUs, whose steps are micro-batches (accumulation 2): 39 steps are half
  # the samples they were on the CPU.
  fake_ipu.install(monkeypatch)
  accumulating = dataclasses.replace(config, batch_size=2, gradient_accumulation=2)
  CheckpointCallback(checkpoints, LearningRateSchedule(1e-3, 0, 0.1, 1, 0), batch_layout=loop._batch_layout(  # pylint: disable=protected-access
      accumulating, dataclasses.replace(backend, gradient_accumulation=2))).save_interrupted(0, 40, {"loss": 0.5})
  ipu = ipu_backend.create(dataclasses.replace(accumulating, backend="ipu"))
  with pytest.raises(UserError) as caught:
    loop._resume_state(accumulating, ipu)  # pylint: disable=protected-access
  assert_names(caught.value, "global batch of 4", "steps of 2 rows", "micro-batch per replica")


def test_a_resume_keeps_the_batch_norm_statistics_its_checkpoint_was_written_with(tmp_path):
  """Moving statistics are weights of the checkpoint, or there are none; checkpoints from before the
  choice was recorded were written with moving statistics."""
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from training import loop  # pylint: disable=import-outside-toplevel
  config = RunConfig(model="neuron_inverter", optimizer="adam", learning_rate=1e-3,
                     model_options={"batch_norm_statistics": "batch"}, logdir=str(tmp_path), resume=True)
  identity = loop._identity(config)  # pylint: disable=protected-access
  checkpoints_lib.check_identity("ckpt", dict(identity), identity)
  with pytest.raises(UserError, match="ckpt .*=batch.*=moving"):  # the checkpoint's, then this run's
    checkpoints_lib.check_identity("ckpt", dict(identity), dict(identity, batch_norm_statistics="moving"))
  older = {key: value for key, value in identity.items() if key != "batch_norm_statistics"}
  checkpoints_lib.check_identity("ckpt", older, dict(identity, batch_norm_statistics="moving"))
  with pytest.raises(UserError, match="ckpt .*=moving.*=batch"):
    checkpoints_lib.check_identity("ckpt", older, identity)
  assert "batch_norm_statistics" not in loop._identity(RunConfig(model="mnist"))  # pylint: disable=protected-access


def test_evaluation_takes_the_best_checkpoint_else_the_last(tmp_path):
  with pytest.raises(UserError, match="no checkpoint.*an epoch"):
    checkpoints_lib.best_or_last(str(tmp_path))
  _, _, callback = toy_checkpoints(tmp_path)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})   # best and last: epoch 1
  callback.on_epoch_end(1, {"loss": 0.4, "val_loss": 0.6})   # last only: epoch 2
  best = os.path.join(str(tmp_path), "checkpoints", "best", "ckpt-1")
  assert checkpoints_lib.best_or_last(str(tmp_path)) == best
  for name in os.listdir(os.path.dirname(best)):  # no best any more: the last one
    os.remove(os.path.join(os.path.dirname(best), name))
  assert checkpoints_lib.best_or_last(str(tmp_path)) == os.path.join(str(tmp_path), "checkpoints", "last",
                                                                     "ckpt-2")
  # A damaged run is named as damaged, not as one that never finished an epoch.
  os.remove(os.path.join(str(tmp_path), "checkpoints", "last", "ckpt-2.index"))
  with pytest.raises(UserError) as caught:
    checkpoints_lib.best_or_last(str(tmp_path))
  assert_names(caught.value, "no usable checkpoint", "best", "ckpt-2", "missing", "no ckpt-2.index")


def _enospc(*args, **kwargs):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fsync", "staging", "tensorflow", "index"])
def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
  net, checkpoints, callback = toy_checkpoints(tmp_path)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})
  folder = checkpoints.folder("last")
  before = {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}
  if where == "fsync":        # delayed allocation: ENOSPC surfaces when the data is flushed
    monkeypatch.setattr(checkpoints_lib, "_fsync", _enospc)
    reason = "No space left on device"
  elif where == "staging":    # an unwritable folder (chmod has no effect for root, so simulated)
    def _denied(*args, **kwargs):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    monkeypatch.setattr(checkpoints_lib.tempfile, "mkdtemp", _denied)
    reason = "Permission denied"
  elif where == "tensorflow":  # TensorFlow's own writer runs out of space
    def _full(self, prefix, options=None):
      with open(prefix + ".data-00000-of-00001", "wb") as f:
        f.write(b"\0" * 100)
      raise tf.errors.ResourceExhaustedError(None, None, "%s; No space left on device" % prefix)
    monkeypatch.setattr(tf.train.Checkpoint, "write", _full)
    reason = "No space left on device"
  else:                        # the index rewrite fails after the files are in place
    real = tf.io.gfile.GFile

    def _index_full(path, mode="r"):
      if os.path.basename(path).startswith("checkpoint.tmp") and "w" in mode:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
      return real(path, mode)
    monkeypatch.setattr(checkpoints_lib.tf.io.gfile, "GFile", _index_full)
    reason = "No space left on device"
  with pytest.raises(checkpoints_lib.CheckpointSaveError) as error:
    callback.on_epoch_end(1, {"loss": 0.4, "val_loss": 0.45})
  monkeypatch.undo()
  message = str(error.value)
  assert isinstance(error.value, UserError) and "\n" not in message
  assert reason in message and os.path.join(folder, "ckpt-2") in message
  assert_names(message, "previous checkpoint", os.path.join(folder, "ckpt-1"), "intact")
  assert read_index(folder) == ["ckpt-1"]
  for name, content in before.items():
    assert open(os.path.join(folder, name), "rb").read() == content
  assert not [name for name in os.listdir(folder) if name.startswith(".saving-")]
  readable_state(os.path.join(folder, "ckpt-1"))
  # The next save, with space again, works and cleans up.
  callback.on_epoch_end(2, {"loss": 0.3, "val_loss": 0.2})
  assert read_index(folder) == ["ckpt-1", "ckpt-3"]


def test_last_is_written_where_best_cannot_be_linked_and_outlives_it(tmp_path, monkeypatch):
  net, checkpoints, callback = toy_checkpoints(tmp_path)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})          # linked
  def _cross_device(*args):
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
  monkeypatch.setattr(checkpoints_lib.os, "link", _cross_device)     # a folder without hard links
  callback.on_epoch_end(1, {"loss": 0.4, "val_loss": 0.3})          # written
  monkeypatch.undo()
  last, best = (os.path.join(checkpoints.folder(which), "ckpt-2.data-00000-of-00001")
                for which in ("last", "best"))
  assert os.stat(last).st_ino != os.stat(best).st_ino and os.stat(last).st_nlink == 1
  assert open(last, "rb").read() == open(best, "rb").read()
  assert not [name for name in os.listdir(checkpoints.folder("last")) if name.startswith(".saving-")]
  # Best moved on and deleted its ckpt-1; last's ckpt-1, linked to it, stays whole and readable.
  assert read_index(checkpoints.folder("best")) == ["ckpt-2"]
  kept = os.path.join(checkpoints.folder("last"), "ckpt-1")
  assert os.stat(kept + ".index").st_nlink == 1 and readable_state(kept)["epoch"] == 1
  callback.on_epoch_end(2, {"loss": 0.3, "val_loss": 0.2})          # linked again
  weights = [w.numpy().copy() for w in net.weights]
  assert read_index(checkpoints.folder("last")) == ["ckpt-2", "ckpt-3"]
  for w in net.weights:
    w.assign(tf.zeros_like(w))
  assert checkpoints.restore_last()["epoch"] == 3
  for restored, saved in zip(net.weights, weights):
    np.testing.assert_array_equal(restored.numpy(), saved)


@pytest.mark.parametrize("trained, resumed, accepted", [
    ({}, {}, True),                                                       # the built-in data both times
    ({"data_path": "/data/w2c.h5"}, {"data_path": "/moved/w2c.h5"}, True),  # the same file, moved
    ({"data_path": "/data/w2c.h5"}, {}, False),                           # --data_path forgotten
    ({}, {"data_path": "/data/w2c.h5"}, False),
    ({"data_path": "/data/w2c.h5"}, {"data_path": "/data/other.h5"}, False),
    ({"data_path": "/data", "cell_name": "a"}, {"data_path": "/data", "cell_name": "b"}, False)])
def test_a_resume_trains_on_the_data_its_run_started_with(tmp_path, trained, resumed, accepted):
  """The checkpoints hold no data identity: a forgotten --data_path must not move the run to the built-in
  dataset in silence (and rewrite run_config.yaml with it)."""
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from training import loop  # pylint: disable=import-outside-toplevel
  from training.summary import write_run_config  # pylint: disable=import-outside-toplevel
  write_run_config(str(tmp_path), RunConfig(model="neuron_inverter", logdir=str(tmp_path), **trained))
  resuming = RunConfig(model="neuron_inverter", logdir=str(tmp_path), resume=True, **resumed)
  if accepted:
    loop.check_same_data(resuming)
  else:
    with pytest.raises(UserError) as caught:
      loop.check_same_data(resuming)
    advice = "--data_path=/data" if "data_path" in trained else "built-in dataset"
    assert_names(caught.value, "--resume", "trained on", advice)


def _checkpoints_keeping(tmp_path, keep_best, net=None):
  """A toy model's RunCheckpoints in `tmp_path` keeping the best `keep_best` epochs, and its callback."""
  if net is None:
    net = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
    net.compile(optimizer="adam", loss="mse")
  checkpoints = RunCheckpoints(str(tmp_path), net, {"model": "toy"}, keep_best=keep_best)
  callback = CheckpointCallback(checkpoints, LearningRateSchedule(1e-3, 0, 0.1, 1, 0))
  callback.set_model(net)
  return net, checkpoints, callback


def _epochs(callback, losses, first=0):
  for epoch, loss in enumerate(losses, start=first):
    callback.on_epoch_end(epoch, {"loss": loss, "val_loss": loss})


def test_best_keeps_the_k_lowest_validation_losses_the_lowest_current(tmp_path):
  net, checkpoints, callback = _checkpoints_keeping(tmp_path, keep_best=2)
  best = checkpoints.folder("best")
  _epochs(callback, [0.5, 0.3])
  assert read_index(best) == ["ckpt-1", "ckpt-2"]
  _epochs(callback, [0.4], first=2)                  # not the lowest, but among the best 2: replaces 0.5
  assert read_index(best) == ["ckpt-3", "ckpt-2"] and callback.best_epoch == 2
  _epochs(callback, [0.6], first=3)                  # worse than both: not saved there
  assert read_index(best) == ["ckpt-3", "ckpt-2"]
  _epochs(callback, [0.2], first=4)
  assert read_index(best) == ["ckpt-2", "ckpt-5"]
  assert sorted(os.listdir(best)) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
                                      "ckpt-5.data-00000-of-00001", "ckpt-5.index"]
  with open(os.path.join(best, "checkpoint")) as f:  # TensorFlow's readers name the lowest
    assert f.readline().strip() == 'model_checkpoint_path: "ckpt-5"'
  assert tf.train.latest_checkpoint(best) == os.path.join(best, "ckpt-5")
  assert checkpoints_lib.best_or_last(str(tmp_path)) == os.path.join(best, "ckpt-5")
  assert checkpoints.restore_best_weights()["best_epoch"] == 5
  assert [(entry["epoch"], entry["val_loss"]) for entry in checkpoints_lib.best_checkpoints(str(tmp_path))] == [
      (5, 0.2), (2, 0.3)]
  assert read_index(checkpoints.folder("last")) == ["ckpt-4", "ckpt-5"]

  # A resumed run (another process) ranks by the losses the checkpoints in `best` hold.
  _, resumed, callback = _checkpoints_keeping(tmp_path, keep_best=2)
  callback.restore_into(resumed.restore_last())
  assert callback.best_losses == [0.2, 0.3]
  _epochs(callback, [0.35], first=5)                 # not among the best 2
  assert read_index(best) == ["ckpt-2", "ckpt-5"]
  _epochs(callback, [0.25], first=6)
  assert read_index(best) == ["ckpt-7", "ckpt-5"]


def test_a_failed_save_of_one_of_the_best_k_keeps_them_all(tmp_path, monkeypatch):
  _, checkpoints, callback = _checkpoints_keeping(tmp_path, keep_best=2)
  _epochs(callback, [0.5, 0.3])
  best = checkpoints.folder("best")
  before = {name: open(os.path.join(best, name), "rb").read() for name in os.listdir(best)}
  monkeypatch.setattr(checkpoints_lib, "_write_index", _enospc)
  with pytest.raises(checkpoints_lib.CheckpointSaveError) as caught:
    _epochs(callback, [0.1], first=2)
  assert_names(caught.value, "previous checkpoint", os.path.join(best, "ckpt-2"), "intact")
  monkeypatch.undo()
  assert read_index(best) == ["ckpt-1", "ckpt-2"]  # the new files, unlisted, go at the next save's sweep
  for name, content in before.items():
    assert open(os.path.join(best, name), "rb").read() == content
  for name in ("ckpt-1", "ckpt-2"):
    readable_state(os.path.join(best, name))


def test_a_resumed_run_keeps_the_better_model_a_killed_save_put_in_best(tmp_path):
  """Killed between best's save and last's: best holds an epoch that last's state does not know of."""
  _, checkpoints, callback = _checkpoints_keeping(tmp_path, keep_best=2)
  _epochs(callback, [0.5])
  state = checkpoints.restore_last()
  checkpoints.save("best", dict(state, epoch=2, best_val_loss=0.3, best_epoch=2,
                                epoch_logs=state["epoch_logs"] + [{"epoch": 2, "val_loss": 0.3}]))
  _, resumed, callback = _checkpoints_keeping(tmp_path, keep_best=2)
  callback.restore_into(resumed.restore_last())
  assert callback.best_losses == [0.3, 0.5] and callback.best_epoch == 2
  _epochs(callback, [0.4], first=1)               # the same epoch again: among the best 2
  assert read_index(checkpoints.folder("best")) == ["ckpt-2-1", "ckpt-2"]


def _toy_run(tmp_path, identity=None, outputs=2, inputs=3):
  """A toy run folder in `tmp_path` with epochs 1 (best) and 2 saved; its network."""
  net = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(inputs,)), tf.keras.layers.Dense(outputs)])
  net.compile(optimizer=optimizers.make_optimizer("adam", 1e-3), loss="mse")
  net.fit(np.ones((4, inputs)), np.ones((4, outputs)), verbose=0)
  checkpoints = RunCheckpoints(str(tmp_path), net, identity or {"model": "toy", "optimizer": "adam"})
  callback = CheckpointCallback(checkpoints, LearningRateSchedule(1e-3, 0, 0.1, 1, 0))
  callback.set_model(net)
  callback.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.4})
  best = [w.copy() for w in net.get_weights()]
  net.fit(np.ones((4, inputs)), np.ones((4, outputs)), verbose=0)
  callback.on_epoch_end(1, {"loss": 0.4, "val_loss": 0.6})
  return net, best


def _new_network(outputs=2, inputs=3, strategy=None):
  with (strategy or tf.distribute.get_strategy()).scope():
    net = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(inputs,)), tf.keras.layers.Dense(outputs)])
    net.compile(optimizer=optimizers.make_optimizer("adam", 5e-3), loss="mse")
    optimizers.create_slots(net.optimizer, net.trainable_variables)
  return net


def test_init_from_loads_the_network_weights_of_the_best_checkpoint_alone(tmp_path):
  """On 2 replicas (the run it starts from had 1), into each replica; the optimizer state stays new."""
  _, best = _toy_run(tmp_path / "a")
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  net = _new_network(strategy=strategy)
  optimizer_state = [variable.numpy() for variable in net.optimizer.variables()]
  init = checkpoints_lib.load_initial_weights(net, str(tmp_path / "a"), {"model": "toy", "optimizer": "sgd"})
  assert init["checkpoint"] == str(tmp_path / "a" / "checkpoints" / "best" / "ckpt-1")
  assert init["run"] == str(tmp_path / "a") and init["epoch"] == 1 and init["step"] == 0
  assert init["val_loss"] == pytest.approx(0.4)
  for weight, expected in zip(net.weights, best):
    for replica in weight.values:
      np.testing.assert_array_equal(replica.numpy(), expected)
  assert init["weights_sha256"] == checkpoints_lib.weights_digest(net)
  # The same optimizer family as the checkpoint's: a checkpoint of the model would restore its state too.
  assert int(net.optimizer.iterations.numpy()) == 0 and len(optimizer_state) > 1
  assert float(tf.keras.backend.get_value(net.optimizer.learning_rate)) == pytest.approx(5e-3)
  for variable, before in zip(net.optimizer.variables(), optimizer_state):
    np.testing.assert_array_equal(variable.numpy(), before)


@pytest.mark.parametrize("given, expected, run", [
    ("a", "a/checkpoints/best/ckpt-1", "a"),                            # a run folder: its best
    ("a/checkpoints/last", "a/checkpoints/last/ckpt-2", "a"),            # a checkpoint folder: its newest
    ("a/checkpoints/last/ckpt-1", "a/checkpoints/last/ckpt-1", "a"),     # a checkpoint
    ("a/checkpoints/last/ckpt-2.index", "a/checkpoints/last/ckpt-2", "a"),
    ("moved/ckpt-2", "moved/ckpt-2", None),                              # outside a run folder
    ("no_best", "no_best/checkpoints/last/ckpt-2", "no_best")])          # a run folder without best
def test_init_from_takes_a_run_folder_or_a_checkpoint(tmp_path, given, expected, run):
  _toy_run(tmp_path / "a")
  os.makedirs(str(tmp_path / "moved"))
  for name in os.listdir(str(tmp_path / "a" / "checkpoints" / "last")):
    if name.startswith("ckpt-2"):
      os.link(str(tmp_path / "a" / "checkpoints" / "last" / name), str(tmp_path / "moved" / name))
  shutil.copytree(str(tmp_path / "a"), str(tmp_path / "no_best"))
  shutil.rmtree(str(tmp_path / "no_best" / "checkpoints" / "best"))
  checkpoint, found_run = checkpoints_lib.resolve_init_from(str(tmp_path / given))
  assert checkpoint == str(tmp_path / expected)
  assert found_run == (str(tmp_path / run) if run else None)


def test_init_from_refuses_what_holds_no_checkpoint(tmp_path):
  _toy_run(tmp_path / "a")
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  (tmp_path / "notes.txt").write_text("x")
  for given, fragment in (("empty", "has no checkpoint"), ("notes.txt", "neither a run folder"),
                          ("a/checkpoints", "neither a run folder")):
    with pytest.raises(UserError, match="^--init_from: .*%s" % fragment):
      checkpoints_lib.resolve_init_from(str(tmp_path / given))
  data = tmp_path / "a" / "checkpoints" / "best" / "ckpt-1.data-00000-of-00001"
  data.write_bytes(b"\0" * len(data.read_bytes()))  # damaged in place
  with pytest.raises(UserError, match="^--init_from: ") as error:
    checkpoints_lib.load_initial_weights(_new_network(), str(tmp_path / "a"), {"model": "toy"})
  assert_names(error.value, "ckpt-1", "unreadable")
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("identity, outputs, inputs, names", [
    ({"model": "toy", "design": "big"}, 2, 3, ("toy (design=small, 2 outputs)", "toy (design=big, 2 outputs)",
                                               "--design")),
    ({"model": "other", "design": None}, 2, 3, ("toy (design=small, 2 outputs)", "other (2 outputs)", "--model")),
    ({"model": "toy", "design": "small", "batch_norm_statistics": "batch"}, 2, 3,
     ("toy (design=small, 2 outputs)", "(design=small, batch_norm_statistics=batch,", "--batch_norm_statistics")),
    ({"model": "toy", "design": "small"}, 5, 3, ("toy (design=small, 5 outputs)", "4x2 and 2 there",
                                                 "4x5 and 5 here")),
    ({"model": "toy", "design": "small"}, 2, 7, ("toy (design=small, 2 outputs)", "3x4 and 4 there",
                                                 "7x4 and 4 here"))])
def test_init_from_another_network_is_an_error_naming_both(tmp_path, identity, outputs, inputs, names):
  """The optimizer and learning rate may differ (the run's own); the network may not."""
  _toy_run(tmp_path / "a", {"model": "toy", "design": "small", "optimizer": "adam", "learning_rate": 1e-3})
  net = _new_network(outputs, inputs)
  before = [w.copy() for w in net.get_weights()]
  with pytest.raises(UserError) as error:
    checkpoints_lib.load_initial_weights(net, str(tmp_path / "a"), dict(identity, optimizer="sgd",
                                                                          learning_rate=0.1))
  message = str(error.value)
  assert message.startswith("--init_from: %s " % (tmp_path / "a" / "checkpoints" / "best" / "ckpt-1"))
  assert "\n" not in message
  assert_names(message, *names)
  for weight, unchanged in zip(net.get_weights(), before):
    np.testing.assert_array_equal(weight, unchanged)


def test_init_from_loads_32_bit_weights_under_mixed_precision_only(tmp_path):
  """16.32 (mixed) keeps float32 weights, as 32.32 does; 16.16's are 16-bit, which a checkpoint cannot
  restore 32-bit weights into."""
  _, best = _toy_run(tmp_path / "a")
  for dtype in ("mixed_float16", "float16"):
    net = tf.keras.Sequential([tf.keras.layers.Dense(4, input_shape=(3,), dtype=dtype),
                               tf.keras.layers.Dense(2, dtype="float32")])
    net.compile(optimizer=optimizers.make_optimizer("adam", 1e-3), loss="mse")
    if dtype == "mixed_float16":
      checkpoints_lib.load_initial_weights(net, str(tmp_path / "a"), {"model": "toy"})
      for weight, expected in zip(net.get_weights(), best):
        np.testing.assert_array_equal(weight, expected)
    else:
      with pytest.raises(UserError, match="^--init_from: ") as caught:
        checkpoints_lib.load_initial_weights(net, str(tmp_path / "a"), {"model": "toy"})
      assert_names(caught.value, "ckpt-1", "float32 weights", "float16 and float32", "--precision=32.32", "16.32")
