"""tools/monitor.py: parsers for gc-info and nvidia-smi output, and real host sampling into TensorBoard."""

import glob
import os
import subprocess
import sys

import pytest

from errors import UserError
from tests.support.helpers import REPO_ROOT, assert_names, assert_one_line_error
from analysis.events import read_scalars

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import monitor  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order

DATA = os.path.join(REPO_ROOT, "tests", "data")


def test_parse_gc_info_device_info():
  # Sample in the "key: value" format of `gc-info -d 0 --device-info` (Graphcore command-line tools).
  scalars = monitor.parse_gc_info(open(os.path.join(DATA, "gc_info_device_info.txt")).read(), "0")
  assert scalars == {"ipu0/utilisation_percent": 62.31, "ipu0/die_temperature_c": 37.0,
                     "ipu0/board_temperature_c": 41.5, "ipu0/board_power_w": 183.2,
                     "ipu0/clock_mhz": 1850.0}


def test_parse_nvidia_smi_csv():
  scalars = monitor.parse_nvidia_smi(open(os.path.join(DATA, "nvidia_smi_query.csv")).read())
  assert scalars["gpu0/utilization_percent"] == 87 and scalars["gpu0/power_w"] == 312.4
  assert scalars["gpu1/memory_used_mib"] == 4 and "gpu1/power_w" not in scalars   # [N/A] skipped


def test_host_samples_while_a_command_runs(tmp_path):
  code = monitor.monitor(str(tmp_path), 0.2, 0, "host", ["0"],
                         [sys.executable, "-c", "import time; time.sleep(1.0)"])
  assert code == 0
  scalars = read_scalars(str(tmp_path / "monitor"))
  assert len(scalars["host/cpu_percent"]) >= 3
  assert all(0 < value < 10000 for _, value in scalars["host/memory_used_gib"])


def test_command_exit_status_is_returned(tmp_path):
  assert monitor.monitor(str(tmp_path), 0.1, 0, "host", [], [sys.executable, "-c", "raise SystemExit(3)"]) == 3


@pytest.mark.parametrize("tool, source", [("gc-info", "ipu"), ("nvidia-smi", "gpu")])
def test_auto_source_follows_the_installed_tool(tmp_path, monkeypatch, tool, source):
  (tmp_path / tool).write_text("#!/bin/sh\n")
  (tmp_path / tool).chmod(0o755)
  monkeypatch.setenv("PATH", str(tmp_path))
  assert monitor.resolve_source("auto") == source


def test_a_source_named_without_its_tool_is_refused(tmp_path, monkeypatch):
  """--source=gpu without nvidia-smi is refused, rather than sampling the host alone in silence."""
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(UserError, match="--source=gpu.*nvidia-smi"):
    monitor.resolve_source("gpu")
  (tmp_path / "gc-info").write_text("#!/bin/sh\n")
  (tmp_path / "gc-info").chmod(0o755)
  with pytest.raises(UserError, match="--source=ipu.*--ipu_ids"):
    monitor.resolve_source("ipu", [])
  assert monitor.resolve_source("ipu", ["0", "1"]) == "ipu"
  assert monitor.resolve_source("host") == "host"


def test_the_command_line_runs_a_command_and_says_nothing_of_its_own(tmp_path):
  """The program as a user starts it: the command's output and exit status come through, and nothing
  else reaches the terminal (TensorFlow's start-up lines about CUDA and oneDNN on a machine without
  an NVIDIA device among them)."""
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "monitor.py"),
                           "--logdir=%s" % tmp_path, "--interval=0.2", "--source=host", "--",
                           sys.executable, "-c", "print('hello'); raise SystemExit(4)"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 4 and result.stdout == "hello\n"
  if not glob.glob("/dev/nvidia[0-9]*"):
    assert result.stderr == ""
  assert read_scalars(str(tmp_path / "monitor"))["host/cpu_percent"]


@pytest.mark.parametrize("case, names", [
    ("logdir_is_a_file", ["--logdir={a_file}", "is a file"]),
    ("no_such_command", ["/nonexistent/cmd", "command not found"]),
    ("not_on_the_path", ["nonexistent-cmd", "command not found", "PATH"]),
])
def test_what_would_fail_after_tensorflows_start_is_one_error_first(tmp_path, case, names):
  a_file = str(tmp_path / "a_file")
  with open(a_file, "w") as f:
    f.write("x")
  logdir = a_file if case == "logdir_is_a_file" else str(tmp_path)
  command = {"no_such_command": ["/nonexistent/cmd"], "not_on_the_path": ["nonexistent-cmd", "-x"]}.get(
      case, [sys.executable, "-c", "pass"])
  with pytest.raises(UserError) as error:
    monitor.monitor(logdir, 0.1, 0, "host", [], command)
  assert_names(error.value, *(name.format(a_file=a_file) for name in names))
  assert not os.path.exists(os.path.join(str(tmp_path), "monitor"))


@pytest.mark.parametrize("flag", ["--interval=inf", "--interval=nan", "--duration=inf", "--duration=nan"])
def test_an_endless_or_undefined_time_is_a_flag_error(tmp_path, flag):
  """time.sleep(inf) overflowed after TensorFlow's start, and a nan duration never ended."""
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "monitor.py"),
                           "--logdir=%s" % tmp_path, flag], capture_output=True, text=True, timeout=30)
  assert result.returncode == 2
  assert_one_line_error(result, "monitor.py: error:", flag, "finite")
