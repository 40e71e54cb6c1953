"""Input files held open from their check to the run's end: a run reads the file it checked, or stops.

A run checks its data file at start-up (data/cellspike_file.py) and then reads it for hours: the
memory-mapped reader (data/hdf5_native.py) maps the file afresh for every stream it starts (training,
validation, test, prediction), and h5py reads the baselines. Reading by name, each would read
whatever the name leads to at that moment: a file renamed over it (a colleague regenerating it, a
copy moved into place), or nothing (deleted). So:

- `PinnedFile.open(path)` opens the file once; the descriptor stays open while the run holds the
  object (the loader's layouts hold it). The streams map `/proc/self/fd/N`, which opens that same
  file even after its name was renamed over or deleted; h5py opens it by name, so that external links
  resolve beside it, and `opened()` checks that h5py found the same file (else one `error:` line).
  A name that moved on is said once, in a warning: the run goes on reading what it checked.
- A change to the file itself (truncated, rewritten or grown in place) is found by `fstat` of the
  held descriptor. The loader marks the files its streams read (`watch`); during a training run
  (`watched_in_run`, around training/loop.py's run) `check_all()` runs at every step end of training
  and evaluation and at every epoch end, before the checkpoint is saved (`keras_callback`), and stops
  the run with one `error:` line naming the file, before anything is saved from the changed data.
  The checkpoints saved until then are kept.
- A file that shrank faults its mapping: TensorFlow's reading threads get SIGBUS on the first page
  past the new end, which would end the process with "Bus error" and no word (exit status 135), and
  can happen before any step end. `guard_bus_errors()` handles SIGBUS: Python's C-level handler
  returns (the faulting thread retries, and faults again) and writes the signal's number to Python's
  wakeup descriptor, whose reader thread (stop_signals.read_signal_numbers), which needs no step to
  end, calls the guard: it finds the file that shrank, writes the one `error:` line (also to the
  run's log.txt), removes the run folder's lock file and ends the process with status 1 (`os._exit`: a
  thread stuck on a fault cannot be joined, so no clean-up that waits for TensorFlow's threads could
  finish). The reader also calls it every second, when the guard looks at the sizes, in case another
  user of the wakeup descriptor took it. A SIGBUS when no data file shrank is not the data's: the
  default action is put back and the signal raised again, so the process ends as it would have ("Bus
  error", after Python's traceback dump).
- A file that shrank and is found at a step end ends the process the same way, whichever comes
  first. Checkpoints are written atomically (training/checkpoints.py): one being saved when the
  process ends leaves the previous one intact.

Without TensorFlow, so that the checks before TensorFlow's start can open and hold the files.
"""

import contextlib
import ctypes
import faulthandler
import logging as python_logging
import os
import signal
import stat
import sys
import threading
import time
import weakref

from absl import logging

import stop_signals
from errors import UserError

_PROC_FDS = "/proc/self/fd"

_mapped = weakref.WeakSet()  # the files that streams read (watch), for a SIGBUS
_runs = []                   # per active watched_in_run: (WeakSet of the files its checks look at, hook)
_report_lock = threading.Lock()
_reported = []               # the one line written (at most one per process)
_bus_error_lock = threading.Lock()  # held while a SIGBUS is looked into (the faults come again and again)
_guard = {}                  # "stderr", "faulthandler": set once by guard_bus_errors


class InputChanged(SystemExit):
  """A file the run reads changed under it; its `error:` line is already written. Exit status 1, as
  for any error; a SystemExit, so that the line is not written again on the way out."""

  def __init__(self, message: str):
    super().__init__(1)
    self.message = message


