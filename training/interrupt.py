"""Graceful stops of training: a checkpoint saved at the next safe point after a stop signal, the exit, and
`--resume` later.

stop_signals.py owns the signals (Ctrl-C, Slurm's SIGTERM at the time limit, a closed terminal's SIGHUP):
during training its `InterruptFlag` records them, in phases, and takes one at once until the first
training step has ended (nothing is trained yet). Here are the Keras callbacks that read the flag and what
a stop saves:
- `GracefulStop`, a Keras callback, looks at the flag at every batch end (the next safe point: the
  weights and optimizer state are those after a whole step). Mid-epoch it saves `checkpoints/last`
  with the epoch, the steps done in it and their running training metrics, then raises
  `TrainingInterrupted`; `--resume` restores it and trains the rest of that epoch on the same data
  order with the consumed batches skipped (`Split.epochs_from`), then the remaining epochs, so an
  interrupted-and-resumed run trains exactly the batches of an uninterrupted one. When the signal
  comes after the epoch's last step (during validation or saving), the epoch finishes, its normal
  checkpoint is written, and the run stops at the epoch end; after the last epoch too, before the
  test evaluation.
- The flag stays installed through the test evaluation (`StopTestOnSignal` ends it at the next test
  batch) and the writing of summary.yaml. A run stopped after its last epoch or during its test holds
  every epoch's checkpoint: `--resume` then only evaluates the test split and writes the summary. A
  signal while the summary is written is noted and the run finishes normally (exit status 0): it has
  nothing left to resume.
- `TrainingInterrupted` is a `SystemExit` with status 128 + signal number (143 for SIGTERM, 130 for
  SIGINT), the status a shell reports for a process the signal stopped: a requeue script can tell
  "interrupted, resumable" (143/130) from "finished" (0) and "failed" (1). It is not a UserError, so
  no `error:` line is printed; one warning line says where the checkpoint is and how to resume.
- Several processes (MultiWorkerMirroredStrategy workers, poprun instances): every training step is
  an all-reduce, so all processes must stop after the same step. At every batch end they agree through
  one collective of their flags (`backend.any_process`: a scalar all-reduce, small beside a step's
  gradient all-reduce), so a signal to any one of them (srun delivers SIGTERM to all tasks, a kill
  to one) stops them all after the same step, each saving its checkpoint. On IPUs with one execution
  per epoch the batch end is the epoch end.
- SIGKILL still ends the process at once: the atomic checkpoint writes (training/checkpoints.py) then
  leave the previous checkpoint intact.
"""

import math
import signal
import sys

import tensorflow as tf
from absl import logging

from stop_signals import InterruptFlag
from training.checkpoints import in_run_folder


class TrainingInterrupted(SystemExit):
  """Training stopped on a signal after saving `checkpoint`; exit status 128 + signal number."""

  def __init__(self, signum: int, checkpoint: str, where: str, mid_epoch: bool = False):
    super().__init__(128 + signum)
    self.signum, self.checkpoint, self.where = signum, checkpoint, where
    self.mid_epoch = mid_epoch  # Keras' progress bar (of the fit or the test) has not ended its line

  @property
  def signal_name(self) -> str:
    return signal.Signals(self.signum).name


def _finite(logs: dict) -> bool:
  return all(math.isfinite(v) for v in logs.values())


class FirstStepEnds(tf.keras.callbacks.Callback):
  """Tells `flag` that the first training step has ended, at every batch end (put it first)."""

  def __init__(self, flag: InterruptFlag):
    super().__init__()
    self.flag = flag

  def on_train_batch_end(self, batch, logs=None):
    self.flag.first_step_done()


class ResumedEpochLogs(tf.keras.callbacks.Callback):
  """Completes the training metrics of an epoch resumed `step_offset` steps in.

  Keras averages the metrics over the batches it ran; the interrupted run's running averages over the
  first `step_offset` batches were saved with the checkpoint, and the epoch's metrics are the
  step-weighted mean of both. Must come first among the callbacks, before anything records the logs.
  """

  def __init__(self, step_offset: int, offset_logs: dict):
    super().__init__()
    self.step_offset, self.offset_logs = step_offset, dict(offset_logs or {})
    self._steps = 0

  def on_epoch_begin(self, epoch, logs=None):
    self._steps = 0

  def on_train_batch_end(self, batch, logs=None):
    self._steps = batch + 1

  def combine(self, logs: dict, steps: int) -> dict:
    total = self.step_offset + steps
    out = dict(logs)
    for key, saved in self.offset_logs.items():
      if key in logs and total:
        out[key] = (float(saved) * self.step_offset + float(logs[key]) * steps) / total
    return out

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None and self.step_offset:
      logs.update(self.combine({k: v for k, v in logs.items() if k in self.offset_logs}, self._steps))
      self.step_offset = 0  # only the first (resumed) epoch


