"""Ending training before --epochs: early stopping on the validation loss, and a target loss reached.

Both read the validation loss that the checkpoint callback has just ranked (they come after it among the
callbacks), so the epoch that stops a run is saved first, and the best epoch is the checkpoints' best.
"""

import math
import time

import tensorflow as tf
from absl import logging


class EarlyStopping(tf.keras.callbacks.EarlyStopping):
  """Keras' early stopping on `val_loss`, continued across fits and resumes.

  Keras starts its count afresh at every fit; a run resumed after 5 epochs without improvement, or one
  whose resumed partial epoch is a fit of its own (training/loop.py `_fit`), would wait `patience`
  epochs more. So each fit starts from the checkpoints' record: the best loss so far and its epoch.
  """

  def __init__(self, patience: int, checkpointing):
    super().__init__(monitor="val_loss", patience=patience, mode="min", verbose=0)
    self._checkpointing = checkpointing
    self.stopped_after = None  # the 1-based epoch after which it stopped training
    self._said = False

  def on_train_begin(self, logs=None):
    super().on_train_begin(logs)
    best, best_epoch = self._checkpointing.best_val_loss, self._checkpointing.best_epoch
    if best_epoch is not None and math.isfinite(best):
      self.best = best
      logs_so_far = self._checkpointing.epoch_logs
      self.wait = max((logs_so_far[-1]["epoch"] if logs_so_far else 0) - best_epoch, 0)

  def on_epoch_end(self, epoch, logs=None):
    super().on_epoch_end(epoch, logs)
    if self.model.stop_training and self.stopped_after is None:
      self.stopped_after = epoch + 1

  def on_train_end(self, logs=None):
    # Said here, after the epoch's own line; Keras' message (verbose) counts epochs from 0.
    if self.stopped_after is not None and not self._said:
      self._said = True
      logging.info("Stopped early after epoch %d: no lower validation loss for %d epochs (the best, %.4f, "
                   "was epoch %s)", self.stopped_after, self.patience, self.best, self._checkpointing.best_epoch)


class TargetLoss(tf.keras.callbacks.Callback):
  """Ends training at the first epoch whose validation loss is at or below `target`, and keeps the time
  it took, from the process start and from the start of training (MLPerf HPC's time to train)."""

  def __init__(self, target: float, process_started: float, clock=time.monotonic):
    super().__init__()
    self.target = target
    self._process_started = process_started
    self._clock = clock
    self._training_started = None
    self.reached = None  # {"epoch", "val_loss", "seconds", "training_seconds"} once reached

  def on_train_begin(self, logs=None):
    if self._training_started is None:  # the first fit's start (a resumed partial epoch has two)
      self._training_started = self._clock()

  def on_epoch_end(self, epoch, logs=None):
    loss = (logs or {}).get("val_loss")
    if self.reached is not None or loss is None or not float(loss) <= self.target:
      return
    now = self._clock()
    self.reached = {"epoch": epoch + 1, "val_loss": float(loss), "seconds": now - self._process_started,
                    "training_seconds": now - self._training_started}
    self.model.stop_training = True

  def on_train_end(self, logs=None):
    if self.reached and not self.reached.get("said"):  # after the epoch's own line
      self.reached["said"] = True
      logging.info("Target reached: validation loss %.4f <= %g after epoch %d, %.1f s from the start "
                   "(%.1f s of training)", self.reached["val_loss"], self.target, self.reached["epoch"],
                   self.reached["seconds"], self.reached["training_seconds"])


def stopped(callbacks) -> bool:
  """Whether one of `callbacks` ended training before its epochs (so no further fit should start)."""
  return any(getattr(callback, "stopped_after", None) or getattr(callback, "reached", None)
             for callback in callbacks if isinstance(callback, (EarlyStopping, TargetLoss)))


def record(callbacks, target_loss=None) -> dict:
  """summary.yaml's keys on how training ended: `stopped_early` (null, or the epoch after which and why),
  and with a --target_loss, `time_to_target_seconds` (from the process start), its training part
  `time_to_target_training_seconds` and `target_epoch` (each null when the target was not reached)."""
  result = {"stopped_early": None}
  for callback in callbacks:
    if isinstance(callback, TargetLoss) and callback.reached:
      result["stopped_early"] = {"after_epoch": callback.reached["epoch"], "reason": "target_loss"}
    elif isinstance(callback, EarlyStopping) and callback.stopped_after:
      result["stopped_early"] = {"after_epoch": callback.stopped_after, "reason": "early_stopping"}
  if target_loss is not None:
    reached = next((c.reached for c in callbacks if isinstance(c, TargetLoss) and c.reached), None) or {}
    result.update({"time_to_target_seconds": reached.get("seconds"),
                   "time_to_target_training_seconds": reached.get("training_seconds"),
                   "target_epoch": reached.get("epoch")})
  return result
