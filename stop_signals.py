"""The process's stop signals, SIGINT (Ctrl-C), SIGTERM and SIGHUP, in every phase of a program, and Python's
one wakeup descriptor.

Slurm sends SIGTERM at the time limit (then SIGKILL after `KillWait`, 30 s by default; ask for an
earlier warning with `sbatch --signal=TERM@120`), srun forwards it to every task, and Ctrl-C is SIGINT.
A terminal that closes (an ssh connection lost) sends SIGHUP: the output that went to it goes to
/dev/null from then on (`leave_a_closed_terminal`), and the program stops as on SIGTERM, exit status
129. Started under nohup, which ignores SIGHUP, a program keeps it ignored and goes on (`handles`).

The phases, each with its handlers (installed here, from the main thread, where Python sets them):
- Imports and flags (`exit_on_stop_signals`, a program's first lines): a stop ends the process at once
  with one `interrupted by SIG...` line and status 128 + the signal's number; nothing is written yet.
- Work outside training (`stops_raised`, within errors.reported_on_one_line): a stop is an exception
  (`Terminated`, a KeyboardInterrupt, for SIGTERM and SIGHUP) that unwinds the program, so that what it
  was writing is removed and its worker processes are stopped; then the same line and status. Python
  runs a handler only between two bytecodes of the main thread: one held back by a long call into C++ (an
  XLA or Poplar compilation, a wait for another process) for STOP_GRACE_SECONDS ends the process there,
  with its line and status (the watchdog). A C++ call that also holds the GIL blocks the watchdog too:
  such calls are kept short (host/cpuinfo.py bounds the CPU's logical devices).
- Training (`InterruptFlag`, read by training/interrupt.py's callbacks at every batch end). Until the
  first training step of the process has ended (its tracing and compilation included), a stop is taken
  at once, as in the set-up: nothing is trained yet. After it, the handler only records the signal (and
  writes one line with `os.write`, which is safe in a handler) and the run stops at its next safe point
  with a checkpoint; repeated signals are noted and ignored, so a second Ctrl-C or SIGTERM can never
  interrupt the save. The flag's phase (training, test, finishing) says what a signal then does. Leaving
  on the stop's SystemExit, the flag gives way to SIG_IGN (not to the default action) for the rest of the
  exit, so a second signal cannot turn the exit status 128 + signal into "killed by the signal"; SIGKILL
  still stops the process at once.
- The exit once the work is written (`ignore_stops_while_exiting`): stops are ignored, so that a finished
  run does not end with the status of a killed one.

Python has one wakeup descriptor, to which its C-level handler writes each signal's number at once,
before the main thread runs any Python handler. This module alone sets it, and one thread (started once
per process) reads it for every listener (`read_signal_numbers`): the watchdog here, and
data/pinned_files.py's SIGBUS guard.

No TensorFlow and no third-party import: main.py and the tools install the first handlers before theirs.
"""

import contextlib
import os
import signal
import socket
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How the one line of a stop names its signal.
SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM",
                signal.SIGHUP: "SIGHUP (the terminal closed)"}
STOP_GRACE_SECONDS = 5.0  # a stop held back in C++ this long ends the process (the watchdog)
WAKEUP_SECONDS = 1.0      # a listener of read_signal_numbers is called this often without any signal

_pending = []  # the signal whose stop has not reached stops_raised's end yet
_terminal_outputs = set()  # stdout's and stderr's descriptors that were a terminal when handlers were set
_graceful = [False]  # [True]: a training loop takes stops at its next safe point (InterruptFlag)
_raising = [0]  # how many stops_raised blocks are open: the watchdog acts only within one
_watchdog_busy = threading.Lock()  # held while the watchdog waits for a stop to be taken
_wakeup = {}  # "sockets": the pair whose writing end is Python's wakeup descriptor (read_signal_numbers)
_listeners = []  # what read_signal_numbers calls


class Terminated(KeyboardInterrupt):
  """SIGTERM (scancel, a batch system's time limit, `kill`) or SIGHUP (the terminal closed) where
  nothing handles it gracefully: it unwinds the program as Ctrl-C does, so that what the program was
  writing is removed (the built-in dataset's temporary file, a run folder still empty) and its worker
  processes are stopped."""

  def __init__(self, signum: int = signal.SIGTERM):
    super().__init__()
    self.signum = signum


def stop_line(signum: int) -> str:
  """The one line of a stop, as a shell reports the exit status 128 + `signum` that follows it."""
  return "\ninterrupted by %s\n" % SIGNAL_NAMES[signum]


