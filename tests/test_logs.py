"""The log keeps the application's INFO lines and only warnings from the libraries."""

import logging as python_logging
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from strategies import environment
from tests.support.helpers import REPO_ROOT, assert_names
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


def test_the_prefix_is_level_date_time_file_and_line():
  record = python_logging.LogRecord("absl", python_logging.WARNING, "/app/training/loop.py", 321, "Global %s",
                                    ("batch",), None)
  line = logs.ShortPrefix().format(record)
  assert re.fullmatch(r"W\d{4} \d\d:\d\d:\d\d loop\.py:321\] Global batch", line), line


def test_tensorflows_warnings_are_dropped_by_text_only_inside_the_block(caplog):
  """TensorFlow's own logger, as its tf.function retracing warning reaches it (TF 2.6 and 2.21)."""
  logger = tf.get_logger()
  retracing = "5 out of the last 9 calls to <function f> triggered tf.function retracing. Tracing is expensive"
  with caplog.at_level(python_logging.WARNING):
    with logs.tensorflow_warnings_dropped(logs.RETRACING_WARNING):
      logger.warning(retracing)
      logger.warning("another warning")
    logger.warning(retracing + " (after)")
  messages = [record.getMessage() for record in caplog.records]
  assert messages == ["another warning", retracing + " (after)"]


_PROBE_SCRIPT = """
import os, sys
from strategies import environment
try:
  with environment.quiet_cuda_probe():
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


def _probe_stderr():
  result = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
  return result.stderr


@pytest.mark.skipif(bool(environment.nvidia_device_nodes()), reason="keeps the lines where a GPU exists")
def test_cuda_probe_lines_are_dropped_without_an_nvidia_device_and_the_rest_kept_in_order():
  stderr = _probe_stderr()
  assert stderr.splitlines() == ["W0000 a real warning", "python line", "after"]


def test_cuda_probe_lines_stay_where_an_nvidia_device_exists(monkeypatch, capfd):
  """There a failed cuInit is what a user needs to read, whatever the backend."""
  monkeypatch.setattr(environment, "nvidia_device_nodes", lambda: ["/dev/nvidia0"])
  with environment.quiet_cuda_probe():
    os.write(2, b"E0000 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n")
  assert "failed call to cuInit" in capfd.readouterr().err


_FIRST_STEP_SCRIPT = """
import os, sys
import numpy as np
import tensorflow as tf
from stderr_lines import DroppedLines
from training.callbacks import QuietNativeLines

class Native(tf.keras.callbacks.Callback):  # writes to descriptor 2 as TensorFlow's C++ core does
  def on_train_batch_begin(self, batch, logs=None):
    os.write(2, b"E0000 util.cc:131] oneDNN supports DT_HALF only on platforms with AVX-512. x\\n")
    os.write(2, b"W0000 batch %d real warning\\n" % batch)

  def on_test_batch_begin(self, batch, logs=None):
    os.write(2, b"E0000 util.cc:131] oneDNN supports DT_HALF only on platforms with AVX-512. x\\n")
    os.write(2, b"W0000 validation real warning\\n")

net = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
net.compile("sgd", "mse")
window = DroppedLines(["oneDNN supports DT_HALF"])
data = (np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32))
net.fit(*data, batch_size=2, epochs=1, verbose=0, validation_data=data, validation_batch_size=4,
        callbacks=[QuietNativeLines(window), Native()])
sys.stderr.write("fit done\\n")
try:
  with window:
    os.write(2, b"oneDNN supports DT_HALF\\n")
    raise RuntimeError
except RuntimeError:
  sys.stderr.write("after\\n")
