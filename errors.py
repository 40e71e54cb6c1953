"""The one exception type that the application reports as a plain one-line error, and the one-line reports.

Anything a user can cause (a bad flag combination, a missing or malformed data file, a backend that is
not installed) is raised as `UserError` with a message naming the flag, file or key and what was
expected. `main.py` and the tools print it on one line and exit non-zero (`reported_on_one_line`, where a
stop signal is one line too: stop_signals.py); any other exception is a bug and keeps its traceback. A
bad flag is one line too (`parse_flags`, and `OneLineArgumentParser` for the argparse tools beside
PyTorch), and so is a package missing from the Python that runs them (`report_missing_packages`).
"""

import argparse
import contextlib
import os
import shlex
import signal
import sys

from stop_signals import stop_line, stops_raised


class UserError(Exception):
  """A problem with the user's input or environment, reported without a traceback."""


@contextlib.contextmanager
def reported_on_one_line(status: int = 1):
  """Runs the block; a UserError from it becomes one `error: ...` line on stderr and exit `status`.
  Ctrl-C, SIGTERM or SIGHUP where nothing handles it (before training, or in a tool; training itself
  stops gracefully with a checkpoint) becomes one line too, and exit status 128 + the signal's number
  (130, 143, 129), as a shell reports it (stop_signals.stops_raised)."""
  with stops_raised():
    try:
      yield
    except UserError as error:
      sys.stderr.write("error: %s\n" % error)
      sys.exit(status)


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
      sys.stderr.write(stop_line(signal.SIGINT))
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
