"""The log keeps the application's INFO lines and only warnings from the libraries (issue 19)."""

import logging as python_logging
import os
import subprocess
import sys

import tensorflow as tf

from tests.support.helpers import REPO_ROOT
from training import logs


def _record(pathname, level):
  return python_logging.LogRecord("absl", level, pathname, 1, "message", (), None)


def test_library_info_is_dropped_and_warnings_kept():
  own_filter = logs._OwnInfoOnly()  # pylint: disable=protected-access
  library = os.path.join(os.path.dirname(tf.__file__), "python", "distribute", "cross_device_ops.py")
  assert not own_filter.filter(_record(library, python_logging.INFO))
  assert own_filter.filter(_record(library, python_logging.WARNING))
  assert own_filter.filter(_record(os.path.abspath(logs.__file__), python_logging.INFO))


def test_setup_installs_the_filter_once():
  logs.setup()
  logs.setup()
  from absl import logging  # pylint: disable=import-outside-toplevel
  handler = logging.get_absl_handler()
  assert sum(isinstance(f, logs._OwnInfoOnly) for f in handler.filters) == 1  # pylint: disable=protected-access


_PROBE_SCRIPT = """
import os, sys
from run_config import RunConfig
from strategies import environment
config = RunConfig(model="mnist", backend=%r)
try:
  with environment.quiet_cuda_probe(config):
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
    os.write(2, b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\\n")
    os.write(2, b"E0000 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\\n")
    os.write(2, b"I0000 port.cc:153] oneDNN custom operations are on. You may see slightly different\\n")
    os.write(2, b"W0000 a real warning\\n")
    sys.stderr.write("python line\\n")
    raise RuntimeError("inside")
except RuntimeError:
  sys.stderr.write("after\\n")
"""


def _probe_stderr(backend):
  result = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT % backend], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
  return result.stderr


def test_cuda_probe_lines_are_dropped_on_a_cpu_run_and_the_rest_kept_in_order():
  stderr = _probe_stderr("cpu")
  assert stderr.splitlines() == ["W0000 a real warning", "python line", "after"]


def test_cuda_probe_lines_stay_when_a_gpu_is_asked_for():
  assert "failed call to cuInit" in _probe_stderr("gpu")