def handles(signum: int) -> bool:
  """Whether a program should handle `signum`: not SIGHUP when it was started ignoring it (nohup, whose
  user wants the run to outlive the terminal)."""
  return signum != signal.SIGHUP or signal.getsignal(signum) != signal.SIG_IGN


def _in_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


# --- a closed terminal ------------------------------------------------------------------------------

def remember_terminal_outputs() -> None:
  """Notes which of stdout and stderr are a terminal, for leave_a_closed_terminal: asked when a SIGHUP
  handler is set, before any hang-up, after which a terminal no longer says it is one."""
  _terminal_outputs.update(fd for fd in (1, 2) if os.isatty(fd))


def leave_a_closed_terminal(outputs=None) -> None:
  """After SIGHUP: the descriptors among `outputs` (by default, those remember_terminal_outputs noted)
  that are no terminal any more, closed by the hang-up, write to /dev/null from now on. Every write to
  them fails (EIO), and the stop that SIGHUP asks for (its checkpoint, its exit status) must not fail at
  the next line or progress bar. A SIGHUP sent while the terminal is open (`kill -HUP`) leaves the
  output as it is."""
  closed = [fd for fd in (_terminal_outputs if outputs is None else outputs) if not os.isatty(fd)]
  if not closed:
    return
  null = os.open(os.devnull, os.O_WRONLY)
  try:
    for fd in closed:
      os.dup2(null, fd)
  finally:
    os.close(null)


# --- imports and flags: at once ---------------------------------------------------------------------

def exit_on_stop_signals() -> None:
  """For a program's first lines, before its imports and flags: until stops_raised takes over, a stop
  ends the process at once, with its line and status 128 + the signal's number (nothing is written
  before then). Python's defaults would die of SIGTERM without a word, and print a traceback for
  Ctrl-C."""
  for signum in STOP_SIGNALS:
    if handles(signum):
      signal.signal(signum, _exit_at_once)


def _exit_at_once(signum, frame):
  del frame
  _write_stop_line(signum)
  os._exit(128 + signum)  # pylint: disable=protected-access


def _write_stop_line(signum: int) -> None:
  try:
    os.write(2, stop_line(signum).encode())
  except OSError:  # a closed terminal (SIGHUP)
    pass


def leave_interrupts_to_the_parent():
  """Initializer of a multiprocessing.Pool's workers. A terminal's Ctrl-C reaches the whole foreground
  process group, and each worker it found in Python code printed its own KeyboardInterrupt traceback;
  the parent, which reports the stop in one line (stops_raised), ends its pool itself. So does the
  SIGHUP of a terminal that closes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)


# --- outside training: a stop is an exception -------------------------------------------------------

def _raise_stop(signum):
  raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _stop_on_signal(signum, frame):
  """Raises the stop, and raises it again every half second until stops_raised has it: raised while a
  finalizer runs (TensorFlow frees graphs in __del__), Python prints "Exception ignored" and drops it,
  and the program would carry on."""
  del frame
  _pending[:] = [signum]
  signal.setitimer(signal.ITIMER_REAL, 0.5, 0.5)
  if signum == signal.SIGHUP:
    leave_a_closed_terminal()
  _raise_stop(signum)


def _raise_pending(signum, frame):
  del signum, frame
  if _pending:
    _raise_stop(_pending[0])


def _stop_now(signum: int) -> None:
  """Takes a stop at once, as stops_raised's handler does: for InterruptFlag's handler before the first
  training step, where nothing is saved yet."""
  if signal.getsignal(signal.SIGALRM) is _raise_pending:  # within stops_raised: raised until it has it
    _stop_on_signal(signum, None)
  if signum == signal.SIGHUP:
    leave_a_closed_terminal()
  _raise_stop(signum)


def _caused_by_a_stop(error) -> bool:
  """Whether `error` is a stop or comes from one. A stop raised while C code had called back into Python
  comes out as a SystemError ("returned a result with an exception set") whose cause is the stop: seen
  in TensorFlow's nest.flatten when SIGTERM reached a worker setting up its data."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, KeyboardInterrupt):
      return True
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return False


def _quiet_lost_stops(unraisable, report=sys.__unraisablehook__):
  """sys.unraisablehook: a stop dropped in a finalizer is raised again (_stop_on_signal), so Python's
  "Exception ignored ... KeyboardInterrupt" traceback would only mislead; anything else is reported."""
  if not (_pending and _caused_by_a_stop(unraisable.exc_value)):
    report(unraisable)


