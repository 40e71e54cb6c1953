"""Graceful stops (training/interrupt.py): the signal flag, and the exact batches a resumed epoch trains.

The same through real processes, killed and signalled mid-run, is in tests/e2e/test_loop_faults.py.
"""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import tensorflow as tf

import errors
import stop_signals
from run_config import RunConfig
from tests.support.cellspike_files import write_row_marked
from tests.support.helpers import REPO_ROOT, assert_names
from training import interrupt as interrupt_lib
from training import loop


def test_interrupt_flag_records_the_signal_and_restores_the_handlers(capfd):
  previous = signal.getsignal(signal.SIGINT)
  with stop_signals.InterruptFlag() as flag:
    os.kill(os.getpid(), signal.SIGINT)   # no KeyboardInterrupt: the handler only records it
    time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)
    assert flag.requested and flag.signum == signal.SIGINT
  assert signal.getsignal(signal.SIGINT) is previous
  lines = [line for line in capfd.readouterr().err.splitlines() if line]  # each on a line of its own
  assert lines[0].startswith("SIGINT received: "), lines
  assert_names(lines[0], "stopping after the", "current training step")
  assert lines[1].startswith("SIGINT received again: "), lines
  assert_names(lines[1], "still stopping")
  stop = interrupt_lib.TrainingInterrupted(signal.SIGINT, "/x/ckpt-1-step3", "in epoch 2 after step 3 of 8")
  assert isinstance(stop, SystemExit) and stop.code == 130 and stop.signal_name == "SIGINT"


def test_interrupt_flag_ignores_more_signals_while_the_process_exits_on_one():
  """Leaving on the stop's SystemExit, more signals are ignored (never the default action, which
  would turn exit status 143 into "killed by SIGTERM" during the rest of the exit)."""
  previous = {signum: signal.getsignal(signum) for signum in stop_signals.STOP_SIGNALS}
  try:
    with pytest.raises(interrupt_lib.TrainingInterrupted):
      with stop_signals.InterruptFlag() as flag:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert flag.requested
        raise interrupt_lib.TrainingInterrupted(flag.signum, "/x/ckpt-1-step3", "in epoch 2")
    assert all(signal.getsignal(signum) == signal.SIG_IGN for signum in stop_signals.STOP_SIGNALS)
    os.kill(os.getpid(), signal.SIGTERM)  # ignored: this process lives on
    time.sleep(0.01)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


@pytest.mark.parametrize("signum, line", [(signal.SIGTERM, "SIGTERM"),
                                          (signal.SIGHUP, "SIGHUP (the terminal closed)")])
def test_sigterm_or_sighup_outside_training_unwinds_and_exits_on_one_line(tmp_path, signum, line):
  """What main.py and the tools run in: SIGTERM where training's flag is not installed unwinds the
  program as Ctrl-C does (its `finally` blocks remove what it was writing), one line, status 143; and
  so does SIGHUP, with status 129, where its default action ended the process on the spot."""
  marker = tmp_path / "unwound"
  code = ("import os, signal, sys, time; sys.path.insert(0, %r); from errors import reported_on_one_line\n"
          "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
          "with reported_on_one_line():\n"
          "  try:\n"
          "    os.kill(os.getpid(), %d); time.sleep(30)\n"
          "  finally:\n"
          "    open(%r, 'w').close()\n" % (REPO_ROOT, signum, str(marker)))
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert (result.returncode, result.stderr) == (128 + signum, "\ninterrupted by %s\n" % line)
  assert marker.exists()


def test_the_flags_line_says_what_a_signal_does_in_each_phase(capfd):
  flag = stop_signals.InterruptFlag()
  flag.phase = "test"
  with flag:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)
  stop = interrupt_lib.StopTestOnSignal(flag, "/x/ckpt-2")
  with pytest.raises(interrupt_lib.TrainingInterrupted) as error:
    stop.on_test_batch_end(2)
  assert (error.value.code, error.value.checkpoint) == (130, "/x/ckpt-2")
  assert_names(error.value.where, "during the test", "(after batch 3)")
  line = capfd.readouterr().err.strip()
  assert line.startswith("SIGINT received: "), line
  assert_names(line, "stopping the test", "checkpoints are saved", "--resume evaluates")
  interrupt_lib.StopTestOnSignal(stop_signals.InterruptFlag(), "/x/ckpt-2").on_test_batch_end(0)  # none


def test_ctrl_c_while_a_program_imports_is_one_line():
  """Before reported_on_one_line takes over (main.py's and the tools' imports take a second or two)."""
  code = ("import sys; sys.path.insert(0, %r); import errors; errors.report_missing_packages()\n"
          "raise KeyboardInterrupt\n" % REPO_ROOT)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert result.stderr.startswith("\n") and result.stderr.count("\n") == 2, result.stderr  # one line of its own
  assert_names(result.stderr, "interrupted by SIGINT", "SIGINT (Ctrl-C)")
  assert result.returncode in (-signal.SIGINT, 128 + signal.SIGINT)  # Python ends itself by SIGINT


def test_a_finished_program_ignores_signals_while_it_exits():
  """main.py, tools/predict.py and tools/generate_cellspike.py after their last output: Python's own
  handler would be reset to the default action in its shutdown, SIG_IGN is kept."""
  code = ("import os, signal, sys; sys.path.insert(0, %r); import errors, stop_signals\n"
          "with errors.reported_on_one_line():\n"
          "  stop_signals.ignore_stops_while_exiting()\n"
          "import atexit; atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))\n"
          "os.kill(os.getpid(), signal.SIGINT); print('finished')\n" % REPO_ROOT)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert (result.returncode, result.stdout, result.stderr) == (0, "finished\n", "")


