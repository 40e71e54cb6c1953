"""What /proc/cpuinfo says about the host processor, and how many of its cores this process may use,
read without TensorFlow.

Without TensorFlow because its import is itself what fails on a CPU it was not built for: the x86-64
TensorFlow wheels (PyPI's since TF 1.6, the Poplar SDK's for their host CPUs) use AVX instructions
throughout, and TensorFlow's start-up check (`cpu_feature_guard.cc`) ends the process with SIGABRT
when the CPU lacks them. Virtual machines show this more often than old hardware: a hypervisor's
generic CPU models (QEMU's `qemu64` and `kvm64`) offer no AVX even on a host that has it.
"""

import math
import os
from typing import Optional


def first_processor() -> dict:
  """The fields of the first processor's block of /proc/cpuinfo (empty where there is none: not
  Linux), e.g. {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu ... avx512f ..."}."""
  fields = {}
  try:
    with open("/proc/cpuinfo") as cpuinfo:
      for line in cpuinfo:
        if not line.strip():
          break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
  except OSError:
    pass
  return fields


def generation() -> tuple:
  """(vendor_id, cpu family) of /proc/cpuinfo, e.g. ("AuthenticAMD", 23) for Zen 1 and 2; ("", 0)
  where there is none."""
  fields = first_processor()
  family = fields.get("cpu family", "0")
  return fields.get("vendor_id", ""), int(family) if family.isdigit() else 0


def tensorflow_unsupported_reason(fields: Optional[dict] = None) -> Optional[str]:
  """Why TensorFlow cannot start on this CPU (one line), or None. Only x86 processors list `flags`;
  elsewhere (ARM lists `Features`) nothing is known and nothing is refused."""
  fields = first_processor() if fields is None else fields
  flags = fields.get("flags")
  if flags is None or "avx" in flags.split():
    return None
  return ("this CPU (%s) lacks AVX, which TensorFlow's x86 builds need: importing TensorFlow would "
          "abort the process. On a virtual machine, give the guest the host's CPU model (QEMU/KVM: "
          "-cpu host; libvirt: host-passthrough)" % fields.get("model name", "model unknown"))


def usable_cores(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int:
  """The cores this process can keep busy: its CPU affinity (a Slurm allocation's cpuset, taskset),
  capped by a CPU quota on its cgroup (`docker --cpus`, Kubernetes CPU limits, systemd's CPUQuota).
  A quota leaves every core visible but throttles the process once its threads use more than their
  share, so thread pools and worker processes sized by the visible cores would take turns."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
  quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
  return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"):
  """The CPU quota of this process's cgroup and its ancestors, in cores (the smallest one set), or
  None: no quota, or no cgroup file system to read (not Linux)."""
  quotas = []
  try:
    with open(proc_cgroup) as lines:
      entries = [line.rstrip("\n").split(":", 2) for line in lines if line.count(":") >= 2]
  except OSError:
    return None
  for _, controllers, path in entries:
    if controllers == "":  # cgroup v2: cpu.max holds "QUOTA PERIOD" or "max PERIOD"
      quotas += [_ratio(*text.split()[:2]) for text in _along(cgroup_root, path, "cpu.max")]
    elif "cpu" in controllers.split(","):  # cgroup v1: cpu.cfs_quota_us is -1 without a quota
      # mounted as "cpu,cpuacct" (with a "cpu" link to it) or as "cpu"
      folder = os.path.join(cgroup_root, controllers)
      folder = folder if os.path.isdir(folder) else os.path.join(cgroup_root, "cpu")
      quotas += [_ratio(quota, period) for quota, period in zip(_along(folder, path, "cpu.cfs_quota_us"),
                                                                _along(folder, path, "cpu.cfs_period_us"))]
  quotas = [quota for quota in quotas if quota]
  return min(quotas) if quotas else None


def _along(root: str, path: str, name: str) -> list:
  """The contents of file `name` in the cgroup folder `path` under `root` and in each of its ancestors
  up to `root` (a container usually sees its own cgroup as the root)."""
  texts, parts = [], [part for part in path.split("/") if part]
  for depth in range(len(parts), -1, -1):
    try:
      with open(os.path.join(root, *parts[:depth], name)) as source:
        texts.append(source.read().strip())
    except OSError:
      continue
  return texts


def _ratio(quota: str, period: str) -> Optional[float]:
  try:
    quota_us, period_us = int(quota), int(period)
  except ValueError:  # "max": no quota
    return None
  return quota_us / period_us if quota_us > 0 and period_us > 0 else None


# The most replicas a CPU run may have. Each is a logical CPU device whose copy of the training step is
# traced on its own (64 replicas took a minute to set up on 2 cores, 256 four minutes and 2 GB), and
# with as many replicas as cores or more each gets an inter-op thread (strategies/cpu.py): 10,000
# replicas made 10,000 threads, 20 s to start, during which no signal handler can run, and 2 minutes
# to end. 256 stands in for any data-parallel system a command is tried out for on a CPU.
MAX_CPU_REPLICAS = 256


def cpu_replicas_problem(replicas: int) -> Optional[str]:
  """Why a CPU run cannot have `replicas` replicas (one line), or None."""
  if replicas <= MAX_CPU_REPLICAS:
    return None
  return ("--replicas=%d is more than the %d a CPU run may have: each replica is a logical CPU device, "
          "traced into the training step on its own and given a thread (256 already take minutes to set "
          "up); use at most --replicas=%d on the CPU" % (replicas, MAX_CPU_REPLICAS, MAX_CPU_REPLICAS))
