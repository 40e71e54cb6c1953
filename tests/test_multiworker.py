"""Two real worker processes on 127.0.0.1 (TF_CONFIG) train neuron_inverter together."""

import json
import os
import re
import socket
import subprocess
import sys

import yaml

from tests.cellspike_files import write_cellspike
from tests.helpers import REPO_ROOT

TIMEOUT_SECONDS = 240


def _free_ports(count):
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def _start_workers(data_path, logdir, count=2):
  cluster = {"worker": ["127.0.0.1:%d" % port for port in _free_ports(count)]}
  processes = []
  for index in range(count):
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker",
                                                                               "index": index}}))
    env.pop("TF_USE_LEGACY_KERAS", None)
    processes.append(subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter", "--design=dev",
         "--backend=cpu", "--batch_size=16", "--epochs=2", "--steps_per_epoch=3", "--eval_steps=1",
         "--data_path=" + data_path, "--logdir=" + logdir],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  return processes


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
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 256, "val": 64, "test": 64})
  logdir = str(tmp_path / "run")
  outputs = _finish(_start_workers(data_path, logdir))
  for process_output in outputs:
    assert "Traceback" not in process_output[1], process_output[1][-3000:]
  chief_log = outputs[0][1]
  assert "rank 0 of 2 (chief)" in chief_log and "rank 1 of 2" in outputs[1][1]
  worker_dir = re.search(r"Process 1 writes its events and checkpoints to (\S+)", outputs[1][1]).group(1)
  summaries = [yaml.safe_load(open(os.path.join(d, "summary.yaml"))) for d in (logdir, worker_dir)]
  assert summaries[0]["world_size"] == 2 and summaries[0]["replicas"] == 2
  assert summaries[0]["global_batch_size"] == 32
  # Identical weights after training: the all-reduce kept both replicas in step.
  assert summaries[0]["weights_sha256"] == summaries[1]["weights_sha256"]
  # Disjoint contiguous shards: worker 0 rows [0, 128), worker 1 rows [128, 256).
  assert summaries[0]["train_blocks"] == [[0, 128]] and summaries[1]["train_blocks"] == [[128, 256]]
  assert os.path.isfile(os.path.join(logdir, "checkpoints", "last", "checkpoint"))
  assert not os.path.exists(os.path.join(logdir, "summary.yaml.tmp"))
