"""The one exception type that the application reports as a plain one-line error.

Anything a user can cause (a bad flag combination, a missing or malformed data file, a backend that is
not installed) is raised as `UserError` with a message naming the flag, file or key and what was
expected. `main.py` and the tools print it on one line and exit non-zero (`reported_on_one_line`); any
other exception is a bug and keeps its traceback. A bad flag is one line too (`parse_flags`, and
`OneLineArgumentParser` for the argparse tools beside PyTorch), and so is a package missing from the
Python that runs them (`report_missing_packages`).
"""

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
import time


class UserError(Exception):
  """A problem with the user's input or environment, reported without a traceback."""


class Terminated(KeyboardInterrupt):
  """SIGTERM (scancel, a batch system's time limit, `kill`) or SIGHUP (the terminal closed) where
  nothing handles it gracefully: it unwinds the program as Ctrl-C does, so that what the program was
  writing is removed (the built-in dataset's temporary file, a run folder still empty) and its worker
  processes are stopped."""

  def __init__(self, signum: int = signal.SIGTERM):
    super().__init__()
    self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How the one line of a stop names its signal.
SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM",
                signal.SIGHUP: "SIGHUP (the terminal closed)"}
_pending = []  # the signal whose stop has not reached reported_on_one_line yet
_terminal_outputs = set()  # stdout's and stderr's descriptors that were a terminal when handlers were set
# Python runs a signal handler only between two bytecodes of the main thread, so a long call into C++
# (an XLA or Poplar compilation, a wait for another process) holds a stop back until it returns. While
# stops are immediate (set-up: nothing is saved yet), one not taken within STOP_GRACE_SECONDS ends the
# process with its line and status (_StopWatchdog). A C++ call that also holds the GIL blocks the
# watchdog too: such calls are kept short (host/cpuinfo.py bounds the CPU's logical devices).
STOP_GRACE_SECONDS = 5.0
_graceful = [False]  # [True]: a training loop takes stops at its next safe point (training/interrupt.py)


def _raise_stop(signum):
  raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


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


def handles(signum: int) -> bool:
  """Whether a program should handle `signum`: not SIGHUP when it was started ignoring it (nohup, whose
  user wants the run to outlive the terminal)."""
  return signum != signal.SIGHUP or signal.getsignal(signum) != signal.SIG_IGN


def _stop_on_signal(signum, frame):
  """Raises the stop, and raises it again every half second until reported_on_one_line has it: raised
  while a finalizer runs (TensorFlow frees graphs in __del__), Python prints "Exception ignored" and
  drops it, and the program would carry on."""
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


def stop_now(signum: int) -> None:
  """Takes a stop at once, as reported_on_one_line's handler does: for a training loop's own handler
  before its first step, where nothing is saved yet (training/interrupt.py)."""
  if signal.getsignal(signal.SIGALRM) is _raise_pending:  # within reported_on_one_line: raised until it has it
    _stop_on_signal(signum, None)
  if signum == signal.SIGHUP:
    leave_a_closed_terminal()
  _raise_stop(signum)


def set_graceful_stops(graceful: bool) -> bool:
  """Whether a training loop takes stops at its next safe point (then the watchdog of
  reported_on_one_line leaves a stop held back in C++ to it); returns the previous setting."""
  previous, _graceful[0] = _graceful[0], graceful
  return previous


def exit_on_stop_signals() -> None:
  """For a program's first lines, before its imports and flags: until reported_on_one_line takes over,
  a stop ends the process at once, with its line and status 128 + the signal's number (nothing is
  written before then). Python's defaults would die of SIGTERM without a word, and print a traceback
  for Ctrl-C."""
  for signum in _STOP_SIGNALS:
    if handles(signum):
      signal.signal(signum, _exit_at_once)


def _exit_at_once(signum, frame):
  del frame
  _write_stop_line(signum)
  os._exit(128 + signum)  # pylint: disable=protected-access


def _write_stop_line(signum: int) -> None:
  try:
    os.write(2, ("\ninterrupted by %s\n" % SIGNAL_NAMES[signum]).encode())
  except OSError:  # a closed terminal (SIGHUP)
    pass