"""


def test_one_off_lines_are_dropped_in_the_first_step_and_validation_only_and_the_rest_kept_in_order():
  result = subprocess.run([sys.executable, "-c", _FIRST_STEP_SCRIPT], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
  lines = [line for line in result.stderr.splitlines() if "real warning" in line or "DT_HALF" in line
           or line in ("fit done", "after")]
  assert lines == ["W0000 batch 0 real warning",   # the first step: its one-off line dropped
                   "E0000 util.cc:131] oneDNN supports DT_HALF only on platforms with AVX-512. x",
                   "W0000 batch 1 real warning", "W0000 validation real warning", "fit done", "after"]


_HANG_UP_IN_A_WINDOW = """
import os, sys
from stderr_lines import DroppedLines
master, terminal = os.openpty()
os.dup2(terminal, 2)  # stderr is a terminal
window = DroppedLines(["dropped"])
window.start()
os.write(2, b"kept line\\n")
os.close(master)  # the terminal hangs up, as a lost ssh connection does, while the window is open
window.stop()  # writing the kept line back would fail (EIO)
sys.stderr.write("after the window\\n")
sys.stdout.write("descriptor 2 is /dev/null: %s\\n" % (os.stat(2).st_rdev == os.stat(os.devnull).st_rdev))
"""


def test_a_terminal_that_hangs_up_during_a_window_gets_nothing_back_and_no_error():
  """SIGHUP's stop must not fail at the end of a validation pass, whose window wrote its lines back to a
  terminal that was gone (EIO, exit status 1 instead of 129 with a checkpoint)."""
  result = subprocess.run([sys.executable, "-c", _HANG_UP_IN_A_WINDOW], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  assert "descriptor 2 is /dev/null: True" in result.stdout


def test_the_rest_of_a_resumed_epoch_is_headed_with_the_runs_epoch_count(capsys):
  """A resumed run trains the rest of epoch 2 as a fit of its own: Keras' bar would say "Epoch 2/2"."""
  from training.callbacks import RunProgbar  # pylint: disable=import-outside-toplevel
  net = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
  net.compile(optimizer="sgd", loss="mse")
  data = tf.data.Dataset.from_tensors((tf.ones((4, 3)), tf.ones((4, 1)))).repeat()
  net.fit(data, epochs=2, initial_epoch=1, steps_per_epoch=2, callbacks=[RunProgbar(5)], verbose=1)
  net.fit(data, epochs=3, initial_epoch=2, steps_per_epoch=2, callbacks=[RunProgbar(5)], verbose=2)
  headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ")]
  assert headers == ["Epoch 2/5", "Epoch 3/5"]


def test_each_epoch_line_says_how_long_the_epochs_left_would_take(caplog):
  """At the pace of the epoch just ended (its wall time): a user on a slow CPU knows after epoch 1."""
  from training.callbacks import EpochLogger, ThroughputCallback
  from training.logs import duration  # pylint: disable=import-outside-toplevel
  assert [duration(s) for s in (42.4, 185, 7860)] == ["42 s", "3 min 5 s", "2 h 11 min"]
  logger = EpochLogger(epochs=3)
  with caplog.at_level(python_logging.INFO, logger="absl"):
    for epoch in range(3):
      logger.on_epoch_end(epoch, {"loss": 0.2, "epoch_seconds": 50.0, "epoch_wall_seconds": 52.5})
  lines = [record.getMessage() for record in caplog.records]
  assert lines[0].endswith("epochs"), lines
  assert_names(lines[0], "1 min 45 s left", "2 more epochs")
  assert lines[1].endswith("epoch"), lines
  assert_names(lines[1], "52 s left", "1 more epoch")
  assert "left" not in lines[2], lines
  # A resumed run's first epoch is the rest of one (the steps after the checkpoint, numbered from 0):
  # 100 of 400 steps in 13 s make whole epochs of 52 s.
  throughput = ThroughputCallback(samples_per_step=8, replicas=1)
  throughput.first_execution_seconds, throughput.first_execution_steps = 1.0, 1  # the first fit's
  throughput.on_epoch_begin(1)
  throughput.on_train_batch_end(99)
  resumed = EpochLogger(epochs=3, steps_per_epoch=400, throughput=throughput)
  with caplog.at_level(python_logging.INFO, logger="absl"):
    resumed.on_epoch_end(1, {"loss": 0.2, "epoch_seconds": 12.0, "epoch_wall_seconds": 13.0})
  assert_names(caplog.records[-1].getMessage(), "52 s left", "1 more epoch")


class _Stream:
  def __init__(self, tty):
    self.tty = tty

  def isatty(self):
    return self.tty


