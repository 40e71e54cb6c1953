"""Two real worker processes on 127.0.0.1 (TF_CONFIG) train neuron_inverter together, and stop together."""

import json
import os
import re
import subprocess
import signal
import sys
import time

import pytest
import yaml

from analysis.events import read_hparams
from tests.support.cellspike_files import write_cellspike
from tests.support.training_parts import free_ports
from tests.support.helpers import REPO_ROOT, assert_names, line_naming, other_process_report
from training.checkpoints import read_index

TIMEOUT_SECONDS = 240


def _start_workers(data_path, logdir, count=2, more=(), stderr_dir=None):
  """`count` workers on 127.0.0.1, 2 epochs of 16 steps, every validation and test sample evaluated
  (--eval_steps=0) in float32 whatever the CPU (for the predict tool's check); their stderr goes to
  files in `stderr_dir` if given (to watch)."""
  cluster = {"worker": ["127.0.0.1:%d" % port for port in free_ports(count)]}
  scratch = os.path.join(os.path.dirname(logdir), "tmp")  # the workers' TMPDIR, to be left empty
  os.makedirs(scratch, exist_ok=True)
  processes = []
  for index in range(count):
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker",
                                                                               "index": index}}),
               TMPDIR=scratch)
    env.pop("TF_USE_LEGACY_KERAS", None)
    stderr = open(os.path.join(stderr_dir, "worker%d.log" % index), "w") if stderr_dir else subprocess.PIPE
    processes.append(subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter", "--design=dev",
         "--backend=cpu", "--batch_size=16", "--epochs=2", "--steps_per_epoch=16", "--eval_steps=0",
         "--precision=32.32", "--data_path=" + data_path, "--logdir=" + logdir] + list(more),
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
  return processes


def _run_config(logdir):
  with open(os.path.join(logdir, "run_config.yaml")) as f:
    return yaml.safe_load(f)


def _wait_for_line(path, text, processes, timeout=TIMEOUT_SECONDS):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if text in open(path).read():
      return
    assert all(p.poll() is None for p in processes), open(path).read()[-3000:]
    time.sleep(0.2)
  raise AssertionError("%r not in %s within %d s" % (text, path, timeout))


def _finish(processes):
  """Waits for all workers within the time limit; kills every one of them whatever happens."""
  outputs = []
  try:
    for process in processes:
      outputs.append(process.communicate(timeout=TIMEOUT_SECONDS))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.communicate()
  return outputs


def test_a_signal_to_one_worker_stops_both_after_the_same_step_and_the_run_resumes_in_sync(tmp_path):
  """SIGTERM to the non-chief worker stops both after the same step, with one checkpoint of the run; the
  two workers started again with --resume train the rest on disjoint shards, in step, and every test
  sample is evaluated once. Started without --replicas, the run records the cluster's 2 replicas as its
  own setting, and its resume (its flags as typed, again without) accepts that. (An uninterrupted
  multi-worker fit of many epochs: test_loop_faults.py.)"""
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 512, "val": 70, "test": 70})
  logdir, logs = str(tmp_path / "run"), str(tmp_path)
  processes = _start_workers(data_path, logdir, stderr_dir=logs)
  _wait_for_line(os.path.join(logs, "worker1.log"), "Compilation and first step done", processes)
  processes[1].send_signal(signal.SIGTERM)  # worker 1 only; worker 0 learns of it through the collective
  _finish(processes)
  stops = []
  for index, process in enumerate(processes):
    log = open(os.path.join(logs, "worker%d.log" % index)).read()
    assert process.returncode == 128 + signal.SIGTERM, log[-3000:]
    stop = re.search(r"Training interrupted by SIGTERM in epoch 1 after step (\d+) of 16; checkpoint: (\S+);",
                     log)
    stops.append(stop.group(1))
    # Both lines name the run's checkpoint, not worker 1's scratch copy, which is gone by now.
    assert stop.group(2) == os.path.join(logdir, "checkpoints", "last", "ckpt-0-step" + stops[0])
  assert stops[0] == stops[1], stops  # the same step on both
  assert read_index(os.path.join(logdir, "checkpoints", "last"))[-1] == "ckpt-0-step" + stops[0]
  assert _run_config(logdir)["replicas"] == 2  # written at the start, before the resume reads it

  outputs = _finish(_start_workers(data_path, logdir, more=["--resume"]))
  for process_output in outputs:
    assert "Traceback" not in process_output[1], process_output[1][-3000:]
  chief_log = outputs[0][1]
  assert_names(line_naming(chief_log, "continuing with"), "epoch 1 of 2", "at step %d of 16" % (int(stops[0]) + 1))
  assert "rank 0 of 2 (chief)" in chief_log and "rank 1 of 2" in outputs[1][1]
  summary = yaml.safe_load(open(os.path.join(logdir, "summary.yaml")))
  assert (summary["world_size"], summary["replicas"], summary["replicas_per_process"]) == (2, 2, 1)
  assert summary["history"]["epoch"] == [1, 2]
  # The setting, where the settings are recorded: run_config.yaml, TensorBoard's HParams row, params.
  assert _run_config(logdir)["replicas"] == read_hparams(logdir)[1]["replicas"] == summary["params"]["replicas"] == 2
  assert summary["global_batch_size"] == 32
  worker_dir, worker_weights = other_process_report(outputs[1][1])
  # Identical weights after training: the all-reduce kept both replicas in step.
  assert worker_weights == summary["weights_sha256"]
  # The other worker's folder is scratch: gone at its end, and nothing else of the run left in TMPDIR.
  assert not os.path.exists(worker_dir) and os.listdir(str(tmp_path / "tmp")) == []
  # Each optimizer step takes a batch from every worker: 16 steps of 32 samples per epoch, in all.
  assert_names(line_naming(chief_log, "Global batch "), "; 16 optimizer steps", "per epoch")
  assert summary["steps_per_epoch"] == 16 and summary["train_samples_per_epoch"] == 512
  # Only the chief reports; its resume line says that every worker must be started again.
  assert_names(line_naming(outputs[0][0], "launched as before"), "each of the 2 processes")
  assert "Run finished" not in outputs[1][0]
  # Disjoint contiguous shards: worker 0 rows [0, 256), worker 1 rows [256, 512).
  assert summary["train_blocks"] == [[0, 256]]
  for shard, log in enumerate([chief_log, outputs[1][1]]):
    lines = [line for line in log.splitlines() if "(shards %d-%d of 2, " % (shard, shard) in line]
    assert any("256 rows each)" in line for line in lines), lines
  # Every test sample: 35 on each worker, 2 batches of 16 and a short one of 3. The loss is the mean
  # over all 70 of the saved weights, as the predict tool computes it on one device.
  assert summary["test_samples"] == 70
  predicted = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "predict.py"), "--logdir=" + logdir,
                              "--backend=cpu", "--noplots"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=TIMEOUT_SECONDS)
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  sum_pred = yaml.safe_load(open(os.path.join(logdir, "predict", "sum_pred.yaml")))
  assert sum_pred["num_samples"] == 70
  assert sum_pred["mse"] == pytest.approx(summary["test_loss"], rel=1e-5)
  assert os.path.isfile(os.path.join(logdir, "checkpoints", "last", "checkpoint"))
  assert not os.path.exists(os.path.join(logdir, "summary.yaml.tmp"))