class _StopWatchdog:
  """Ends the process when a stop signal has not been taken by the main thread within
  STOP_GRACE_SECONDS while stops are immediate. Python's own C handler writes each signal's number to
  the wakeup descriptor at once; this thread reads it, and needs no bytecode of the main thread."""

  def __init__(self):
    self._read, self._write = os.pipe()
    self._closed = False
    os.set_blocking(self._write, False)
    self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
    threading.Thread(target=self._watch, name="stop-watchdog", daemon=True).start()

  def _watch(self):
    try:
      while True:
        received = os.read(self._read, 64)
        if not received:
          return  # closed
        for signum in received:
          if signum in _STOP_SIGNALS and not _graceful[0]:
            self._end_unless_taken(signum)
            break
    finally:
      os.close(self._read)

  def _end_unless_taken(self, signum: int) -> None:
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while time.monotonic() < deadline:
      if _pending or _graceful[0] or self._closed:
        return  # raised in the main thread (reported_on_one_line reports it), or a loop's to take
      time.sleep(0.05)
    if not (_pending or _graceful[0] or self._closed):
      _write_stop_line(signum)
      os._exit(128 + signum)  # pylint: disable=protected-access

  def close(self):
    self._closed = True
    signal.set_wakeup_fd(self._previous_fd)
    os.close(self._write)  # the thread reads the end and leaves


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


def leave_interrupts_to_the_parent():
  """Initializer of a multiprocessing.Pool's workers. A terminal's Ctrl-C reaches the whole foreground
  process group, and each worker it found in Python code printed its own KeyboardInterrupt traceback;
  the parent, which reports the stop in one line (reported_on_one_line), ends its pool itself. So
  does the SIGHUP of a terminal that closes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)


@contextlib.contextmanager
def reported_on_one_line(status: int = 1):
  """Runs the block; a UserError from it becomes one `error: ...` line on stderr and exit `status`.
  Ctrl-C, SIGTERM or SIGHUP where nothing handles it (before training, or in a tool; training itself
  stops gracefully with a checkpoint) becomes one line too, and exit status 128 + the signal's number
  (130, 143, 129), as a shell reports it. Without this, SIGTERM would end the process where it stands.
  One held back by a call into C++ for STOP_GRACE_SECONDS ends the process there, with the same line
  and status (_StopWatchdog), unless a training loop takes it at its next safe point."""
  in_main_thread = threading.current_thread() is threading.main_thread()  # handlers can only be set there
  previous, watchdog = {}, None
  if in_main_thread:
    remember_terminal_outputs()
    previous = {signum: signal.signal(signum, _stop_on_signal) for signum in _STOP_SIGNALS if handles(signum)}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _raise_pending)
    watchdog = _StopWatchdog()
  previous_hook, sys.unraisablehook = sys.unraisablehook, _quiet_lost_stops
  previous_excepthook, sys.excepthook = sys.excepthook, _quiet_printed_stops
  try:
    yield
  except UserError as error:
    sys.stderr.write("error: %s\n" % error)
    sys.exit(status)
  except BaseException as interrupt:  # pylint: disable=broad-except
    if isinstance(interrupt, KeyboardInterrupt):
      signum = interrupt.signum if isinstance(interrupt, Terminated) else signal.SIGINT
    elif isinstance(interrupt, Exception) and _pending:
      # A stop raised inside C code that had called back into Python can come out as another error:
      # a SystemError caused by it, or a bare TypeError with no cause (TensorFlow 2.6's nest.flatten,
      # Ctrl-C while --autotune built its models). With a stop pending, it is the stop.
      signum = _pending[0]
    else:
      raise
    if in_main_thread:  # a second signal must not interrupt the exit (training/interrupt.py does the same)
      signal.setitimer(signal.ITIMER_REAL, 0)
      for other in _STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
      previous = {}
    sys.stderr.write("\ninterrupted by %s\n" % SIGNAL_NAMES[signum])
    sys.exit(128 + signum)
  finally:
    sys.unraisablehook, sys.excepthook = previous_hook, previous_excepthook
    if watchdog is not None:
      watchdog.close()
    if previous:
      signal.setitimer(signal.ITIMER_REAL, 0)
      _pending[:] = []
      for signum, handler in previous.items():
        # Not over another's choice: a graceful stop leaves them ignored for its exit (training/interrupt.py).
        if signal.getsignal(signum) in (_stop_on_signal, _raise_pending):
          signal.signal(signum, handler)


def ignore_stops_while_exiting() -> None:
  """For an entry point whose work is done and written (its last line printed): SIGINT, SIGTERM and
  SIGHUP are ignored for the rest of the exit, which tears TensorFlow down for about a second. A signal then
  would end a finished run with the status of a killed one, which a requeue script reads as
  "interrupted". Ignored, not handled: Python resets the handlers it installed to the default action
  early in its shutdown, and keeps SIG_IGN (SIGKILL still ends the process)."""
  if threading.current_thread() is threading.main_thread():
    for signum in _STOP_SIGNALS:
      signal.signal(signum, signal.SIG_IGN)


def with_one_line_errors(main):
  """An absl `main` whose UserErrors, Ctrl-C, SIGTERM and SIGHUP are reported as `reported_on_one_line`
  does."""
  def main_reporting_on_one_line(argv):
    with reported_on_one_line():
      return main(argv)
  return main_reporting_on_one_line


_REPO_ROOT = os.path.dirname(os.path.abspath(__file__))


def _is_own_module(package: str) -> bool:
  """Whether `package` is this repository's (a folder or module at its top, or a tool beside another)."""
  return any(os.path.exists(os.path.join(_REPO_ROOT, *parts))
             for parts in ((package,), (package + ".py",), ("tools", package + ".py")))