def test_progress_bar_on_a_terminal_and_one_line_per_epoch_in_a_file():
  """--progress=auto: Keras' bar redraws itself with backspaces in a file too (a Slurm job's output).
  Without the bar, Keras prints nothing while training (the EpochLogger's line is the epoch's) and
  one line for the test evaluation."""
  assert (logs.fit_verbosity("auto", True, _Stream(True)), logs.evaluate_verbosity("auto", True, _Stream(True))) == (1, 1)
  assert (logs.fit_verbosity("auto", True, _Stream(False)), logs.evaluate_verbosity("auto", True, _Stream(False))) == (0, 2)
  assert logs.shows_bar("bar", True, _Stream(False)) and not logs.shows_bar("epoch", True, _Stream(True))
  assert not logs.shows_bar("bar", False, _Stream(True))  # a worker's bar would interleave with the chief's


def test_the_epoch_line_names_every_loss_and_metric_and_the_bar_leaves_the_bookkeeping_to_it(caplog, capsys):
  from training.callbacks import BOOKKEEPING_KEYS, EpochLogger, RunProgbar  # pylint: disable=import-outside-toplevel
  epoch_logs = {"loss": 0.25, "mae": 0.5, "val_loss": 0.125, "val_mae": 0.375, "epoch_seconds": 30.0,
                "epoch_wall_seconds": 31.0, "samples_per_sec": 2000.0, "samples_per_sec_per_replica": 500.0,
                "samples_per_sec_with_compilation": 1000.0, "lr": 0.001}
  assert set(BOOKKEEPING_KEYS) < set(epoch_logs)
  with caplog.at_level(python_logging.INFO, logger="absl"):
    EpochLogger(epochs=3).on_epoch_end(0, dict(epoch_logs))
  line = caplog.records[-1].getMessage()
  for fragment in ("Epoch 1/3", "LR=0.001", "train=0.2500", "val=0.1250", "mae: train=0.5000", "val=0.3750",
                   "2000 samples/s (500 per replica)", "1 min 2 s left for 2 more epochs"):
    assert fragment in line, (fragment, line)
  bar = RunProgbar(3)
  bar.set_params({"verbose": 1, "epochs": 1, "steps": 4})
  bar.on_train_begin()
  bar.on_epoch_begin(0)
  bar.on_train_batch_end(3, {"loss": 0.25, "mae": 0.5})
  bar.on_epoch_end(0, dict(epoch_logs))
  shown = capsys.readouterr().out
  assert "val_mae: 0.3750" in shown and "Epoch 1/3" in shown
  assert not any(key in shown for key in BOOKKEEPING_KEYS), shown


class _Clock:
  """time.time for Keras' Progbar: 0.22 s a step, the pace of a float32 epoch on 2 cores."""
  now = 0.0

  @classmethod
  def time(cls):
    return cls.now


@pytest.mark.parametrize("columns", [80, 72, 200])
def test_the_bar_redraws_within_the_terminals_width_and_its_last_line_keeps_every_value(monkeypatch, capsys,
                                                                                        columns):
  """Keras redraws its line with a carriage return, which goes back to the start of the terminal's
  last row only: the default job's line, 81 columns while over a minute is left, scrolled a row per
  step in an 80-column terminal."""
  from training.callbacks import RunProgbar  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("COLUMNS", str(columns))
  monkeypatch.setattr(sys.modules[tf.keras.utils.Progbar.__module__], "time", _Clock)
  _Clock.now = 0.0
  bar = RunProgbar(3)
  bar.set_params({"verbose": 1, "epochs": 1, "steps": 341})
  bar.on_train_begin()
  bar.on_epoch_begin(0)
  for step in range(341):
    _Clock.now += 0.22
    bar.on_train_batch_end(step, {"loss": 0.2707 - step * 1e-4, "mae": 0.4332 - step * 1e-4})
  bar.on_epoch_end(0, {"loss": 0.2162, "mae": 0.3695, "val_loss": 0.1851, "val_mae": 0.3286})
  redraws = [part.strip("\b") for part in capsys.readouterr().out.split("\r")]
  drawn, last = [line for line in redraws if "ETA: " in line], redraws[-1]
  assert any("ETA: 1:" in line for line in drawn)   # over a minute left: the widest lines
  assert max(len(line) for line in drawn) <= columns - 1, drawn[0]
  bar_widths = [len(re.search(r"\[([=>.]*)\]", line).group(1)) for line in (last, drawn[0])]
  assert bar_widths == [min(30, columns - 1 - 7 - 15 - 16 - 15 - 3)] * 2
  assert last.endswith("val_mae: 0.3286\n") and last.startswith("341/341 ["), last
