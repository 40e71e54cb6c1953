"""Keras callbacks that report what a person watching a run wants to know: compile time, speed, progress
inside an epoch, and the TensorBoard scalars of epochs and steps."""

import csv
import io
import math
import os
import shutil
import time

import tensorflow as tf
from absl import logging

from host import atomic_files
from training.logs import duration
from training.run_folder import HISTORY_FILE


def _cache_entries(folder) -> set:
  """Files in an executable cache folder (Poplar .poplar_exec files or XLA cache entries)."""
  if not folder or not os.path.isdir(folder):
    return set()
  return {os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
          if not name.endswith((".compile_lock", ".read_lock"))}


# Values the callbacks add to each epoch's logs for TensorBoard and History, which EpochLogger's line
# says in its own words (ThroughputCallback's, and the learning-rate schedule's "lr").
BOOKKEEPING_KEYS = ("epoch_seconds", "epoch_wall_seconds", "samples_per_sec", "samples_per_sec_per_replica",
                    "samples_per_sec_with_compilation", "lr")


# Keras names an epoch's scalar `epoch_` + its key; these keys already start with it (History and
# summary.yaml keep them), so TensorBoard gets them without it: `epoch_seconds`, not `epoch_epoch_seconds`.
_TENSORBOARD_NAMES = {"epoch_seconds": "seconds", "epoch_wall_seconds": "wall_seconds"}