class PinnedFile:
  """One input file, held open (`fd`) from its check on; `size` and `mtime_ns` as it was checked."""

  def __init__(self, path: str, fd: int):
    self.path, self.fd = path, fd
    status = os.fstat(fd)
    self.device, self.inode = status.st_dev, status.st_ino
    self.size, self.mtime_ns = status.st_size, status.st_mtime_ns
    self._moved_said = False
    self._finalizer = weakref.finalize(self, os.close, fd)

  @classmethod
  def open(cls, path: str) -> "PinnedFile":
    """Opens the regular file `path` for reading (a UserError naming it if it cannot be)."""
    try:  # O_NONBLOCK: a FIFO at the name must not block the open
      fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
      raise UserError("%s: cannot be opened for reading (%s)" % (path, error.strerror)) from None
    try:
      mode = os.fstat(fd).st_mode
      if not stat.S_ISREG(mode):
        raise UserError("%s is not a regular file (%s), expected an HDF5 file"
                        % (path, "a folder" if stat.S_ISDIR(mode) else "a device, FIFO or socket"))
      return cls(path, fd)
    except BaseException:
      os.close(fd)
      raise

  @property
  def region(self) -> str:
    """The name by which a reader that opens files by name (TensorFlow's ImmutableConst) opens this
    same file, whatever became of `path`."""
    held = os.path.join(_PROC_FDS, str(self.fd))
    return held if os.path.exists(held) else self.path

  def close(self) -> None:
    _mapped.discard(self)
    for pins, _ in _runs:
      pins.discard(self)
    self._finalizer()

  def same_file(self, fd: int) -> bool:
    status = os.fstat(fd)
    return (status.st_dev, status.st_ino) == (self.device, self.inode)

  @contextlib.contextmanager
  def opened(self):
    """This file through h5py ("r"), opened by name and checked to be the held file. (HDF5 cannot open
    `region` of a deleted file, and would resolve external links beside it.) These reads are the
    loader's, at start-up: a name that moved on by then is one line."""
    import h5py  # pylint: disable=import-outside-toplevel  (only the readers need it)
    try:
      f = h5py.File(self.path, "r")
    except OSError:
      self._refuse_moved()
      raise
    with f:
      try:
        same = self.same_file(f.id.get_vfd_handle())
      except (OSError, ValueError, TypeError, AttributeError):
        same = True  # a driver without a descriptor: nothing to compare (h5py's default has one)
      if not same:
        self._refuse_moved("was replaced by another file")
      yield f

  def _refuse_moved(self, how=None) -> None:
    how = self.moved() or how
    if how is not None:
      raise UserError("%s %s while the run started, after its check: start the run again once the file "
                      "is in place" % (self.path, how))

  def shrank(self):
    """How the file shrank since it was checked (None if it did not)."""
    size = os.fstat(self.fd).st_size
    return "shrank from %d to %d bytes" % (self.size, size) if size < self.size else None

  def change(self):
    """How the file itself changed since it was checked (None if it did not)."""
    status = os.fstat(self.fd)
    if status.st_size != self.size:
      return "%s from %d to %d bytes" % ("shrank" if status.st_size < self.size else "grew", self.size,
                                         status.st_size)
    if status.st_mtime_ns != self.mtime_ns:
      return "was written to (its modification time changed)"
    return None

  def moved(self):
    """What became of the file's name, if it no longer leads to this file (None if it does)."""
    try:
      status = os.stat(self.path)
    except FileNotFoundError:
      return "was deleted"
    except OSError:
      return None  # a name that cannot be looked up now (a network file system's hiccup): no news
    if (status.st_dev, status.st_ino) != (self.device, self.inode):
      return "was replaced by another file"
    return None


def held(path: str, pin=None) -> "PinnedFile":
  """`pin` if given, else `path` opened and held."""
  return pin if pin is not None else PinnedFile.open(path)


def watch(pin: PinnedFile) -> None:
  """Marks `pin` as read by a stream: a SIGBUS is looked up among these, and the checks of the
  innermost `watched_in_run` look at it."""
  _mapped.add(pin)
  if _runs:
    _runs[-1][0].add(pin)


@contextlib.contextmanager
def watched_in_run(before_sudden_exit=None):
  """The block is one run: `check_all` looks at the files watched inside it (a process that runs
  several, as the tests do, checks each run's own). `before_sudden_exit` is called, from any thread,
  before a shrunken file ends the process without unwinding (the run folder's lock file removed)."""
  _runs.append((weakref.WeakSet(), before_sudden_exit))
  try:
    yield
  finally:
    _runs.pop()


def _members(sets) -> list:
  """The pins in the WeakSets `sets`, read from any thread (the watcher's): a set that grows meanwhile is
  read again."""
  for _ in range(10):
    try:
      return [pin for pins in list(sets) for pin in list(pins)]
    except RuntimeError:  # changed size during iteration
      continue
  return []


def _in_runs() -> list:
  return _members([pins for pins, _ in list(_runs)])


def _changed_line(pin: PinnedFile, how: str) -> str:
  return ("%s: the data file %s while this run read it (truncated or rewritten by another program?): "
          "stopped without saving what was read since; the checkpoints saved before are kept, and --resume "
          "continues from the last once the file is as it was" % (pin.path, how))


def _report(message: str) -> bool:
  """Writes the one `error:` line to stderr and to the run's log file, once per process; True the
  first time."""
  with _report_lock:
    if _reported:
      return False
    _reported.append(message)
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  # Not through sys.stderr, which a signal may have interrupted, and to the stderr of the guard's start:
  # descriptor 2 may lead to a window's temporary file then (stderr_lines.DroppedLines), lost at _exit.
  with contextlib.suppress(OSError):
    os.write(_guard.get("stderr", 2), ("error: %s\n" % message).encode())
  logger = logging.get_absl_logger()  # the run's log file (training/logs.py copied_to_file) hangs there
  line = sys._getframe().f_lineno  # pylint: disable=protected-access
  record = logger.makeRecord(logger.name, python_logging.ERROR, __file__, line, "error: " + message, (), None)
  for handler in list(logger.handlers):
    with contextlib.suppress(Exception):
      handler.handle(record)
      handler.flush()
  return True