@pytest.mark.parametrize("error, status, stderr", [
    # TensorFlow 2.6's nest.flatten when Ctrl-C reached it: a bare TypeError, no cause, a stop pending.
    ("TypeError()", 128 + signal.SIGINT, "\ninterrupted by SIGINT (Ctrl-C)\n"),
    # No stop pending: an error is an error.
    (None, 1, "ValueError: a bug"),
])
def test_an_error_that_a_pending_stop_became_in_c_code_is_the_stop(error, status, stderr):
  code = ("import os, signal, sys; sys.path.insert(0, %r); import errors\n"
          "with errors.reported_on_one_line():\n" % REPO_ROOT)
  if error:
    code += ("  try:\n    os.kill(os.getpid(), signal.SIGINT)\n  except KeyboardInterrupt:\n"
             "    raise %s from None\n" % error)
  else:
    code += "  raise ValueError('a bug')\n"
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert result.returncode == status and stderr in result.stderr, result.stderr
  assert ("Traceback" in result.stderr) == (error is None)


def test_reported_on_one_line_restores_the_sigterm_handler():
  previous = signal.getsignal(signal.SIGTERM)
  with errors.reported_on_one_line():
    assert signal.getsignal(signal.SIGTERM) is not previous
  assert signal.getsignal(signal.SIGTERM) is previous


class _RowRecorder(tf.keras.Model):
  """Records the row ids (frames[:, 0, 0]) of every training batch Keras feeds it."""

  def __init__(self):
    super().__init__()
    self.dense = tf.keras.layers.Dense(3)
    self.rows = []

  def call(self, inputs):  # pylint: disable=arguments-differ
    return self.dense(tf.reshape(inputs, (-1, 64)))

  def train_step(self, data):
    self.rows.append(data[0].numpy()[:, 0, 0].astype(int).tolist())
    return {"loss": 0.0}


def test_resumed_epoch_skips_exactly_the_trained_batches(tmp_path):
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from data.splits import BatchLayout  # pylint: disable=import-outside-toplevel
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  config = RunConfig(model="neuron_inverter", data_path=path, batch_size=4, read_chunk=8,
                     shuffle_buffer=16, seed=1)

  backend = types.SimpleNamespace(fit_input=lambda dataset, steps: (dataset, steps), is_chief=False,
                                  device_errors=contextlib.nullcontext)

  def batches(first_epoch, first_step):
    splits = dataclasses.replace(cellspike.load(config, BatchLayout(1, 4), first_epoch), validation=None)
    net = _RowRecorder()
    net.compile(optimizer="sgd", run_eagerly=True)
    loop._fit(net, dataclasses.replace(config, epochs=3), backend, splits, first_epoch, first_step, [])
    return net.rows

  uninterrupted = batches(0, 0)
  assert len(uninterrupted) == 3 * 16
  assert batches(1, 5) == uninterrupted[16 + 5:]


def test_a_resumed_mnist_epoch_reads_exactly_the_batches_of_an_uninterrupted_run():
  """MNIST's arrays (data.splits.split_from_arrays): each pass is ordered by (seed, pass), not by how
  many passes the process has read, so a resume mid-epoch continues the same order (it restarted at
  the first pass's order, and retrained its batches)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from data.splits import Arrays, BatchLayout, split_from_arrays  # pylint: disable=import-outside-toplevel
  rows = np.arange(64, dtype=np.int32)
  split = split_from_arrays(Arrays(rows, rows), BatchLayout(1, 4), lambda x, y: (x, y), True, 7, 0, "train")

  def batches(first_epoch, skip, count):
    return [x.tolist() for x, _ in split.epochs_from(first_epoch, skip).take(count).as_numpy_iterator()]

  uninterrupted = batches(0, 0, 3 * 16)
  assert batches(1, 5, 2 * 16 - 5) == uninterrupted[16 + 5:]
  passes = [sorted(sum(uninterrupted[16 * k:16 * (k + 1)], [])) for k in range(3)]
  assert passes == [rows.tolist()] * 3                                    # every pass is a permutation
  assert uninterrupted[:16] != uninterrupted[16:32] != uninterrupted[32:]  # a new order every pass
  assert [x.tolist() for x, _ in split.dataset.as_numpy_iterator()] == uninterrupted[:16]


def test_a_mid_epoch_stop_saves_the_metric_objects_not_the_batch_logs():
  """Keras sums a multi-worker run's batch logs over its replicas (twice the loss with two workers);
  the checkpoint keeps the metrics' own running values, as Keras reports them at an epoch's end."""
  class Model:
    def get_metrics_result(self):
      return {"loss": tf.constant(0.25), "mae": tf.constant(0.5)}

  saved = {}

  class Checkpointing:
    def save_interrupted(self, epoch, steps, metrics):
      saved.update(metrics)
      return "/x/ckpt-0-step3"
  flag = stop_signals.InterruptFlag()
  flag.signum = signal.SIGTERM
  stop = interrupt_lib.GracefulStop(flag, Checkpointing(), steps_per_epoch=10, total_epochs=2)
  stop.set_model(Model())
  with pytest.raises(interrupt_lib.TrainingInterrupted):
    stop.on_train_batch_end(2, {"loss": 0.5, "mae": 1.0})  # the summed logs of two workers
  assert saved == {"loss": 0.25, "mae": 0.5}
