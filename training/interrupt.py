"""Graceful stop on SIGTERM / SIGINT / SIGHUP: save a checkpoint at the next safe point, exit, `--resume`
later.

Slurm sends SIGTERM at the time limit (then SIGKILL after `KillWait`, 30 s by default; ask for an
earlier warning with `sbatch --signal=TERM@120`), srun forwards it to every task, and Ctrl-C is SIGINT.
A terminal that closes (an ssh connection lost) sends SIGHUP: the output that went to it goes to
/dev/null from then on (`errors.leave_a_closed_terminal`), and the run stops as on SIGTERM, exit status
129. Started under nohup, which ignores SIGHUP, a run keeps it ignored and trains on.

Design:
- Until the first training step of the process has ended (its tracing and compilation included), a
  signal stops the run at once, as in its set-up: one `interrupted by SIG...` line, status 128 + signal
  number, nothing saved (nothing is trained yet; a resumed run keeps its checkpoints). On IPUs the first
  step is the first execution, one epoch by default, which a stop then does not save.
- After it, the signal handler only records the signal (and writes one line with `os.write`, which is safe in a
  handler); repeated signals are noted and ignored, so a second Ctrl-C or SIGTERM can never interrupt
  the save. It stays installed until the interrupted run has saved, closed its writers and logged its
  line, and then gives way to SIG_IGN (not to the default action) for the rest of the exit, so a second
  signal at any point cannot turn the exit status 128 + signal into "killed by the signal". SIGKILL
  still stops the process at once, and the atomic checkpoint writes (training/checkpoints.py) then
  leave the previous checkpoint intact.
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
"""

import math
import os
import signal
import sys
import threading

import tensorflow as tf
from absl import logging

from errors import handles, leave_a_closed_terminal, remember_terminal_outputs, set_graceful_stops, stop_now
from training.checkpoints import in_run_folder

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class TrainingInterrupted(SystemExit):
  """Training stopped on a signal after saving `checkpoint`; exit status 128 + signal number."""

  def __init__(self, signum: int, checkpoint: str, where: str, mid_epoch: bool = False):
    super().__init__(128 + signum)
    self.signum, self.checkpoint, self.where = signum, checkpoint, where
    self.mid_epoch = mid_epoch  # Keras' progress bar (of the fit or the test) has not ended its line

  @property
  def signal_name(self) -> str:
    return signal.Signals(self.signum).name


class InterruptFlag:
  """Records SIGTERM/SIGINT/SIGHUP while installed (a context manager); the handler does nothing else
  (but for SIGHUP, move the output off a closed terminal). With `immediate_until_first_step`, a signal
  before the first training step has ended (while the step is traced and compiled: minutes for many
  CPU replicas, or a Poplar compilation) stops the run at once instead, as in its set-up
  (errors.stop_now): there is nothing to save yet, and waiting for the step would hold the stop for as
  long as the compilation takes."""

  # What a signal does in each phase of the run, as the handler's line says it.
  MESSAGES = {
      "training": "stopping after the current training step and saving a checkpoint "
                  "(more signals are ignored until it is saved)",
      "test": "stopping the test evaluation; the checkpoints are saved, and --resume evaluates the test "
              "split (more signals are ignored)",
      "finishing": "the run has finished training and testing, and ends normally (more signals are "
                   "ignored)",
      "finishing_before_report": "the run has finished training and testing; it stops before the --predict "
                                 "report, which --resume makes (more signals are ignored)",
  }

  def __init__(self, immediate_until_first_step: bool = False):
    self.signum = None
    self._immediate = immediate_until_first_step
    self.phase = "training"  # set by the loop as it moves on (MESSAGES)
    self._previous = {}
    self._graceful_before = None  # errors.set_graceful_stops' setting outside the flag

  @property
  def phase(self) -> str:
    return self._phase

  @phase.setter
  def phase(self, phase: str) -> None:
    self._phase = phase
    if phase != "training":
      self.first_step_done()

  def first_step_done(self) -> None:
    """From now on a signal is taken at the next safe point (GracefulStop calls it at every batch end)."""
    if self._immediate:
      self._immediate = False
      if self._graceful_before is not None:
        set_graceful_stops(True)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # handlers can only be set there
      remember_terminal_outputs()
      for signum in SIGNALS:
        if handles(signum):
          self._previous[signum] = signal.signal(signum, self._handle)
      self._graceful_before = set_graceful_stops(not self._immediate)
    return self

  def __exit__(self, exc_type, exc, tb):
    # Leaving on the SystemExit of a stop that a signal asked for (TrainingInterrupted), the process is
    # about to exit: restoring the default action now would let a second signal kill it during the
    # rest of its exit (interpreter and TensorFlow teardown), with status -signum instead of 128 +
    # signum. More signals are ignored instead, until the process has exited (SIGKILL still works;
    # Python resets its own handlers to the default action early in its shutdown, SIG_IGN it keeps).
    exiting = self.signum is not None and exc_type is not None and issubclass(exc_type, SystemExit)
    for signum, handler in self._previous.items():
      signal.signal(signum, signal.SIG_IGN if exiting else handler)
    self._previous = {}
    if self._graceful_before is not None:
      set_graceful_stops(self._graceful_before)
      self._graceful_before = None
    return False

  def _handle(self, signum, frame):
    del frame
    if self._immediate:
      stop_now(signum)  # raises
    if signum == signal.SIGHUP:
      leave_a_closed_terminal()
    name = signal.Signals(signum).name
    if self.signum is None:
      self.signum = signum
      message = "%s received: %s\n" % (name, self.MESSAGES[self.phase])
    elif self.phase == "training":
      message = "%s received again: still stopping and saving the checkpoint; please wait\n" % name
    else:
      message = "%s received again: ignored; please wait\n" % name
    try:
      # On a line of its own: Keras' progress bar rewrites its line with "\r" and ends it only at the
      # epoch's end.
      os.write(2, ("\n" + message).encode())
    except OSError:
      pass

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def stopping_signal(self) -> int:
    """The signal a stop reports: this process's, or SIGTERM where another process of the run was
    signalled (the processes agree on stops, `agreed_stop`)."""
    return self.signum or signal.SIGTERM


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