def shown_path(path: str) -> str:
  """`path` as a command to paste shows it: relative to the working folder when it lies below it, else
  as given (used in messages here and in the closing report's commands, training/summary.py); whole,
  when the user's shell is in another folder than this process."""
  if _shell_is_elsewhere():
    return os.path.abspath(path)
  relative = os.path.relpath(path)
  return path if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def given_path(path: str) -> str:
  """A path the user gave (a --logdir), for a command to paste: as given, or whole when the user's shell
  is in another folder than this process (below)."""
  return os.path.abspath(path) if _shell_is_elsewhere() else path


def _shell_is_elsewhere() -> bool:
  """Whether the folder of the shell that started us (PWD, which shells keep) is not our working folder:
  `make -C <clone> run` runs the application in the clone while the user's shell stays where it was,
  and a path relative to the clone would not work there."""
  shell = os.environ.get("PWD")
  try:
    return bool(shell) and not os.path.samefile(shell, os.curdir)
  except OSError:  # PWD names no folder (any more): nothing to compare with
    return False


# The environments `make` builds for each program: where each is and the command that builds it (the
# application's, one per BACKEND, in the Makefile's order), and what they hold.
_ENVIRONMENTS = {
    "application": ((".venv", "make install"), (".venv-gpu", "BACKEND=gpu make install"),
                    (".venv-tf26", "BACKEND=tf26 make install")),
    "reference": ((".venv-torch", "make bench-reference"),),
}
_CONTENTS = {"application": "TensorFlow and requirements.txt", "reference": "PyTorch (requirements-reference.txt)"}


def missing_package_message(module: str, environment: str = "application") -> str:
  """The one line for a third-party `module` this Python cannot import, and how to get it. The usual
  cause is the README's first command run by a Python other than one of the environments that `make`
  builds for the program: then the line names the first of them that exists."""
  package = module.split(".")[0]
  program = shown_path(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else "the program"
  found = "Python %d.%d (%s) has no module %r, which %s needs" % (
      sys.version_info[0], sys.version_info[1], sys.executable, package, program)
  venvs = [(os.path.join(_REPO_ROOT, folder), target) for folder, target in _ENVIRONMENTS[environment]]
  if os.path.realpath(sys.prefix) not in [os.path.realpath(venv) for venv, _ in venvs]:
    for venv, target in venvs:
      venv_python = os.path.join(venv, "bin", "python")
      if os.path.exists(venv_python):
        shown = shlex.quote(shown_path(venv_python))
        return "%s: run it with %s, the environment `%s` made" % (found, shown, target)
  if package == "tensorflow":
    return ("%s: `make install` installs TensorFlow's CPU build into .venv (`BACKEND=gpu make install` the "
            "CUDA one, into .venv-gpu); on a Graphcore host, install the Poplar SDK's TensorFlow wheel "
            "(docs/ipu.md)" % found)
  folder, target = _ENVIRONMENTS[environment][0]
  return "%s: `%s` creates %s with %s; then run %s %s" % (
      found, target, folder, _CONTENTS[environment], os.path.join(folder, "bin", "python"),
      shlex.quote(program))


def report_missing_packages(environment: str = "application") -> None:
  """Called by main.py and every tool before their first third-party import: from then on, a
  third-party module missing at the top level is one `error:` line (the interpreter still exits with
  status 1); anything else, our own modules included, keeps its traceback. `environment` names the
  one `make` builds for the program (_ENVIRONMENTS). A Ctrl-C before `reported_on_one_line` takes
  over (in the imports, which take a second or two) is one line too; Python then ends the process by
  SIGINT, which a shell reports as status 130. Output into a pipe whose reader left (`| head`) ends
  the program quietly, with status 1."""
  previous = sys.excepthook

  def report(kind, value, trace):
    name = getattr(value, "name", None) if isinstance(value, ModuleNotFoundError) else None
    if name and not _is_own_module(name.split(".")[0]):
      sys.stderr.write("error: %s\n" % missing_package_message(name, environment))
    elif issubclass(kind, KeyboardInterrupt):
      sys.stderr.write("\ninterrupted by SIGINT (Ctrl-C)\n")
    elif issubclass(kind, BrokenPipeError):
      # The reader of our output left (`| head`): what is left of it has nowhere to go. Standard output
      # then points at /dev/null, or the interpreter's last flush reports the same error again.
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    else:
      previous(kind, value, trace)

  sys.excepthook = report


HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort", "--helpfull", "-helpfull",
              "--helpxml", "-helpxml")