class GracefulStop(tf.keras.callbacks.Callback):
  """Stops training at the next safe point after a signal; see the module docstring. Put it last."""

  def __init__(self, flag: InterruptFlag, checkpointing, steps_per_epoch: int, total_epochs: int,
               resumed: ResumedEpochLogs = None, any_process=None):
    super().__init__()
    self.flag, self.checkpointing = flag, checkpointing
    self.steps_per_epoch, self.total_epochs = steps_per_epoch, total_epochs
    self.resumed, self.any_process = resumed, any_process
    self._epoch = 0

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    self.flag.first_step_done()  # where FirstStepEnds is not among the callbacks
    if not self._agreed_stop():  # with several processes, every one calls this at every batch end
      return
    offset = self.resumed.step_offset if self.resumed is not None else 0
    steps = offset + batch + 1
    if steps >= self.steps_per_epoch:
      return  # the epoch's training is complete: finish it (validation, checkpoint), stop at its end
    metrics = {key: float(value) for key, value in _running_metrics(self.model, logs).items()
               if not key.startswith("val_") and _is_number(value)}
    if self.resumed is not None and offset:
      metrics = self.resumed.combine(metrics, batch + 1)
    if _finite(metrics):
      path = self.checkpointing.save_interrupted(self._epoch, steps, metrics)
    else:  # never replace a good checkpoint with diverged weights
      path = self.checkpointing.checkpoints.latest()
    # A process that saw no signal stops because another did: it reports (and exits with) SIGTERM.
    raise TrainingInterrupted(self.flag.stopping_signal, path,
                              "in epoch %d after step %d of %d" % (self._epoch + 1, steps,
                                                                    self.steps_per_epoch),
                              mid_epoch=True)

  def on_epoch_end(self, epoch, logs=None):
    last = epoch + 1 >= self.total_epochs  # the test is left: --resume runs it
    if self._agreed_stop():
      raise TrainingInterrupted(self.flag.stopping_signal, self.checkpointing.checkpoints.latest(),
                                "at the end of epoch %d%s" % (epoch + 1, ", the last, before the test "
                                                              "evaluation" if last else ""))
    if last:
      self.flag.phase = "test"  # a signal from now on stops the test (StopTestOnSignal)

  def _agreed_stop(self) -> bool:
    return agreed_stop(self.flag, self.any_process)


class StopTestOnSignal(tf.keras.callbacks.Callback):
  """Ends the test evaluation at the next batch after a signal, with TrainingInterrupted: the run's
  checkpoints are all written by then, and `--resume` evaluates the test split again."""

  def __init__(self, flag: InterruptFlag, checkpoint: str, any_process=None):
    super().__init__()
    self.flag, self.checkpoint, self.any_process = flag, checkpoint, any_process

  def on_test_batch_end(self, batch, logs=None):
    if agreed_stop(self.flag, self.any_process):
      raise TrainingInterrupted(self.flag.stopping_signal, self.checkpoint,
                                "during the test evaluation (after batch %d)" % (batch + 1), mid_epoch=True)

  def on_test_end(self, logs=None):
    # A signal after the last batch's check was told the test stops: so it does, unrecorded.
    if agreed_stop(self.flag, self.any_process):
      raise TrainingInterrupted(self.flag.stopping_signal, self.checkpoint,
                                "at the end of the test evaluation (its results not recorded)", mid_epoch=True)


def _running_metrics(model, logs) -> dict:
  """The epoch's running training metrics so far, as Keras reports them at an epoch's end: read from the
  metric objects (aggregated over every replica and process; a collective, which every process reaches
  at the same step here), not from the batch's logs, which Keras sums over the replicas of a
  multi-worker run (`reduce_per_replica`, reduction "auto"): the saved figures would be twice the
  real ones with two workers. Keras before `get_metrics_result` (TensorFlow 2.6, the IPU SDK): the logs."""
  get = getattr(model, "get_metrics_result", None) if model is not None else None
  return dict(get()) if get is not None else dict(logs or {})


def agreed_stop(flag: InterruptFlag, any_process=None) -> bool:
  """Whether to stop now; with several processes, whether any of them was signalled (one collective,
  `backend.any_process`, which every process must call at the same point)."""
  if any_process is None:
    return flag.requested
  return any_process(flag.requested)


def stop_if_signalled(flag: InterruptFlag, checkpoint: str, where: str, logdir: str, any_process=None):
  """Between two parts of a run: stops it with its log line if any process was signalled."""
  if agreed_stop(flag, any_process):
    stop = TrainingInterrupted(flag.stopping_signal, checkpoint, where)
    log_interrupted(stop, logdir)
    raise stop


def _is_number(value) -> bool:
  try:
    float(value)
    return True
  except (TypeError, ValueError):
    return False


def log_interrupted(stop: TrainingInterrupted, logdir: str) -> None:
  """The one line a user (or a requeue script) needs after a graceful stop."""
  if stop.mid_epoch:  # on a line of its own, not after the bar's last update
    sys.stdout.write("\n")
    sys.stdout.flush()
  logging.warning("Training interrupted by %s %s; checkpoint: %s; continue with the same command and "
                  "--resume --logdir=%s (exit status %d)", stop.signal_name, stop.where,
                  in_run_folder(stop.checkpoint, logdir) or "none (nothing was saved)", logdir, stop.code)
