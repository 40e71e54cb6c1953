"""tools/monitor.py: parsers for gc-info and nvidia-smi output, and real host sampling into TensorBoard."""

import glob
import os
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT
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