def _quiet_printed_stops(exc_type, exc_value, exc_traceback, report=sys.__excepthook__):
  """sys.excepthook, which C code's PyErr_Print also calls: a stop that TensorFlow's C++ caught from
  the Python it called back (a SystemError caused by the stop, after which the process goes on) would be
  printed as a traceback before the one line of the stop; anything else is reported."""
  if not (_pending and _caused_by_a_stop(exc_value)):
    report(exc_type, exc_value, exc_traceback)


def _stop_signal_of(error: BaseException):
  """The signal whose stop `error` is, or None for any other exception."""
  if isinstance(error, KeyboardInterrupt):
    return error.signum if isinstance(error, Terminated) else signal.SIGINT
  if isinstance(error, Exception) and _pending:
    # A stop raised inside C code that had called back into Python can come out as another error:
    # a SystemError caused by it, or a bare TypeError with no cause (TensorFlow 2.6's nest.flatten,
    # Ctrl-C while --autotune built its models). With a stop pending, it is the stop.
    return _pending[0]
  return None


@contextlib.contextmanager
def stops_raised():
  """Runs the block with Ctrl-C, SIGTERM and SIGHUP raised in it (KeyboardInterrupt, Terminated) where
  nothing handles them gracefully (before training, or in a tool): a stop unwinds the block, then
  becomes one line on stderr and exit status 128 + the signal's number (130, 143, 129), as a shell
  reports it. Without this, SIGTERM would end the process where it stands. One held back by a call into
  C++ for STOP_GRACE_SECONDS ends the process there, with the same line and status (the watchdog),
  unless a training loop takes it at its next safe point. Any other exception passes."""
  in_main_thread = _in_main_thread()  # handlers can only be set there
  previous, watching = {}, False
  if in_main_thread:
    remember_terminal_outputs()
    previous = {signum: signal.signal(signum, _stop_on_signal) for signum in STOP_SIGNALS if handles(signum)}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _raise_pending)
    watching = read_signal_numbers(_watch_held_stops)
  _raising[0] += int(watching)
  previous_hook, sys.unraisablehook = sys.unraisablehook, _quiet_lost_stops
  previous_excepthook, sys.excepthook = sys.excepthook, _quiet_printed_stops
  try:
    yield
  except BaseException as error:  # pylint: disable=broad-except
    signum = _stop_signal_of(error)
    if signum is None:
      raise
    if in_main_thread:  # a second signal must not interrupt the exit (InterruptFlag does the same)
      signal.setitimer(signal.ITIMER_REAL, 0)
      for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
      previous = {}
    sys.stderr.write(stop_line(signum))
    sys.exit(128 + signum)
  finally:
    sys.unraisablehook, sys.excepthook = previous_hook, previous_excepthook
    _raising[0] -= int(watching)
    if previous:
      signal.setitimer(signal.ITIMER_REAL, 0)
      _pending[:] = []
      for signum, handler in previous.items():
        # Not over another's choice: a graceful stop leaves them ignored for its exit (InterruptFlag).
        if signal.getsignal(signum) in (_stop_on_signal, _raise_pending):
          signal.signal(signum, handler)


def _watch_held_stops(numbers: bytes) -> None:
  """The watchdog (read_signal_numbers' listener): a stop signal while stops are raised at once is
  given STOP_GRACE_SECONDS to reach the main thread. Python's C handler wrote its number here at once;
  this needs no bytecode of the main thread."""
  for signum in numbers:
    if signum in STOP_SIGNALS and _raising[0] and not _graceful[0]:
      if _watchdog_busy.acquire(blocking=False):  # pylint: disable=consider-using-with
        threading.Thread(target=_end_unless_taken, args=(signum,), name="stop-watchdog", daemon=True).start()
      return


def _taken() -> bool:
  """Whether a stop was raised in the main thread (stops_raised reports it), is a training loop's to
  take, or no stops_raised block is open any more."""
  return bool(_pending) or _graceful[0] or not _raising[0]


def _end_unless_taken(signum: int) -> None:
  try:
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while time.monotonic() < deadline:
      if _taken():
        return
      time.sleep(0.05)
    if not _taken():
      _write_stop_line(signum)
      os._exit(128 + signum)  # pylint: disable=protected-access
  finally:
    _watchdog_busy.release()


# --- training: a flag read at safe points -----------------------------------------------------------

