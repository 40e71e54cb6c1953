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

from tests.support.cellspike_files import write_cellspike
from tests.support.training_parts import free_ports
from tests.support.helpers import REPO_ROOT, other_process_report
from training.checkpoints import read_index

TIMEOUT_SECONDS = 240


def _start_workers(data_path, logdir, count=2, steps=3, more=(), stderr_dir=None, eval_steps=1):
  """`count` workers on 127.0.0.1; their stderr goes to files in `stderr_dir` if given (to watch)."""
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
         "--backend=cpu", "--batch_size=16", "--epochs=2", "--steps_per_epoch=%d" % steps,
         "--eval_steps=%d" % eval_steps, "--data_path=" + data_path, "--logdir=" + logdir] + list(more),
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
  return processes


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


def test_two_workers_train_in_sync_on_disjoint_shards(tmp_path):
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 256, "val": 70, "test": 70})
  logdir = str(tmp_path / "run")
  outputs = _finish(_start_workers(data_path, logdir, eval_steps=0, more=["--precision=32.32"]))
  for process_output in outputs:
    assert "Traceback" not in process_output[1], process_output[1][-3000:]
  chief_log = outputs[0][1]
  assert "rank 0 of 2 (chief)" in chief_log and "rank 1 of 2" in outputs[1][1]
  summaries = [yaml.safe_load(open(os.path.join(logdir, "summary.yaml")))]
  worker_dir, worker_weights = other_process_report(outputs[1][1])
  # The other worker's folder is scratch: gone at its end, and nothing else of the run left in TMPDIR.
  assert not os.path.exists(worker_dir) and os.listdir(str(tmp_path / "tmp")) == []
  assert summaries[0]["world_size"] == 2 and summaries[0]["replicas"] == 2
  assert summaries[0]["global_batch_size"] == 32
  # Each optimizer step takes a batch from every worker: 3 steps of 32 samples per epoch, in all.
  assert "3 optimizer steps per epoch" in chief_log
  # Only the chief reports; its resume line says that every worker must be started again.
  assert "in each of the 2 processes, launched as before" in outputs[0][0]
  assert "Run finished" not in outputs[1][0]
  assert summaries[0]["steps_per_epoch"] == 3 and summaries[0]["train_samples_per_epoch"] == 96
  # Every test sample: 35 on each worker, 2 batches of 16 and a short one of 3. The loss is the mean
  # over all 70 of the saved weights, as the predict tool computes it on one device.
  assert summaries[0]["test_samples"] == 70
  predicted = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "predict.py"), "--logdir=" + logdir,
                              "--backend=cpu", "--noplots"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=TIMEOUT_SECONDS)
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  sum_pred = yaml.safe_load(open(os.path.join(logdir, "predict", "sum_pred.yaml")))
  assert sum_pred["num_samples"] == 70
  assert sum_pred["mse"] == pytest.approx(summaries[0]["test_loss"], rel=1e-5)
  # Identical weights after training: the all-reduce kept both replicas in step.
  assert summaries[0]["weights_sha256"] == worker_weights
  # Disjoint contiguous shards: worker 0 rows [0, 128), worker 1 rows [128, 256).
  assert summaries[0]["train_blocks"] == [[0, 128]]
  assert "(shards 0-0 of 2, 128 rows each)" in chief_log and "(shards 1-1 of 2, 128 rows each)" in outputs[1][1]
  assert os.path.isfile(os.path.join(logdir, "checkpoints", "last", "checkpoint"))
  assert not os.path.exists(os.path.join(logdir, "summary.yaml.tmp"))


def test_a_signal_to_one_worker_stops_both_after_the_same_step_and_the_run_resumes(tmp_path):
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 512, "val": 64, "test": 64})
  logdir, logs = str(tmp_path / "run"), str(tmp_path)
  processes = _start_workers(data_path, logdir, steps=16, stderr_dir=logs)
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
  outputs = _finish(_start_workers(data_path, logdir, steps=16, more=["--resume"]))
  for process_output in outputs:
    assert "Traceback" not in process_output[1], process_output[1][-3000:]
  assert "continuing with epoch 1 of 2 at step %d of 16" % (int(stops[0]) + 1) in outputs[0][1]
  summary = yaml.safe_load(open(os.path.join(logdir, "summary.yaml")))
  assert summary["world_size"] == 2 and summary["full_history"]["epoch"] == [1, 2]
  assert other_process_report(outputs[1][1])[1] == summary["weights_sha256"]
