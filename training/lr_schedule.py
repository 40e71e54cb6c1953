"""Learning-rate schedule of the reference: linear warm-up, then reduce-on-plateau of the val loss.

Warm-up sets `lr = initial * (epoch + 1) / warmup_epochs` at the start of each warm-up epoch. After it,
the rate follows PyTorch's ReduceLROnPlateau (mode min, relative threshold 1e-4, `patience`,
`cooldown`, `factor`), stepped with the validation loss of epochs past the warm-up. All state is a plain
dict so that checkpoints can store it and `--resume` continues the same schedule.
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


class WarmupPlateauSchedule(tf.keras.callbacks.Callback):
  """Sets the optimizer's rate every epoch and records it in the logs as `lr`."""

  def __init__(self, initial_lr, warmup_epochs, factor, patience, cooldown, monitor="val_loss"):
    super().__init__()
    self.initial_lr, self.warmup_epochs, self.monitor = initial_lr, warmup_epochs, monitor
    self.plateau = PlateauState(initial_lr, factor, patience, cooldown)
    self.current_lr = initial_lr

  def on_epoch_begin(self, epoch, logs=None):
    warm = warmup_lr(self.initial_lr, self.warmup_epochs, epoch)
    self.current_lr = self.plateau.lr if warm is None else warm
    tf.keras.backend.set_value(self.model.optimizer.lr, self.current_lr)

  def on_epoch_end(self, epoch, logs=None):
    if logs is None:
      return
    logs["lr"] = self.current_lr
    if epoch >= self.warmup_epochs and self.monitor in logs:
      if self.plateau.step(float(logs[self.monitor])):
        logging.info("Epoch %d: %s plateaued, learning rate reduced to %.3g",
                     epoch + 1, self.monitor, self.plateau.lr)