class InterruptFlag:
  """Records SIGTERM/SIGINT/SIGHUP while installed (a context manager); the handler does nothing else
  (but for SIGHUP, move the output off a closed terminal). With `immediate_until_first_step`, a signal
  before the first training step has ended (while the step is traced and compiled: minutes for many
  CPU replicas, or a Poplar compilation) stops the run at once instead, as in its set-up: there is
  nothing to save yet, and waiting for the step would hold the stop for as long as the compilation
  takes."""

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
    self._graceful_before = None  # whether stops were graceful outside the flag

  @property
  def phase(self) -> str:
    return self._phase

  @phase.setter
  def phase(self, phase: str) -> None:
    self._phase = phase
    if phase != "training":
      self.first_step_done()

  def first_step_done(self) -> None:
    """From now on a signal is taken at the next safe point (the training callbacks call it at every
    batch end)."""
    if self._immediate:
      self._immediate = False
      if self._graceful_before is not None:
        _graceful[0] = True

  def __enter__(self):
    if _in_main_thread():  # handlers can only be set there
      remember_terminal_outputs()
      for signum in STOP_SIGNALS:
        if handles(signum):
          self._previous[signum] = signal.signal(signum, self._handle)
      self._graceful_before, _graceful[0] = _graceful[0], not self._immediate
    return self

  def __exit__(self, exc_type, exc, tb):
    # Leaving on the SystemExit of a stop that a signal asked for (a graceful stop), the process is about
    # to exit: restoring the default action now would let a second signal kill it during the rest of its
    # exit (interpreter and TensorFlow teardown), with status -signum instead of 128 + signum. More
    # signals are ignored instead, until the process has exited (SIGKILL still works; Python resets its
    # own handlers to the default action early in its shutdown, SIG_IGN it keeps).
    exiting = self.signum is not None and exc_type is not None and issubclass(exc_type, SystemExit)
    for signum, handler in self._previous.items():
      signal.signal(signum, signal.SIG_IGN if exiting else handler)
    self._previous = {}
    if self._graceful_before is not None:
      _graceful[0], self._graceful_before = self._graceful_before, None
    return False

  def _handle(self, signum, frame):
    del frame
    if self._immediate:
      _stop_now(signum)  # raises
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
    signalled (the processes agree on stops, training/interrupt.py's `agreed_stop`)."""
    return self.signum or signal.SIGTERM


# --- the exit ---------------------------------------------------------------------------------------

def ignore_stops_while_exiting() -> None:
  """For an entry point whose work is done and written (its last line printed): SIGINT, SIGTERM and
  SIGHUP are ignored for the rest of the exit, which tears TensorFlow down for about a second. A signal
  then would end a finished run with the status of a killed one, which a requeue script reads as
  "interrupted". Ignored, not handled: Python resets the handlers it installed to the default action
  early in its shutdown, and keeps SIG_IGN (SIGKILL still ends the process)."""
  if _in_main_thread():
    for signum in STOP_SIGNALS:
      signal.signal(signum, signal.SIG_IGN)


# --- Python's wakeup descriptor ---------------------------------------------------------------------

def read_signal_numbers(listener) -> bool:
  """Calls `listener(numbers)` from one reader thread: `numbers` holds (as bytes) the signals that
  Python's C-level handler noted, as they arrive, before the main thread runs their Python handlers;
  b"" after WAKEUP_SECONDS without any. Python has one wakeup descriptor: this module is its owner. It
  is set again at every call, in case another took it meanwhile. From the main thread only (Python
  sets the descriptor there); False elsewhere, or where it cannot be set."""
  if not _in_main_thread():
    return False
  if "sockets" not in _wakeup:
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # a full buffer drops a number, never blocks the handler
    _wakeup["sockets"] = (reader, writer)
    threading.Thread(target=_read_wakeups, args=(reader,), name="signal-numbers", daemon=True).start()
  try:
    signal.set_wakeup_fd(_wakeup["sockets"][1].fileno(), warn_on_full_buffer=False)
  except (ValueError, OSError):
    return False
  if listener not in _listeners:
    _listeners.append(listener)
  return True


def _read_wakeups(reader: socket.socket) -> None:
  reader.settimeout(WAKEUP_SECONDS)
  while True:
    try:
      numbers = reader.recv(4096)
    except socket.timeout:
      numbers = b""
    except OSError:
      return
    for listener in list(_listeners):
      with contextlib.suppress(Exception):  # one listener's failure must not deafen the others
        listener(numbers)
