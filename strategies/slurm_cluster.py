"""The worker cluster of a Slurm job step, as a tf.distribute cluster resolver.

TensorFlow's own `SlurmClusterResolver` was tried on a real Slurm (tests/e2e/test_slurm.py) and does not
fit a CPU run: without `nvidia-smi` it fails; with no GPUs its port/GPU pairing has a zero step
(`range(0, 0, 0)`), and any GPU count it is given becomes `num_accelerators`, which
MultiWorkerMirroredStrategy then uses to place replicas on GPUs. Its fixed port 8888 also collides when
two jobs share a node. So the cluster is built here from the job step's own variables:
- workers: `SLURM_STEP_NODELIST` expanded by `scontrol show hostnames` (Slurm's order, which is the
  order of its default block distribution of ranks), `SLURM_STEP_TASKS_PER_NODE` tasks on each;
- this process: worker `SLURM_PROCID`;
- ports: a base derived from the job id (`SLURM_JOB_ID`), one port per task on a node;
- GPUs: those Slurm bound to the task (`--gpus-per-task` sets `CUDA_VISIBLE_DEVICES`); without such a
  binding the node's GPUs are shared out by local rank (`SLURM_LOCALID`), as TensorFlow's resolver does.
The step variables (not the job's `SLURM_NTASKS`/`SLURM_NODELIST`) are read, so an `srun -n 2` inside
a bigger allocation sees its own two tasks (tensorflow#36094).
"""

import os
import re
import subprocess

import tensorflow as tf

from errors import UserError

_PORT_FIRST, _PORT_SLOTS, _PORTS_PER_JOB = 20000, 4000, 10


def _variable(name: str) -> str:
  value = os.environ.get(name)
  if not value:
    raise UserError("a Slurm job step must set %s (run the workers with srun)" % name)
  return value


def int_variable(name: str, default: str = None) -> int:
  """Slurm's variable `name` as a whole number (`default` when unset); anything else is a UserError."""
  value = os.environ.get(name) or default or _variable(name)
  if not value.strip().isdigit():
    raise UserError("%s=%r is not a whole number, as Slurm sets it (unset it outside a Slurm job step)"
                    % (name, value))
  return int(value)


def tasks_per_node(value: str) -> list:
  """Expands Slurm's compressed counts: "2(x3),1" -> [2, 2, 2, 1]."""
  counts = []
  for part in value.split(","):
    match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
    if not match:
      raise UserError("SLURM_STEP_TASKS_PER_NODE=%r is not in Slurm's format (e.g. 2(x3),1)" % value)
    counts += [int(match.group(1))] * int(match.group(2) or 1)
  return counts


def hostnames(nodelist: str) -> list:
  """Slurm's node list expanded by Slurm itself (`scontrol show hostnames`)."""
  try:
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                            check=True, timeout=60)
  except (OSError, subprocess.SubprocessError) as error:
    raise UserError("cannot expand SLURM_STEP_NODELIST=%r with scontrol (%s)" % (nodelist, error)) from None
  return result.stdout.split()


def port_base(job_id: int) -> int:
  """First port of this job's workers on a node; jobs sharing a node get different ranges."""
  return _PORT_FIRST + (job_id % _PORT_SLOTS) * _PORTS_PER_JOB


def worker_addresses(hosts: list, counts: list, base: int) -> list:
  if len(hosts) != len(counts):
    raise UserError("SLURM_STEP_NODELIST names %d node(s) but SLURM_STEP_TASKS_PER_NODE counts %d"
                    % (len(hosts), len(counts)))
  if max(counts) > _PORTS_PER_JOB:
    raise UserError("%d tasks on one node; at most %d are supported (one port each)"
                    % (max(counts), _PORTS_PER_JOB))
  return ["%s:%d" % (host, base + slot) for host, count in zip(hosts, counts) for slot in range(count)]


def _bind_gpus(tasks_here: int) -> int:
  """GPUs this task uses; shares the node's GPUs by local rank when Slurm bound none."""
  if "CUDA_VISIBLE_DEVICES" in os.environ:  # Slurm's --gpus-per-task/--gres binding, or the user's
    return len([d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
  total = len(tf.config.list_physical_devices("GPU"))
  share = total // tasks_here
  if share == 0:
    raise UserError("%d task(s) on this node but %d GPU(s): ask Slurm for one GPU per task "
                    "(--gpus-per-task=1)" % (tasks_here, total))
  local = int_variable("SLURM_LOCALID", "0")
  os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(local * share + i) for i in range(share))
  return share


def resolver(device_type: str):
  """A SimpleClusterResolver for this job step's workers; local devices of TensorFlow's `device_type`
  ("CPU" or "GPU")."""
  rank, base = int_variable("SLURM_PROCID"), port_base(int_variable("SLURM_JOB_ID"))
  nodelist = _variable("SLURM_STEP_NODELIST")
  counts = tasks_per_node(_variable("SLURM_STEP_TASKS_PER_NODE"))
  workers = worker_addresses(hostnames(nodelist), counts, base)
  if len(workers) != int_variable("SLURM_STEP_NUM_TASKS"):
    raise UserError("SLURM_STEP_TASKS_PER_NODE adds up to %d tasks but SLURM_STEP_NUM_TASKS is %s"
                    % (len(workers), os.environ["SLURM_STEP_NUM_TASKS"]))
  if not 0 <= rank < len(workers):
    raise UserError("SLURM_PROCID=%d is outside the step's %d tasks" % (rank, len(workers)))
  tasks_here = next(count for i, count in enumerate(counts) if sum(counts[:i + 1]) > rank)
  accelerators = {"GPU": _bind_gpus(tasks_here)} if device_type == "GPU" else {}
  return tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": workers}), task_type="worker", task_id=rank,
      num_accelerators=accelerators, rpc_layer="grpc")
