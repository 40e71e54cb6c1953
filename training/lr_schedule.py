"""Learning-rate schedules: linear warm-up, then the reference's reduce-on-plateau, or a cosine decay.

Warm-up sets `lr = initial * (epoch + 1) / warmup_epochs` at the start of each warm-up epoch. After it:
- `plateau` (the reference): PyTorch's ReduceLROnPlateau (mode min, relative threshold 1e-4,
  `patience`, `cooldown`, `factor`), stepped with the validation loss of epochs past the warm-up. All
  its state is a plain dict so that checkpoints can store it and `--resume` continues the same schedule.
- `cosine`: set before every step, from `initial` down to 0 at the end of the last epoch (half a
  cosine). It needs no state: the rate is a function of the step, also after a resume. A short run
  ends at a low rate instead of stopping before its first plateau (patience is 8 epochs).
"""

import math

import tensorflow as tf
from absl import logging

RELATIVE_THRESHOLD = 1e-4


class PlateauState:
  """ReduceLROnPlateau bookkeeping, as plain data."""

  def __init__(self, lr, factor, patience, cooldown):
    self.lr, self.factor, self.patience, self.cooldown = lr, factor, patience, cooldown
    self.best, self.bad_epochs, self.cooldown_left = math.inf, 0, 0

  def step(self, value: float) -> bool:
    """Feeds one validation loss; returns True when the rate was reduced."""
    if value < self.best * (1.0 - RELATIVE_THRESHOLD):
      self.best, self.bad_epochs = value, 0
    else:
      self.bad_epochs += 1
    if self.cooldown_left > 0:
      self.cooldown_left -= 1
      self.bad_epochs = 0
    if self.bad_epochs > self.patience:
      self.lr *= self.factor
      self.cooldown_left, self.bad_epochs = self.cooldown, 0
      return True
    return False

  def to_dict(self) -> dict:
    return {"lr": self.lr, "best": self.best, "bad_epochs": self.bad_epochs,
            "cooldown_left": self.cooldown_left}

  def load(self, state: dict) -> None:
    self.lr, self.best = float(state["lr"]), float(state["best"])
    self.bad_epochs, self.cooldown_left = int(state["bad_epochs"]), int(state["cooldown_left"])


def warmup_lr(initial_lr: float, warmup_epochs: int, epoch: int):
  """The warm-up rate of `epoch`, or None once warm-up is over."""
  if epoch < warmup_epochs:
    return initial_lr * (epoch + 1) / warmup_epochs
  return None


def cosine_lr(initial_lr: float, progress: float) -> float:
  """The cosine decay's rate at `progress` (0 at the end of the warm-up, 1 at the end of training)."""
  return initial_lr * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


class Cosine:
  """Where a step is in the cosine decay: `epochs` epochs of `steps_per_epoch` steps after warm-up.

  `resumed_epoch` / `resumed_step`: a run resumed mid-epoch trains the rest of that epoch as a fit of
  its own, whose step numbers start again at 0.
  """

  def __init__(self, epochs, steps_per_epoch, resumed_epoch=None, resumed_step=0):
    self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
    self.resumed_epoch, self.resumed_step = resumed_epoch, resumed_step

  def progress(self, epoch: int, warmup_epochs: int, batch: int) -> float:
    step = batch + (self.resumed_step if epoch == self.resumed_epoch else 0)
    decay_epochs = max(self.epochs - warmup_epochs, 1)
    return (epoch - warmup_epochs + step / self.steps_per_epoch) / decay_epochs


class LearningRateSchedule(tf.keras.callbacks.Callback):
  """Sets the optimizer's rate (every epoch, or every step with `cosine`); logs it as `lr`."""

  def __init__(self, initial_lr, warmup_epochs, factor, patience, cooldown, monitor="val_loss",
               cosine: Cosine = None):
    super().__init__()
    self.initial_lr, self.warmup_epochs, self.monitor = initial_lr, warmup_epochs, monitor
    self.plateau = PlateauState(initial_lr, factor, patience, cooldown)
    self.current_lr = initial_lr
    self.cosine, self.epoch = cosine, 0
    self._reduced = None  # the last epoch's plateau line, logged once Keras' bar has ended its line

  def _log_reduction(self) -> None:
    if self._reduced:
      logging.info(self._reduced)
      self._reduced = None

  def on_epoch_begin(self, epoch, logs=None):
    self._log_reduction()
    self.epoch = epoch
    warm = warmup_lr(self.initial_lr, self.warmup_epochs, epoch)
    self.current_lr = self.plateau.lr if warm is None else warm
    if warm is None and self.cosine is not None:
      self.on_train_batch_begin(0)
      return
    tf.keras.backend.set_value(self.model.optimizer.lr, self.current_lr)

  def on_train_batch_begin(self, batch, logs=None):
    if self.cosine is None or self.epoch < self.warmup_epochs:
      return
    self.current_lr = cosine_lr(self.initial_lr, self.cosine.progress(self.epoch, self.warmup_epochs, batch))
    tf.keras.backend.set_value(self.model.optimizer.lr, self.current_lr)

  def on_epoch_end(self, epoch, logs=None):
    if logs is None:
      return
    logs["lr"] = self.current_lr
    if self.cosine is None and epoch >= self.warmup_epochs and self.monitor in logs:
      if self.plateau.step(float(logs[self.monitor])):
        # Not now: this runs before the progress bar's last update, whose line is still open.
        self._reduced = "Epoch %d: %s plateaued, learning rate reduced to %.3g" % (
            epoch + 1, self.monitor, self.plateau.lr)

  def on_train_end(self, logs=None):
    self._log_reduction()
