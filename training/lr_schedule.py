"""Learning-rate schedules: linear warm-up, then the reference's reduce-on-plateau, or a cosine decay.

Warm-up sets `lr = initial * (epoch + 1) / warmup_epochs` at the start of each warm-up epoch. After it:
- `plateau` (the reference): PyTorch's ReduceLROnPlateau (mode min, relative threshold 1e-4,
  `patience`, `cooldown`, `factor`), stepped with the validation loss of epochs past the warm-up. All
  its state is a plain dict so that checkpoints can store it and `--resume` continues the same schedule.
- `cosine`: from `initial` down to 0 at the end of the last epoch (half a cosine), a new rate for
  every optimizer update. A short run ends at a low rate instead of stopping before its first
  plateau (patience is 8 epochs). The rate is a function of the optimizer's update count alone
  (`CosineRate`, handed to the optimizer as its learning rate), so the training step computes it
  itself: on IPUs, where one device execution runs many steps and a callback sees only its ends
  (graphcore/keras keras/ipu/docs/keras.rst: per-batch callbacks are invoked every
  `steps_per_execution` steps), the rate still changes at every update, and a resumed run continues
  from its checkpointed count with no bookkeeping of its own.

Warm-up and plateau rates change once per epoch, so the callback sets them.
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


def _warm_rate(initial_lr, warmup_epochs: int, epoch):
  """The linear warm-up's rate in `epoch` (a number or, in the training step, a tensor)."""
  return initial_lr * (epoch + 1) / max(warmup_epochs, 1)


def warmup_lr(initial_lr: float, warmup_epochs: int, epoch: int):
  """The warm-up rate of `epoch`, or None once warm-up is over."""
  if epoch < warmup_epochs:
    return _warm_rate(initial_lr, warmup_epochs, epoch)
  return None


class CosineRate(tf.keras.optimizers.schedules.LearningRateSchedule):
  """The `cosine` schedule as the optimizer's learning rate: the rate of update `step` (counted from 0
  over the whole run), with `updates_per_epoch` optimizer updates per epoch. Warm-up epochs, if any,
  come first at the warm-up rate."""

  def __init__(self, initial_lr: float, warmup_epochs: int, epochs: int, updates_per_epoch: int):
    super().__init__()
    self.initial_lr, self.warmup_epochs = initial_lr, warmup_epochs
    self.epochs, self.updates_per_epoch = epochs, max(updates_per_epoch, 1)

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    epoch = tf.floor(step / self.updates_per_epoch)
    warm = _warm_rate(self.initial_lr, self.warmup_epochs, epoch)
    decay_updates = max(self.epochs - self.warmup_epochs, 1) * self.updates_per_epoch
    progress = tf.clip_by_value((step - self.warmup_epochs * self.updates_per_epoch) / decay_updates,
                                0.0, 1.0)
    decayed = self.initial_lr * 0.5 * (1.0 + tf.cos(math.pi * progress))
    return tf.where(epoch < self.warmup_epochs, warm, decayed)

  def get_config(self):
    return {"initial_lr": self.initial_lr, "warmup_epochs": self.warmup_epochs, "epochs": self.epochs,
            "updates_per_epoch": self.updates_per_epoch}


def optimizer_rate(config, updates_per_epoch: int):
  """The learning rate to build the optimizer with: a CosineRate for `--lr_schedule=cosine`, else
  the initial rate, which the callback then sets per epoch."""
  if config.lr_schedule == "cosine":
    return CosineRate(config.learning_rate, config.warmup_epochs, config.epochs, updates_per_epoch)
  return config.learning_rate


def warmup_problem(warmup_epochs: int, epochs: int, schedule: str):
  """A warning when the warm-up leaves no epoch to the schedule after it (None otherwise)."""
  if not warmup_epochs or warmup_epochs < epochs:
    return None
  return ("the learning-rate warm-up (--warmup_epochs=%d) covers the whole run of %d epoch%s: the %s "
          "schedule after it never starts (lower --warmup_epochs, or raise --epochs)"
          % (warmup_epochs, epochs, "" if epochs == 1 else "s", schedule))


class LearningRateSchedule(tf.keras.callbacks.Callback):
  """Sets the optimizer's rate at every epoch's start (warm-up, then plateau), or with `cosine` (the
  optimizer's CosineRate) leaves it to the optimizer; logs the rate of the epoch's last update as `lr`."""

  def __init__(self, initial_lr, warmup_epochs, factor, patience, cooldown, monitor="val_loss",
               cosine: CosineRate = None):
    super().__init__()
    self.initial_lr, self.warmup_epochs, self.monitor = initial_lr, warmup_epochs, monitor
    self.plateau = PlateauState(initial_lr, factor, patience, cooldown)
    self.current_lr = initial_lr
    self.cosine = cosine
    self._reduced = None  # the last epoch's plateau line, logged once Keras' bar has ended its line

  def _log_reduction(self) -> None:
    if self._reduced:
      logging.info(self._reduced)
      self._reduced = None

  def on_epoch_begin(self, epoch, logs=None):
    self._log_reduction()
    if self.cosine is not None:
      return
    warm = warmup_lr(self.initial_lr, self.warmup_epochs, epoch)
    self.current_lr = self.plateau.lr if warm is None else warm
    tf.keras.backend.set_value(self.model.optimizer.lr, self.current_lr)

  def on_epoch_end(self, epoch, logs=None):
    if logs is None:
      return
    if self.cosine is not None:
      self.current_lr = float(self.cosine((epoch + 1) * self.cosine.updates_per_epoch - 1))
    logs["lr"] = self.current_lr
    if self.cosine is None and epoch >= self.warmup_epochs and self.monitor in logs:
      if self.plateau.step(float(logs[self.monitor])):
        # Not now: this runs before the progress bar's last update, whose line is still open.
        self._reduced = "Epoch %d: %s plateaued, learning rate reduced to %.3g" % (
            epoch + 1, self.monitor, self.plateau.lr)

  def on_train_end(self, logs=None):
    self._log_reduction()
