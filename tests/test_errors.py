"""errors.py's checks of user-given paths, which tools run before their work: a mistyped or unwritable
output path is one line at once, not a traceback after minutes of work."""

import ctypes
import os
import signal
import subprocess
import sys
import types

import pytest

import stop_signals
from errors import UserError
from host.output_paths import check_output_path
from tests.support.helpers import REPO_ROOT, assert_names, line_naming


@pytest.mark.parametrize("flag, path, folder, names", [
    ("--outdir", "/dev/null/x", True, [": /dev/null is", "not a folder", "created below it"]),
    ("--outdir", "{a_file}/sub", True, [": {a_file} is", "not a folder", "created below it"]),
    ("--export_dir", "{a_file}", True, ["{a_file} is a file", "expected a folder", "(created if missing)"]),
    ("--json", "/nonexistent/x.json", False, ["no folder /nonexistent", "exists;", "an existing folder"]),
    ("--json", "{tmp}", False, ["{tmp} is a folder", "expected a file name"]),
])
def test_output_paths_are_checked_before_the_work(tmp_path, flag, path, folder, names):
  paths = {"a_file": str(tmp_path / "a_file"), "tmp": str(tmp_path)}
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(UserError) as error:
    check_output_path(flag, path.format(**paths), folder=folder)
  message = str(error.value)
  assert message.startswith("%s=%s" % (flag, path.format(**paths))) and "\n" not in message, message
  assert_names(message, *[name.format(**paths) for name in names])


def test_an_output_path_that_is_a_default_is_named_as_one(tmp_path):
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(UserError) as error:
    check_output_path("--out", str(tmp_path / "a_file" / "sub"), folder=True, default=True)
  message = str(error.value)
  assert message.startswith("the default --out="), message
  assert_names(message, "--out=%s:" % (tmp_path / "a_file" / "sub"), ": %s is" % (tmp_path / "a_file"),
               "not a folder", "pass --out=", "<a writable folder>")


def test_output_paths_that_can_be_written_pass_and_nothing_is_created(tmp_path):
  check_output_path("--outdir", str(tmp_path / "new" / "deeper"), folder=True)
  check_output_path("--json", str(tmp_path / "x.json"))
  check_output_path("--json", os.devnull)
  assert os.listdir(str(tmp_path)) == []


def test_output_into_a_pipe_whose_reader_left_ends_quietly():
  """`tools/predict.py ... | head -1` ended in a BrokenPipeError traceback."""
  code = ("import sys; sys.path.insert(0, %r); from errors import report_missing_packages; "
          "report_missing_packages(); [print('line %%d' %% i) for i in range(200000)]" % REPO_ROOT)
  process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  assert process.stdout.readline() == b"line 0\n"
  process.stdout.close()  # the reader leaves, as head does
  stderr = process.stderr.read().decode()
  assert process.wait(timeout=60) == 1 and stderr == ""


def test_a_stop_that_c_code_caught_and_printed_is_no_traceback(monkeypatch, capfd):
  """SIGTERM while TensorFlow's C++ had called back into Python: the stop came out as a SystemError
  caused by it, which the C++ printed (PyErr_Print calls sys.excepthook) before the stop's one line.
  While a stop is pending, such errors are not printed; other errors are."""
  monkeypatch.setattr(stop_signals, "_pending", [signal.SIGTERM])
  monkeypatch.setattr(sys, "excepthook", stop_signals._quiet_printed_stops)
  caught_stop = (b"import stop_signals\ntry:\n  raise stop_signals.Terminated()\n"
                 b"except KeyboardInterrupt as stop:\n"
                 b"  raise SystemError('returned a result with an exception set') from stop\n")
  assert ctypes.pythonapi.PyRun_SimpleString(caught_stop) == -1   # C code's PyErr_Print of the error
  assert capfd.readouterr().err == ""
  assert ctypes.pythonapi.PyRun_SimpleString(b"raise SystemError('another error')\n") == -1
  assert_names(line_naming(capfd.readouterr().err, "SystemError: "), "another error")


def test_a_stop_lost_in_a_finalizer_is_no_traceback_even_as_the_cause_of_another_error(monkeypatch):
  monkeypatch.setattr(stop_signals, "_pending", [signal.SIGTERM])
  reported = []
  try:
    try:
      raise stop_signals.Terminated()
    except KeyboardInterrupt as stop:
      raise SystemError("returned a result with an exception set") from stop
  except SystemError as error:
    caused = error
  other = ValueError("another error")
  for exc_value in (stop_signals.Terminated(), caused, other):
    stop_signals._quiet_lost_stops(types.SimpleNamespace(exc_value=exc_value), report=reported.append)
  assert [unraisable.exc_value for unraisable in reported] == [other]
  monkeypatch.setattr(stop_signals, "_pending", [])   # no stop pending: everything is reported
  stop_signals._quiet_lost_stops(types.SimpleNamespace(exc_value=caused), report=reported.append)
  assert reported[-1].exc_value is caused


def test_after_a_hang_up_the_output_that_went_to_the_terminal_goes_to_dev_null():
  """Every write to a closed terminal fails (EIO): the stop that its SIGHUP asks for must not fail on the
  next line. A terminal still open (`kill -HUP`) keeps the output."""
  master, slave = os.openpty()
  try:
    stop_signals.leave_a_closed_terminal([slave])
    os.write(slave, b"still shown")
    assert os.read(master, 100) == b"still shown"
  finally:
    os.close(master)
  with pytest.raises(OSError):
    os.write(slave, b"x")
  stop_signals.leave_a_closed_terminal([slave])
  assert os.write(slave, b"to /dev/null") == len(b"to /dev/null") and not os.isatty(slave)
  os.close(slave)
