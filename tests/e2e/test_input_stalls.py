"""The main job never waits on its input pipeline: not between epochs, not when it is stopped.

A `from_generator` pipeline would not do: destroying an iterator blocked on a Python generator
thread hangs, so a SIGTERM'd 4-replica run would save its checkpoint and then hang, and ordinary runs
would idle between epochs (data/hdf5_native.py says why the reader is native). These run the real
`main.py` with 4 replicas on a streaming fp16 file.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import REPO_ROOT, assert_names, line_naming

ARGS = ("--model=neuron_inverter", "--backend=cpu", "--replicas=4", "--batch_size=8", "--warmup_epochs=1",
        "--precision=32.32", "--seed=5")


@pytest.fixture(scope="module")
def fp16_file(tmp_path_factory):
  return write_cellspike(str(tmp_path_factory.mktemp("data") / "stalls.h5"),
                         sizes={"train": 1024, "val": 128, "test": 64}, dtype=np.float16)


def _start(data_file, logdir, *extra):
  env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  env["PYTHONUNBUFFERED"] = "1"
  log = open(logdir + ".log", "w")
  process = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "main.py"), *ARGS,
                              "--data_path=" + data_file, "--logdir=" + logdir, *extra],
                             cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
  return process, log


def _output(logdir):
  with open(logdir + ".log") as f:
    return f.read()


def _wait_for(process, logdir, text, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if text in _output(logdir):
      return
    assert process.poll() is None, _output(logdir)[-3000:]
    time.sleep(0.05)
  raise AssertionError("no %r within %d s:\n%s" % (text, timeout, _output(logdir)[-3000:]))


def test_sigterm_in_epoch_two_with_four_replicas_exits_within_seconds(tmp_path, fp16_file):
  """ontra4, 4 replicas, streaming: the signal in epoch 2 gives a checkpoint and exit 143, promptly."""
  logdir = str(tmp_path / "run")
  process, log = _start(fp16_file, logdir, "--design=ontra4", "--epochs=3")
  try:
    _wait_for(process, logdir, "Epoch 1/3 took", timeout=240)
    time.sleep(1.0)   # well inside epoch 2 (32 steps of a 3M-parameter network on 4 replicas)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=150)
    seconds = time.monotonic() - signalled
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
    log.close()
  output = _output(logdir)
  assert status == 143, output[-3000:]
  assert_names(line_naming(output, "Training interrupted "), "by SIGTERM in epoch 2")
  # A stop takes about a second (docs/performance.md, "Input pipeline"); the bound catches a hang.
  assert seconds < 120, "took %.1f s from the signal to the exit" % seconds
  assert any(name.startswith("ckpt-2-step") or name.startswith("ckpt-1")
             for name in os.listdir(os.path.join(logdir, "checkpoints", "last")))


def test_epochs_follow_each_other_without_idle_time(tmp_path, fp16_file):
  """Wall time from one epoch's end to the next stays close to the epoch's own time (4 replicas)."""
  logdir = str(tmp_path / "run")
  process, log = _start(fp16_file, logdir, "--design=dev", "--epochs=5")
  try:
    status = process.wait(timeout=300)
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
    log.close()
  assert status == 0, _output(logdir)[-3000:]
  with open(os.path.join(logdir, "summary.yaml")) as f:
    summary = yaml.safe_load(f)
  history = summary["history"]
  assert "wall" in _output(logdir)
  # Epoch 1 carries the compilation; after it, the wall time between epoch ends (validation and the
  # checkpoint included) stays within a small factor of the training time itself.
  ratios = [wall / train for wall, train in zip(history["epoch_wall_seconds"][1:],
                                                history["epoch_seconds"][1:])]
  assert max(ratios) < 2.0, list(zip(history["epoch_wall_seconds"], history["epoch_seconds"]))
  # The end of the fit: the data iterators are torn down before fit returns. An autotuned per-device
  # pipeline of tf.distribute made that wait up to a minute (strategies/device_pipelines.py). Fit's
  # own set-up and teardown take about 2 s on a slow 2-core VM with TF 2.6: the bound leaves room.
  epochs_wall = sum(history["epoch_wall_seconds"])
  assert summary["fit_seconds"] - epochs_wall < max(5.0, 0.5 * epochs_wall / len(ratios)), (
      summary["fit_seconds"], history["epoch_wall_seconds"])
