"""The application's log: its own INFO lines, and only warnings and errors from the libraries.

Every line keeps absl's glog-style prefix (level, date and time, file and line), without the thread
id and microseconds (`ShortPrefix`).

TensorFlow and Keras log at INFO through the same absl logger as the application, some of it once per
call: MirroredStrategy's "Reduce to ... then broadcast to" for every all-reduce it builds, the
checkpoint saver's "Sharding callback duration", TensorBoard's directory watcher. A user reads those
as noise between the epoch lines. Warnings and errors from anywhere still show, except the few lines
of TensorFlow's C++ core in ONE_OFF_NATIVE_LINES, dropped while a first step, a validation, the test
evaluation or a prediction pass runs (stderr_lines.DroppedLines).

Whether Keras draws its progress bar is chosen here too (--progress).
"""

import contextlib
import logging as python_logging
import os
import shlex
import socket
import sys
import time

from absl import logging

from errors import UserError
from host import atomic_files

# Lines TensorFlow's C++ core prints while it builds a step's or an input's graph (a first step, a
# validation, the test), that no user can act on; each seen on TF 2.21 in the main job's log:
ONE_OFF_NATIVE_LINES = (
    # ERROR level, once, also on AVX-512 CPUs, for the Cast of the float16 frames to the
    # compute dtype: oneDNN leaves that Cast to Eigen's kernel, as the line itself says.
    "oneDNN supports DT_HALF only on platforms with AVX-512",
    # A GeneratorDataset in tf.distribute's input path (MultiDeviceIterator feeds each device through
    # one) that tf.data's graph rewrites cannot see into; printed at the validations of full epochs.
    "will not be optimized because the dataset does not implement the AsGraphDefInternal()",
    # tf.distribute's auto-shard rewrite drops the test split's assert_cardinality; the evaluation
    # runs an explicit number of steps, so nothing depends on it there.
    "transformation is currently not handled by the auto-shard rewrite",
    # TensorFlow 2.6 (the IPU SDK's), once per PNG that tf.image.decode_png decodes (the prediction
    # report's figures, for TensorBoard).
    "Cleanup called...",
)

_APP_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# TensorFlow's Python warning when 5 of the last 10 calls of one Python function traced it. Keras' train
# functions share one code object, which TensorFlow counts as one function: --autotune, which builds
# and traces a model per form on purpose, met it with 5 forms (TF 2.21; TF 2.6 counts the same way).
RETRACING_WARNING = "triggered tf.function retracing"


class _WithoutTexts(python_logging.Filter):
  """Passes the records whose message contains none of `texts`."""

  def __init__(self, texts):
    super().__init__()
    self._texts = texts

  def filter(self, record):
    return not any(text in record.getMessage() for text in self._texts)


@contextlib.contextmanager
def tensorflow_warnings_dropped(*texts: str):
  """Drops the warnings of TensorFlow's Python logger that contain one of `texts` while the block runs
  (warnings the block causes on purpose); every other line passes."""
  dropped, logger = _WithoutTexts(texts), python_logging.getLogger("tensorflow")
  logger.addFilter(dropped)
  try:
    yield
  finally:
    logger.removeFilter(dropped)


class _OwnInfoOnly(python_logging.Filter):
  """Passes records of WARNING and above, and records logged from this application's own files."""

  def filter(self, record):
    return record.levelno >= python_logging.WARNING or os.path.abspath(record.pathname).startswith(
        _APP_ROOT) and os.sep + "site-packages" + os.sep not in record.pathname


class ShortPrefix(python_logging.Formatter):
  """absl's glog prefix without what a reader of the log does not use: the thread id and the
  microseconds. `I1125 11:51:30.464778 140597145541504 cpu.py:245] ` becomes `I1125 11:51:30 cpu.py:245] `
  (the level's initial, month and day, time, file and line)."""

  def __init__(self):
    super().__init__("%(levelname).1s%(asctime)s %(filename)s:%(lineno)d] %(message)s", "%m%d %H:%M:%S")


def setup() -> None:
  """INFO for the application, WARNING for the libraries, the short prefix; call once at start-up."""
  logging.set_verbosity(logging.INFO)
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _OwnInfoOnly) for f in handler.filters):
    handler.addFilter(_OwnInfoOnly())
  handler.setFormatter(ShortPrefix())


# The run folder's copy of the log (copied_to_file): the log's lines, not the progress bars, the model's
# table or the closing report (summary.yaml holds the results).
LOG_FILE = "log.txt"


