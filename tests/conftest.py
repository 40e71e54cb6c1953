"""Test set-up: TensorFlow's start-up environment and two logical CPU devices, before any test runs.

The environment must be prepared before the first `import tensorflow` (as `main.py` does), and logical
CPU devices can only be configured before TensorFlow's runtime starts, so both happen at import time.
"""

import os
import signal
import tempfile

import pytest

from run_config import RunConfig
from strategies import environment

# The tests press Ctrl-C (SIGINT) on the processes they start, as a terminal does on its foreground job.
# A suite started in the background by a non-interactive shell (`make test &` in a script, `nohup ... &`)
# inherits SIGINT ignored and would hand that on: TensorBoard, which keeps an ignored SIGINT, then never
# ends. Given back its default here, every process started from the tests gets the default action.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)

# The processes the tests start write Python's bytecode caches, as on a user's machine, even where the
# suite itself runs without (PYTHONDONTWRITEBYTECODE=1, as in this project's sandbox): what a run leaves
# in its temporary folder (AutoGraph's bytecode, strategies/environment.py) is then there to be seen.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

_CONFIG = RunConfig(model="mnist")
environment.prepare(_CONFIG)

# Quiet as in main.py (pytest-xdist's workers print TensorFlow's start-up lines otherwise), and its objects
# kept from the garbage collector as there: each full collection would walk them again.
TEST_CPU_DEVICES = 2
with environment.quiet_cuda_probe():
  import tensorflow as tf  # noqa: E402  pylint: disable=wrong-import-position
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration() for _ in range(TEST_CPU_DEVICES)])


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_basetemp(tmp_path_factory):
  """Temporary files of the tests and of the processes they start go under pytest's basetemp, which
  pytest prunes, and not into /tmp: TensorFlow's autograph files, for one, stay behind wherever a
  process ends without its exit handlers (xdist's workers, the processes that tests kill)."""
  folder = str(tmp_path_factory.mktemp("tmpdir"))
  os.environ["TMPDIR"] = folder
  tempfile.tempdir = folder
  yield


@pytest.fixture(autouse=True, scope="session")
def _shell_in_the_working_folder():
  """The tests run as if typed in a shell in pytest's working folder, also under `make -C <clone>
  test`: the paths in pasted commands depend on where the user's shell is (errors.shown_path)."""
  os.environ["PWD"] = os.getcwd()
  yield


@pytest.fixture(autouse=True)
def _fresh_keras_session():
  yield
  tf.keras.backend.clear_session()
  # select_backend() sets the global precision policy (mixed bfloat16 under the default
  # --precision=auto on AMX CPUs); no test may hand it on to the next.
  tf.keras.mixed_precision.set_global_policy("float32")