def _end_now(message: str) -> None:
  """The one line, then exit status 1 without unwinding (see the module docstring)."""
  _report(message)
  for _, hook in reversed(list(_runs)):
    if hook is not None:
      with contextlib.suppress(Exception):
        hook()
  with contextlib.suppress(Exception):
    sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access


def check_all() -> None:
  """Stops the run (InputChanged, or at once for a file that shrank) if a held file changed; says
  once, in a warning, of a name that no longer leads to its file."""
  for pin in _in_runs():
    how = pin.change()
    if how is None:
      continue
    if how.startswith("shrank"):
      _end_now(_changed_line(pin, how))  # its mapping faults at any read past the end: no unwinding
    message = _changed_line(pin, how)
    _report(message)
    raise InputChanged(message)


def say_moved() -> None:
  """A warning, once per file, for a file whose name was renamed over or deleted: the run reads on."""
  for pin in _in_runs():
    if not pin._moved_said:  # pylint: disable=protected-access
      how = pin.moved()
      if how is not None:
        pin._moved_said = True  # pylint: disable=protected-access
        logging.warning("%s %s since this run opened it: the run goes on reading the file it checked at "
                        "its start, which it holds open", pin.path, how)


@contextlib.contextmanager
def changes_reported():
  """Runs the block (a fit, an evaluation); if it fails while a held file has changed, the failure is
  that change (one line), not TensorFlow's error about a mapping of the wrong length."""
  try:
    yield
  except Exception:
    check_all()
    raise


def keras_callback():
  """A Keras callback that calls `check_all` at every batch end (training, validation, test,
  prediction) and at every epoch end, before the checkpoint callback saves (put it first)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (this module stays without it)

  class InputFilesUnchanged(tf.keras.callbacks.Callback):
    """Stops the run at the step end after a file it reads changed (data/pinned_files.py)."""

    def on_train_batch_end(self, batch, logs=None):
      check_all()

    def on_test_batch_end(self, batch, logs=None):
      check_all()

    def on_predict_batch_end(self, batch, logs=None):
      check_all()

    def on_epoch_end(self, epoch, logs=None):
      check_all()
      say_moved()

  return InputFilesUnchanged()


def _on_bus_error() -> None:
  """A SIGBUS: the line of the file that shrank and the end; none shrank: the default action. Once at
  a time: the faulting thread faults again while this runs, and Python would call its handler again
  at every bytecode of the main thread."""
  if not _bus_error_lock.acquire(blocking=False):  # pylint: disable=consider-using-with
    return
  try:
    _end_if_shrunk(_members([_mapped]))
    # Not a data file's fault: the process ends as without the guard (a faulting thread faults again;
    # a SIGBUS sent by kill is raised again).
    with contextlib.suppress(Exception):
      sys.stderr.flush()
      os.write(_guard.get("stderr", 2), b"Fatal Python error: Bus error\n\n")
      if _guard.get("faulthandler"):
        faulthandler.dump_traceback(file=_guard.get("stderr", 2), all_threads=True)
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(ctypes.c_int(signal.SIGBUS), ctypes.c_void_p(0))  # SIG_DFL, from any thread
    os.kill(os.getpid(), signal.SIGBUS)
    time.sleep(1.0)  # the kernel ends the process meanwhile, whichever thread it delivers the signal to
  finally:
    os._exit(128 + signal.SIGBUS)  # pylint: disable=protected-access  (never left spinning)


def _end_if_shrunk(pins) -> None:
  for pin in pins:
    try:
      how = pin.shrank()
    except OSError:
      continue
    if how is not None:
      _end_now(_changed_line(pin, how))


def _on_signal_numbers(numbers: bytes) -> None:
  """stop_signals' reader thread: a SIGBUS is looked into at once; any other wake-up (another signal, or
  a second without one) looks at the sizes of the files the runs read."""
  if signal.SIGBUS in numbers:
    _on_bus_error()
  else:
    _end_if_shrunk(_in_runs())


def _python_handler(signum, frame):
  del signum, frame
  _on_bus_error()


def guard_bus_errors() -> None:
  """Installs the SIGBUS guard (module docstring) once per process, from the main thread (Python sets
  handlers and its wakeup descriptor there)."""
  if _guard or not hasattr(signal, "SIGBUS") or threading.current_thread() is not threading.main_thread():
    return
  if not stop_signals.read_signal_numbers(_on_signal_numbers):
    return
  _guard["faulthandler"] = faulthandler.is_enabled()
  with contextlib.suppress(OSError):
    _guard["stderr"] = os.dup(2)  # the loader's: no window of DroppedLines is open then
  signal.signal(signal.SIGBUS, _python_handler)