class EpochScalars(tf.keras.callbacks.TensorBoard):
  """Keras' TensorBoard writer without its own `learning_rate` scalar, and without a doubled `epoch_`;
  with `every_n_steps`, the training loss and learning rate every that many optimizer updates too.

  With a LearningRateSchedule (the default cosine), Keras adds `epoch_learning_rate`: the rate of the
  next epoch's first update. The run's schedule callback already logs `lr`, the rate of the epoch's
  last update, which the epoch line, summary.yaml and the curves show; two nearly equal charts would
  only make a user ask which one is right.

  The step scalars, `batch_loss` and `batch_learning_rate`, go to the same `train` events at the
  optimizer's update count (`iterations`, which a resumed run restores), at the first batch end at or
  after each multiple of `every_n_steps`. `batch_loss` is the mean training loss of the steps since the
  previous point (an epoch's last steps count in the next epoch's first point), worked out from Keras'
  running means of the epoch, which weigh each step alike (its batches are of one size);
  `batch_learning_rate` is the rate of the update that brought the count to the point's step, as `lr`
  at an epoch's end. Keras' own `update_freq=N` does not serve: its step is the fit's step counter
  (`model._train_counter`, from 0 at each fit, so that the rest of a resumed epoch and the epochs after
  it would overlap; a micro-batch on IPUs), its values each metric's running mean of the epoch and no
  learning rate; Keras 2.6 writes them in the training graph, tf_keras after reading the counter at
  every batch end.

  Cost: a little arithmetic at each batch end (Keras calls it once per execution of steps_per_execution
  steps, `batch` being the last), counting `steps_per_update` Keras steps an optimizer update (the
  gradient accumulation count on IPUs, where a step is a micro-batch; 1 elsewhere). Only where that
  count reaches a point, and at an epoch's last batch, are the update count and the loss read (a wait
  for the step, which the callbacks reading Keras' logs make at every batch end anyway); at a point,
  two scalars are written.
  """

  def __init__(self, *args, every_n_steps: int = 0, steps_per_update: int = 1, **kwargs):
    super().__init__(*args, **kwargs)
    self.every_n_steps, self.steps_per_update = every_n_steps, max(steps_per_update, 1)
    self._carried = (0.0, 0)  # loss x steps, steps: the last epoch's tail since its last point

  def on_epoch_end(self, epoch, logs=None):
    super().on_epoch_end(epoch, {_TENSORBOARD_NAMES.get(key, key): value
                                 for key, value in (logs or {}).items()})

  def _collect_learning_rate(self, logs):  # Keras' private hooks here: tf_workarounds.REGISTRY
    return logs

  def _implements_train_batch_hooks(self):
    return bool(self.every_n_steps) or super()._implements_train_batch_hooks()

  def on_train_begin(self, logs=None):
    super().on_train_begin(logs)
    if self.every_n_steps:
      self._updates = int(tf.keras.backend.get_value(self.model.optimizer.iterations))
      self._next_point = (self._updates // self.every_n_steps + 1) * self.every_n_steps
      self._steps_unread = 0     # Keras steps since the count was read

  def on_epoch_begin(self, epoch, logs=None):
    super().on_epoch_begin(epoch, logs)
    self._steps_seen = 0
    self._at_point = (0.0, 0)      # loss x steps, steps of this epoch at its last point

  def on_train_batch_end(self, batch, logs=None):
    if not self.every_n_steps:  # none asked for, or the writes failed: Keras calls this only in the latter
      return
    try:
      super().on_train_batch_end(batch, logs)  # its writer flushes (the step points' too) here at times
      self._step_points(batch, logs)
    except (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError, OSError) as error:
      # A full disk: the curves are not worth a run, and the epoch's checkpoint save, which comes next,
      # says what it means for the run (training/checkpoints.py), in one line.
      logging.warning("TensorBoard's step-level scalars stop here: %s",
                      str(getattr(error, "message", error)).strip().splitlines()[-1])
      self.every_n_steps = 0

  def _step_points(self, batch, logs) -> None:
    self._steps_unread += batch + 1 - self._steps_seen
    self._steps_seen = batch + 1
    due = self._point_due()
    if due or batch + 1 >= (self.params.get("steps") or math.inf):
      self._add_loss(logs, due)

  def _point_due(self) -> bool:
    """Whether the update count has reached the next point; read only where the steps counted reach it."""
    if self._updates + self._steps_unread / self.steps_per_update < self._next_point:
      return False
    self._updates = int(tf.keras.backend.get_value(self.model.optimizer.iterations))
    self._steps_unread = 0
    return self._updates >= self._next_point

  def _add_loss(self, logs, point: bool) -> None:
    """At a point, writes the loss of the steps since the previous one; at an epoch's end, carries its
    last steps' over to the next epoch's first point."""
    # The epoch's running loss x its steps, less that at the last point: the loss of the steps between.
    summed = float(_running_loss(self.model, logs)) * self._steps_seen
    loss = self._carried[0] + summed - self._at_point[0]
    steps = self._carried[1] + self._steps_seen - self._at_point[1]
    self._at_point = (summed, self._steps_seen)
    if point:
      self._write_point(loss / steps)
      self._carried = (0.0, 0)
    else:
      self._carried = (loss, steps)

  def _write_point(self, loss: float) -> None:
    step = self._updates
    rate = rate_of_update(self.model.optimizer, max(step - 1, 0))
    with self._train_writer.as_default(), tf.summary.record_if(True):
      tf.summary.scalar("batch_loss", loss, step=step)
      tf.summary.scalar("batch_learning_rate", rate, step=step)
    self._next_point = (step // self.every_n_steps + 1) * self.every_n_steps


def _running_loss(model, logs):
  """The epoch's running training loss: from the metric objects where Keras has them (tf_keras: in a
  multi-worker run its batch logs are summed over the replicas; the read is a collective, which every
  process makes at the same update count), else Keras' logs."""
  get = getattr(model, "get_metrics_result", None)
  return get()["loss"] if get is not None else logs["loss"]


def rate_of_update(optimizer, update: int) -> float:
  """The learning rate of the optimizer's update `update` (counted from 0): its LearningRateSchedule's
  value there (the optimizer evaluates it at its count before the update), else the rate it holds."""
  while hasattr(optimizer, "inner_optimizer"):  # the loss-scale wrapper of mixed precision
    optimizer = optimizer.inner_optimizer
  # Keras' TF >= 2.11 family keeps it in _learning_rate, the legacy OptimizerV2 in a hyperparameter
  # (tf_workarounds.REGISTRY: new_optimizer_learning_rate, step_level_scalars).
  rate = getattr(optimizer, "_learning_rate", None)
  if rate is None:  # the legacy family: a schedule, or the variable the schedule callback sets
    rate = optimizer._get_hyper("learning_rate")  # pylint: disable=protected-access
  if isinstance(rate, tf.keras.optimizers.schedules.LearningRateSchedule):
    rate = rate(update)
  return float(tf.keras.backend.get_value(rate))


def epoch_step(epoch: int) -> int:
  """The TensorBoard step of the weights after epoch `epoch` (1-based): Keras writes an epoch's
  scalars at its 0-based index, and test or prediction figures of those weights belong beside them."""
  return max(epoch - 1, 0)


class FittedProgbar(tf.keras.utils.Progbar):
  """Keras' progress bar, its bar narrowed so that the line it redraws fits the terminal.

  Keras redraws the line with backspaces and a carriage return, which reach back to the start of the
  terminal's last row only: a longer line wraps, and each redraw then leaves a row behind. In an
  80-column terminal the default job's line ("  51/341 [====...] - ETA: 1:05 - loss: 0.2707 - mae:
  0.4332") is 81 columns while the epoch has over a minute left, so a float32 epoch on a 2-core CPU
  scrolled 50 rows of bars. The bar (30 columns at most, as Keras draws it; 10 at least) gets what the
  count, the longest time left ("h:mm:ss") and the values (as wide as the widest so far, and a column
  more) leave of the width. The last update, which ends its line, keeps the bar of the others.
  """

  MIN_BAR, MAX_BAR = 10, 30

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._value_widths = {}   # name: the widest value Keras has shown for it, in characters

  def update(self, current, values=None, finalize=None):
    last = finalize if finalize is not None else self.target is not None and current >= self.target
    if self.verbose == 1 and self.target is not None and not (last and self._value_widths):
      self.width = self.fitted_width(values or [])
    super().update(current, values, finalize)

  def fitted_width(self, values) -> int:
    """The bar's width for a line with `values` (Keras' (name, value) pairs) in the terminal's width
    (shutil: $COLUMNS, else the terminal's, else 80)."""
    for name, value in values:
      self._value_widths[name] = max(self._value_widths.get(name, 0), len(_as_keras_shows(value)))
    digits = len(str(self.target))
    others = (len("%s/%s [] - ETA: 0:00:00" % ("0" * digits, "0" * digits))
              + sum(len(" - %s: " % name) + width + 1 for name, width in self._value_widths.items()))
    room = shutil.get_terminal_size().columns - 1 - others
    return max(self.MIN_BAR, min(self.MAX_BAR, room))


def _as_keras_shows(value) -> str:
  """A metric's value as Keras' Progbar writes it: 4 decimals, or 4 in the exponent form below 1e-3."""
  try:
    number = float(value)
  except (TypeError, ValueError):
    return str(value)
  return ("%.4f" if abs(number) > 1e-3 else "%.4e") % number


class RunProgbar(tf.keras.callbacks.ProgbarLogger):
  """Keras' progress bar, headed with the run's epoch count and fitted to the terminal (FittedProgbar).
  The rest of an epoch that a resumed run trains is a fit of its own (training/loop.py `_fit`), which
  Keras' own bar would head "Epoch 2/2" before the next fit's "Epoch 3/3". Given among a fit's or an
  evaluation's callbacks, it replaces Keras' default bar. Its last update in an epoch shows the losses
  and metrics, not the BOOKKEEPING_KEYS, which the epoch line after it gives."""

  def __init__(self, epochs=None):
    super().__init__(count_mode="steps")
    self.run_epochs = epochs

  def set_params(self, params):
    super().set_params(params if self.run_epochs is None else dict(params, epochs=self.run_epochs))

  def _maybe_init_progbar(self):  # Keras' private hook that makes the bar (tf_workarounds.REGISTRY)
    if self.progbar is None:
      self.progbar = FittedProgbar(target=self.target, verbose=self.verbose,
                                   stateful_metrics=set(self.stateful_metrics),
                                   unit_name="step" if self.use_steps else "sample")
    super()._maybe_init_progbar()

  def on_epoch_end(self, epoch, logs=None):
    shown = {key: value for key, value in (logs or {}).items() if key not in BOOKKEEPING_KEYS}
    super().on_epoch_end(epoch, shown)


class QuietNativeLines(tf.keras.callbacks.Callback):
  """Keeps a `stderr_lines.DroppedLines` window open where TensorFlow's one-off C++ lines are printed:
  from the start of each fit to the end of its first training step, and through each epoch's
  validation (a second or two, in which Keras prints nothing). The caller closes the window too
  (`stop()` is idempotent), so that a fit that raises inside a window still shows its stderr."""

  def __init__(self, window):
    super().__init__()
    self.window = window

  def on_train_begin(self, logs=None):
    self.window.start()

  def on_train_batch_end(self, batch, logs=None):
    self.window.stop()

  def on_test_begin(self, logs=None):
    self.window.start()

  def on_test_end(self, logs=None):
    self.window.stop()


class ThroughputCallback(tf.keras.callbacks.Callback):
  """Measures the first execution (trace + compile) and steady training throughput.

  Keras calls the batch callbacks once per execution of `steps_per_execution` steps, at its end (on
  IPUs too: keras/ipu/extensions/extensions_base.py `_fit_delegate`), and a step is what the backend
  says (`Backend.samples_per_step`: an optimizer step on CPUs and GPUs, one micro-batch per replica on
  IPUs). The first execution of a run includes tracing and compilation, so it is timed on its own and
  left out of the throughput: `compile_seconds` when it ran one step; when it ran several (an IPU
  epoch may be one execution), compilation cannot be told from those steps, so `compile_seconds` is
  None and `first_execution_seconds` / `first_execution_steps` say what was timed. Each epoch's window
  ends at its last training batch, so validation time does not dilute the figure. The per-epoch rate
  is added to the epoch logs as `samples_per_sec`, which TensorBoard and History record; an epoch
  that ran within the first execution has none, and gets `samples_per_sec_with_compilation`: its
  samples over its training time, compilation included.

  `epoch_wall_seconds` is the clock from the previous epoch's end (the start of training for the
  first) to this one's: training, validation, the previous epoch's checkpoint and whatever else ran in
  between. Beside `epoch_seconds` (this epoch's training alone) it shows any time the run spends
  waiting outside its epochs.
  """

  def __init__(self, samples_per_step: int, replicas: int, cache_dir=None):
    super().__init__()
    self.samples_per_step = samples_per_step
    self.replicas = replicas
    self.cache_dir = cache_dir
    self.first_execution_seconds = None
    self.first_execution_steps = None
    self.from_cache = None    # True/False once the first step ran with an executable cache in effect
    self._timed_steps = 0
    self._timed_seconds = 0.0

  @property
  def compile_seconds(self):
    """Tracing, compilation and one step; None where the first execution ran more steps than one."""
    return self.first_execution_seconds if self.first_execution_steps == 1 else None

  def on_train_begin(self, logs=None):
    self._cached_before = _cache_entries(self.cache_dir)
    self._train_start = time.perf_counter()
    self._previous_epoch_end = self._train_start
    if self.first_execution_steps is None:  # a resumed run's second fit reuses the traced step
      logging.info("Compiling the training step (first step includes tracing and compilation)...")

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch_start = time.perf_counter()
    self._window_start = self._epoch_start
    self._window_first_step = 0
    self._steps_done = 0
    self._last_batch_time = None
    self._compiled_in_epoch = False

  def on_train_batch_end(self, batch, logs=None):
    now = time.perf_counter()
    if self.first_execution_steps is None:
      self.first_execution_seconds = now - self._train_start
      self.first_execution_steps = batch + 1
      self._compiled_in_epoch = True
      if batch == 0:
        logging.info("Compilation and first step done in %.1f s%s", self.first_execution_seconds,
                     self._cache_note())
      else:
        logging.info("Compilation and the first execution (%d steps) done in %.1f s%s; compilation "
                     "alone is not timed (compile_seconds: null)", batch + 1, self.first_execution_seconds,
                     self._cache_note())
      self._window_start, self._window_first_step = now, batch + 1
    self._steps_done = batch + 1  # With steps_per_execution > 1, `batch` is the last step run.
    self._last_batch_time = now

  def on_epoch_end(self, epoch, logs=None):
    now = time.perf_counter()
    if logs is not None:
      logs["epoch_seconds"] = now - self._epoch_start
      logs["epoch_wall_seconds"] = now - self._previous_epoch_end
    self._previous_epoch_end = now
    steps = self._steps_done - self._window_first_step
    if steps <= 0 or self._last_batch_time is None:
      # Every step of the epoch ran in the first execution: nothing steady to time.
      if logs is not None and self._compiled_in_epoch and self._last_batch_time is not None:
        logs["samples_per_sec_with_compilation"] = (self._steps_done * self.samples_per_step
                                                    / (self._last_batch_time - self._train_start))
      return
    seconds = self._last_batch_time - self._window_start
    rate = steps * self.samples_per_step / seconds
    self._timed_steps += steps
    self._timed_seconds += seconds
    if logs is not None:
      logs["samples_per_sec"] = rate
      logs["samples_per_sec_per_replica"] = rate / self.replicas

  def _cache_note(self) -> str:
    if self.cache_dir is None:
      return ""
    new = _cache_entries(self.cache_dir) - self._cached_before
    self.from_cache = not new and bool(self._cached_before)
    if new:
      return "; %d new executable%s written to the cache %s" % (len(new), "" if len(new) == 1 else "s",
                                                                self.cache_dir)
    return "; executable loaded from the cache %s" % self.cache_dir if self.from_cache else ""

  @property
  def steps_this_epoch(self) -> int:
    """Steps the current (or last) epoch ran: a resumed epoch's fit numbers its steps from 0."""
    return self._steps_done

  @property
  def samples_per_sec_per_replica(self):
    if not self._timed_steps:
      return None
    return self._timed_steps * self.samples_per_step / self._timed_seconds / self.replicas


class EpochLogger(tf.keras.callbacks.Callback):
  """One line per epoch, the only one where Keras draws no bar: time, learning rate, each loss and
  metric on the training and validation data, throughput per replica; while epochs of the run's
  `epochs` are left, the time they would take at the pace of this one (its wall time, validation
  included, for a whole epoch of `steps_per_epoch` steps: the first epoch of a resumed run may be the
  rest of one), so that a user on a slow machine knows early how long the run will be."""

  def __init__(self, epochs: int, steps_per_epoch: int = 0, throughput=None):
    super().__init__()
    self.run_epochs, self.steps_per_epoch = epochs, steps_per_epoch
    self.throughput = throughput  # the ThroughputCallback, which counts the steps an epoch ran

  def _epoch_pace(self, wall_seconds: float) -> float:
    steps_run = self.throughput.steps_this_epoch if self.throughput is not None else 0
    if self.steps_per_epoch and 0 < steps_run < self.steps_per_epoch:
      return wall_seconds * self.steps_per_epoch / steps_run
    return wall_seconds

  def on_epoch_end(self, epoch, logs=None):
    logs = logs or {}
    parts = ["Epoch %d/%d took %.1f s (wall %.1f s since the previous epoch)"
             % (epoch + 1, self.run_epochs, logs.get("epoch_seconds", float("nan")),
                logs.get("epoch_wall_seconds", float("nan")))]
    if "lr" in logs:
      parts.append("LR=%.3g" % logs["lr"])
    parts += _train_and_validation_values(logs)
    if "samples_per_sec" in logs:  # what the machine did; per replica where there are several
      rate, per_replica = logs["samples_per_sec"], logs.get("samples_per_sec_per_replica", logs["samples_per_sec"])
      parts.append("%.0f samples/s" % rate + (" (%.0f per replica)" % per_replica if per_replica < rate else ""))
    elif "samples_per_sec_with_compilation" in logs and self.throughput is not None:
      parts.append("%.0f samples/s per replica with compilation (the epoch ran in the first execution)"
                   % (logs["samples_per_sec_with_compilation"] / self.throughput.replicas))
    left = self.run_epochs - (epoch + 1)
    stopping = getattr(self.model, "stop_training", False)  # --early_stopping_patience, --target_loss
    if left > 0 and logs.get("epoch_wall_seconds") and not stopping:
      parts.append("about %s left for %d more epoch%s" % (
          duration(left * self._epoch_pace(logs["epoch_wall_seconds"])), left, "s" if left > 1 else ""))
    logging.info(", ".join(parts))


class ProgressLines(tf.keras.callbacks.Callback):
  """Where Keras draws no bar, a line inside each epoch at most every `every_seconds` (0: none), so that
  a run writing to a file (a Slurm job's output) shows its progress between its epoch lines:

    Epoch 2/3, step 120/341, Loss: train=0.2345 (running mean), 1520 samples/s, about 1 min 5 s left in the epoch

  The step counts the epoch's steps, a resumed epoch's `first_step` (those its checkpoint had done)
  included; the loss is Keras' mean over the epoch's steps so far (since the resume, in a resumed
  epoch); the rate, of all replicas (`samples_per_step`: ThroughputCallback's), and the time left are
  those of the steps since the previous line, or since the epoch's first batch end (the first step
  compiles). No line at the epoch's last step: the epoch line follows. Keras calls the batch hooks once
  per execution of steps_per_execution steps, `batch` being its last step.

  Cost: the clock at each batch end. Keras hands the batch logs to the callbacks that accept tensors
  (`_supports_tf_logs`, as this one does) without waiting for the step, and converts them for all when
  a callback with batch hooks does not (TerminateOnNaN reads the loss at every batch anyway); this one
  converts the loss when it writes a line. With several `processes`, tf_keras sums the batch logs over
  the replicas, and the loss of all of them needs a collective that lines timed by each process's own
  clock cannot make: the line leaves the loss out.
  """

  def __init__(self, epochs: int, steps_per_epoch: int, every_seconds: float, samples_per_step: int,
               first_step: int = 0, clock=time.monotonic, processes: int = 1):
    super().__init__()
    self._supports_tf_logs = True
    self.run_epochs, self.steps_per_epoch, self.every_seconds = epochs, steps_per_epoch, every_seconds
    self.samples_per_step, self.first_step, self.clock, self.processes = samples_per_step, first_step, clock, processes
    self._epoch, self._offset, self._last = 0, 0, None

  def _implements_train_batch_hooks(self):  # Keras' private hooks here: tf_workarounds.REGISTRY
    return self.every_seconds > 0

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch, self._last = epoch, None
    self._offset, self.first_step = self.first_step, 0  # the first epoch only: the one resumed

  def on_train_batch_end(self, batch, logs=None):
    if self.every_seconds <= 0:
      return
    step, now = self._offset + batch + 1, self.clock()
    if self._last is None:
      self._last = (now, step)
      return
    seconds, steps = now - self._last[0], step - self._last[1]
    if seconds < self.every_seconds or step >= self.steps_per_epoch or steps <= 0:
      return
    self._last = (now, step)
    parts = ["Epoch %d/%d, step %d/%d" % (self._epoch + 1, self.run_epochs, step, self.steps_per_epoch)]
    if self.processes == 1 and logs and "loss" in logs:
      parts.append("Loss: train=%.4f (running mean)" % float(logs["loss"]))
    parts.append("%.0f samples/s" % (steps * self.samples_per_step / seconds))
    parts.append("about %s left in the epoch" % duration((self.steps_per_epoch - step) * seconds / steps))
    logging.info(", ".join(parts))


def _train_and_validation_values(logs: dict) -> list:
  """"Loss: train=0.2185, val=0.2430", then "mae: train=0.3727, val=0.3816" for each metric."""
  names = ["loss"] + [key for key in logs if key != "loss" and not key.startswith("val_")
                      and key not in BOOKKEEPING_KEYS]
  parts = []
  for name in names:
    values = "%s: train=%.4f" % ("Loss" if name == "loss" else name, logs.get(name, float("nan")))
    if "val_" + name in logs:
      values += ", val=%.4f" % logs["val_" + name]
    parts.append(values)
  return parts


# history.csv's columns besides the losses and metrics, which Keras' names give.
HISTORY_KEYS = ("epoch_seconds", "epoch_wall_seconds", "lr", "samples_per_sec")


class HistoryCSV(tf.keras.callbacks.Callback):
  """`history.csv` in the run folder, for plotting with one's own tools: a row per epoch as Keras'
  CSVLogger writes it (a header, `epoch` then the columns in sorted order, commas, NA where an epoch has
  no value), its epochs numbered from 1 as the log numbers them. The columns: each loss and metric on
  the training and validation data, the epoch's samples/s (NA for one that ran within the first
  execution, compilation included), learning rate, training seconds and wall seconds (HISTORY_KEYS).

  Written without following links (host/atomic_files.py), which CSVLogger's file cannot be: the header
  with the first row, each row appended. A resumed run (`done`: the epochs its checkpoint completed)
  keeps the header and the rows of those epochs, dropping those of epochs it trains again, and appends.
  A write that fails (a full disk) ends the file with one warning, as the log's copy does."""

  def __init__(self, logdir: str, done: int = 0):
    super().__init__()
    self.path, self.done = os.path.join(logdir, HISTORY_FILE), done
    self.columns, self.failed, self._started = None, False, False

  def on_train_begin(self, logs=None):
    if self._started:  # a resumed run's second fit (the rest of an interrupted epoch was the first)
      return
    self._started = True
    try:
      self._keep_done_epochs()
    except OSError as error:
      self._fail(error)

  def _keep_done_epochs(self) -> None:
    if not os.path.lexists(self.path):
      return
    if not self.done:  # a run started again where one stopped before its first checkpoint
      os.remove(self.path)
      return
    with open(self.path, encoding="utf-8") as handle:
      lines = handle.read().splitlines()
    if not lines:
      return
    self.columns = lines[0].split(",")
    kept = [lines[0]] + [line for line in lines[1:] if _epoch_of(line) <= self.done]
    if len(kept) < len(lines):
      atomic_files.write_text(self.path, "".join(line + "\n" for line in kept))

  def on_epoch_end(self, epoch, logs=None):
    if self.failed:
      return
    logs = logs or {}
    rows = []
    if self.columns is None:
      measured = [key for key in logs if key not in BOOKKEEPING_KEYS]
      self.columns = ["epoch"] + sorted(set(measured) | set(HISTORY_KEYS))
      rows.append(self.columns)
    values = dict(logs, epoch=epoch + 1)
    rows.append([_csv_value(values.get(column)) for column in self.columns])
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    try:
      atomic_files.append_text(self.path, text.getvalue())
    except OSError as error:
      self._fail(error)

  def _fail(self, error) -> None:
    self.failed = True
    logging.warning("%s is not written on: %s", self.path, atomic_files.write_error(self.path, error))


def _epoch_of(line: str) -> int:
  try:
    return int(line.split(",", 1)[0])
  except ValueError:
    return 0  # not a row of an epoch: kept


def _csv_value(value) -> str:
  if value is None:
    return "NA"
  if isinstance(value, int):
    return str(value)
  try:
    return repr(float(value))
  except (TypeError, ValueError):
    return str(value)


class StopAfterFirstStep(tf.keras.callbacks.Callback):
  """--compile_only: the first step compiles (and fills the executable cache); then stop."""

  def on_train_batch_end(self, batch, logs=None):
    self.model.stop_training = True