def parse_flags(argv):
  """absl `flags_parser` for `app.run` (main.py and the tools): a bad flag is one `error:` line on
  stderr, naming the program and the flag, and exit status 2 (absl's own is a FATAL line and a hint).
  Asked for help, the program prints it and exits with status 0, as argparse programs do (absl's
  help flags exit with 1, which scripts read as a failure)."""
  # Imported here: this module stays free of third-party imports, for the reference PyTorch tools'
  # environment, which imports the model's plain-data modules without absl.
  from absl import flags  # pylint: disable=import-outside-toplevel
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    # absl's CantOpenFlagFileError starts "ERROR:: "; after our "error: " once is enough.
    message = " ".join(str(error).split())
    message = message[len("ERROR:: "):] if message.startswith("ERROR:: ") else message
    _flag_error(argv, message)
  except UnicodeDecodeError as error:  # absl reads a --flagfile as UTF-8 text
    _flag_error(argv, "a --flagfile is not a text file of flags (%s): %s" % (
        error.reason, " ".join(arg for arg in argv[1:] if arg.split("=")[0].lstrip("-") == "flagfile")))
  except SystemExit as stop:  # absl's HelpFlag.parse: the usage, then sys.exit(1)
    if stop.code == 1 and any(arg.split("=")[0] in HELP_FLAGS for arg in argv[1:]):
      sys.exit(0)
    raise
  except BrokenPipeError:  # `--help | head`: the reader has what it wanted (the Python docs' recipe)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
    sys.exit(0)


def _flag_error(argv, message: str) -> None:
  sys.stderr.write("%s: error: %s\n" % (os.path.basename(argv[0]), message))
  sys.exit(2)


def refuse_arguments(argv) -> None:
  """For programs that take flags only: words left after absl's parse (a forgotten `--`, a stray path)
  are one `error:` line and exit status 2, where absl's UsageError would print the whole --help first."""
  if len(argv) > 1:
    _flag_error(argv, "unexpected argument%s %s: this program takes flags only, as --name=value (--help "
                      "lists them)" % ("" if len(argv) == 2 else "s", " ".join(argv[1:])))


def check_output_path(flag: str, path: str, folder: bool = False, default: bool = False) -> None:
  """Before a tool's work: that `path`, given as `flag`, can be written -- a file in an existing folder,
  or with `folder` a folder (created with its parents if missing). A mistyped or unwritable path is
  then a UserError at once, not a traceback after the work is done. Nothing is created here.
  `default`: the user did not give `flag` and `path` is its default, which the error says (with how to
  choose another), instead of naming a flag the user never typed as if they had."""
  if not default:
    _check_writable("%s=%s" % (flag, path), path, folder)
    return
  try:
    _check_writable("the default %s=%s" % (flag, path), path, folder)
  except UserError as error:
    raise UserError("%s; pass %s=<a writable %s>" % (error, flag, "folder" if folder else "file")) from None


def _check_writable(given: str, path: str, folder: bool) -> None:
  """check_output_path's checks; `given` names the path in the errors."""
  if os.path.exists(path) and os.path.isdir(path) != folder:
    raise UserError("%s is a %s; expected %s" % (given, "folder" if os.path.isdir(path) else "file",
                                                 "a folder (created if missing)" if folder else "a file name"))
  if folder:  # the nearest existing folder: os.makedirs creates the rest below it
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
      existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
      raise UserError("%s: %s is not a folder, so no folder can be created below it" % (given, existing))
  else:  # open() creates no folder
    existing = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(existing):
      raise UserError("%s: %s; expected a file name in an existing folder" % (
          given, ("%s is not a folder" if os.path.exists(existing) else "no folder %s exists") % existing))
    if os.path.exists(path):
      existing = path
  if not os.access(existing, os.W_OK | (os.X_OK if os.path.isdir(existing) else 0)):
    raise UserError("%s: %s cannot be written (permission denied)" % (given, existing))


def existing_file(path: str) -> str:
  """An argparse `type` for a file that must exist (argparse then names the argument)."""
  if not os.path.isfile(path):
    raise argparse.ArgumentTypeError("%s is not a file" % path)
  return path


class OneLineArgumentParser(argparse.ArgumentParser):
  """argparse for the tools that run beside PyTorch (no absl there): a bad argument is one
  `prog: error: ...` line and exit status 2, without the usage block argparse prints before it
  (`--help` shows the usage)."""

  def error(self, message):
    sys.stderr.write("%s: error: %s\n" % (self.prog, " ".join(message.split())))
    sys.exit(2)