class _RunLog(python_logging.Handler):
  """log.txt's handler: keeps the lines in memory until `start` opens the file (appending, never through
  a link), then writes each line as it comes. A write that fails (a full disk) ends the copy with one
  warning: the run's checkpoints say more than its log, and their own failures stop it."""

  def __init__(self, path: str, header: str):
    super().__init__()
    self.path, self.stream, self.failed = path, None, False
    self.pending = [header]
    self.setFormatter(ShortPrefix())
    self.addFilter(_OwnInfoOnly())

  def start(self) -> None:
    if self.stream is None and not self.failed:
      self.stream = atomic_files.open_append(self.path)  # a link there: a UserError naming it
      self.write("".join(self.pending))
      self.pending = []

  def write(self, text: str) -> None:
    if self.failed:
      return
    if self.stream is None:
      self.pending.append(text)
      return
    try:
      self.stream.write(text)
      self.stream.flush()
    except OSError as error:
      self.failed = True  # before the warning, which comes back here
      with contextlib.suppress(OSError):
        self.stream.close()
      self.stream = None
      logging.warning("The run's log stopped being copied to %s: %s", self.path,
                      atomic_files.write_error(self.path, error))

  def emit(self, record) -> None:
    try:
      text = self.format(record) + "\n"
    except Exception:  # pylint: disable=broad-except  (logging's own contract: never raise from emit)
      self.handleError(record)
      return
    self.write(text)

  def close(self) -> None:
    if self.stream is not None:
      with contextlib.suppress(OSError):
        self.stream.close()
      self.stream = None
    super().close()


_run_logs = []  # the copies that copied_to_file holds open, newest last


@contextlib.contextmanager
def copied_to_file(path: str):
  """Copies the log's lines to the file `path` while the block runs, after a line with the command and
  the process, and an error that ends it (its one `error:` line goes to stderr only otherwise). Kept
  beside the run's checkpoints, the log says what happened where the terminal is gone: a run whose
  ssh connection dropped stops with its `--resume` line (SIGHUP) written to a terminal that no longer
  exists. A resumed run appends.

  Nothing is written to `path` until `start_file_copy()` (the run's checks passed): the lines until
  then are kept and written first. A command refused before it (a --resume that does not fit the run)
  leaves the file as it was, and says why on the terminal only."""
  handler = _RunLog(path, "# %s (pid %d on %s, %s)\n" % (
      " ".join(shlex.quote(part) for part in [os.path.basename(sys.argv[0])] + sys.argv[1:]), os.getpid(),
      socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S")))
  logger = logging.get_absl_logger()
  logger.addHandler(handler)
  _run_logs.append(handler)
  try:
    yield
  except Exception as error:  # a graceful stop (SystemExit) logs its own line
    if handler.stream is not None:
      handler.write("error: %s\n" % (error if isinstance(error, UserError) else "%s: %s" % (
          type(error).__name__, error)))
    raise
  finally:
    _run_logs.remove(handler)
    logger.removeHandler(handler)
    handler.close()


def start_file_copy() -> None:
  """Starts writing the log file of the innermost `copied_to_file` (none: nothing to do), with the lines
  logged so far. A link at its name is a UserError naming it."""
  if _run_logs:
    _run_logs[-1].start()


def append_to_file(path: str, text: str) -> None:
  """Adds `text` (the closing report: results, where they are, the next commands) to the run folder's
  log `path` after the run's own lines, when the run made one. It is the run's end, which the file
  otherwise lacks; one that cannot be written (a full disk, a link planted at its name, which is never
  written through) is a warning, since the run's results are saved."""
  if not os.path.lexists(path):
    return
  try:
    atomic_files.append_text(path, text.lstrip("\n") + "\n")
  except OSError as error:
    logging.warning("The closing report was not added to %s: %s", path, error)


def shows_bar(progress: str, is_chief: bool, stdout=None) -> bool:
  """Whether Keras draws its progress bar for --progress. tf-keras' bar redraws itself with backspaces
  and carriage returns in every POSIX process, terminal or not (Progbar's `_dynamic_display`), so in a
  file, such as a Slurm job's output, each epoch of the default job leaves about 55 kB of redrawn bars:
  auto shows the bar on a terminal only, as the data generator's status line does. Non-chief workers
  never draw one: their bars would interleave with the chief's."""
  if not is_chief or progress == "epoch":
    return False
  if progress == "bar":
    return True
  stdout = sys.stdout if stdout is None else stdout
  return hasattr(stdout, "isatty") and stdout.isatty()


def fit_verbosity(progress: str, is_chief: bool, stdout=None) -> int:
  """Keras' `verbose` for training: 1, the bar, or 0. Without a bar the application's own epoch line
  (training.callbacks.EpochLogger) is the epoch's only line: Keras' (verbose 2) would say part of it
  again, with the callbacks' bookkeeping values at full precision."""
  return 1 if shows_bar(progress, is_chief, stdout) else 0


def evaluate_verbosity(progress: str, is_chief: bool, stdout=None) -> int:
  """Keras' `verbose` for the test evaluation: 1, the bar, or 2, its one line of results."""
  return 1 if shows_bar(progress, is_chief, stdout) else 2


def duration(seconds: float) -> str:
  """42 s, 3 min 5 s, 2 h 10 min: as a person reads a wait."""
  seconds = int(round(seconds))
  if seconds < 60:
    return "%d s" % seconds
  if seconds < 3600:
    return "%d min %d s" % divmod(seconds, 60)
  return "%d h %d min" % (seconds // 3600, seconds % 3600 // 60)
