"""Checkpoints of a run (`<logdir>/checkpoints/{last,best}`) and `--resume`.

TensorFlow's CheckpointManager writes each checkpoint's files and only then atomically rewrites its
`checkpoint` index, keeping the previous checkpoint on disk: a job killed mid-save resumes from the
last complete one. The run's own state (epoch, learning-rate schedule, best validation loss, which
model wrote it) is a JSON string variable inside the same checkpoint, so it can never disagree with the
weights and optimizer state saved beside it.
"""

import json
import math
import os

import tensorflow as tf
from absl import logging

from errors import UserError

LAST, BEST = "last", "best"


class RunCheckpoints:
  """Saves and restores model + optimizer + run state."""

  def __init__(self, logdir: str, model: tf.keras.Model, identity: dict, restore_logdir: str = None):
    self.directory = os.path.join(logdir, "checkpoints")
    # Non-chief workers write to a temporary folder but resume from the chief's checkpoints.
    self.restore_directory = os.path.join(restore_logdir or logdir, "checkpoints")
    self.identity = identity                      # e.g. {"model": ..., "design": ...}
    self._state = tf.Variable("{}", dtype=tf.string, trainable=False, name="run_state")
    self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, run_state=self._state)
    self._managers = {name: tf.train.CheckpointManager(self._checkpoint, os.path.join(self.directory, name),
                                                       max_to_keep=2 if name == LAST else 1)
                      for name in (LAST, BEST)}

  def save(self, which: str, state: dict) -> str:
    self._state.assign(json.dumps(dict(state, **self.identity)))
    path = self._managers[which].save(checkpoint_number=state["epoch"])
    return path

  def restore_last(self) -> dict:
    """Restores the last checkpoint; returns its run state. A UserError if there is none or it mismatches."""
    return self._restore(LAST)

  def restore_best_weights(self) -> dict:
    """Loads the weights of the best-validation checkpoint (for the final test); returns its state."""
    return self._restore(BEST)

  def _restore(self, which: str) -> dict:
    folder = os.path.join(self.restore_directory, which)
    path = tf.train.latest_checkpoint(folder)
    if path is None:
      raise UserError("--resume: no checkpoint in %s" % folder)
    try:
      self._checkpoint.restore(path).expect_partial()
      state = json.loads(self._state.numpy().decode())
    except (tf.errors.OpError, ValueError) as error:
      raise UserError("--resume: checkpoint %s is unreadable (%s)" % (path, str(error).splitlines()[0])) \
          from None
    check_identity(path, state, self.identity)
    logging.info("Restored %s (epoch %d)", path, state["epoch"])
    return state


class CheckpointCallback(tf.keras.callbacks.Callback):
  """Saves `last` every epoch and `best` when the validation loss improves."""

  def __init__(self, checkpoints: RunCheckpoints, schedule, best_val_loss=math.inf, best_epoch=None):
    super().__init__()
    self.checkpoints, self.schedule = checkpoints, schedule
    self.best_val_loss, self.best_epoch = best_val_loss, best_epoch
    self.last_saved = None   # path of the newest good checkpoint written by this run

  def on_epoch_end(self, epoch, logs=None):
    logs = logs or {}
    if not all(math.isfinite(float(logs.get(key, 0.0))) for key in ("loss", "val_loss")):
      logging.warning("Epoch %d ended with a NaN/Inf loss: its weights are not checkpointed", epoch + 1)
      return
    val_loss = logs.get("val_loss")
    improved = val_loss is not None and val_loss < self.best_val_loss
    if improved:
      self.best_val_loss, self.best_epoch = float(val_loss), epoch + 1
    state = {"epoch": epoch + 1, "schedule": self.schedule.plateau.to_dict(),
             "best_val_loss": self.best_val_loss, "best_epoch": self.best_epoch}
    self.last_saved = self.checkpoints.save(LAST, state)
    if improved:
      self.checkpoints.save(BEST, state)


def check_identity(path: str, state: dict, identity: dict) -> None:
  for key, value in identity.items():
    if state.get(key) != value:
      raise UserError("--resume: %s was written with %s=%s, this run has %s=%s"
                      % (path, key, state.get(key), key, value))


def peek_last_state(logdir: str, identity: dict) -> dict:
  """The run state of the last checkpoint, read without building the model (to position the data)."""
  directory = os.path.join(logdir, "checkpoints", LAST)
  path = tf.train.latest_checkpoint(directory)
  if path is None:
    raise UserError("--resume: no checkpoint in %s" % directory)
  try:
    raw = tf.train.load_checkpoint(path).get_tensor("run_state/.ATTRIBUTES/VARIABLE_VALUE")
    state = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
  except (tf.errors.OpError, ValueError) as error:
    raise UserError("--resume: checkpoint %s is unreadable (%s)" % (path, str(error).splitlines()[0])) \
        from None
  check_identity(path, state, identity)
  return state
