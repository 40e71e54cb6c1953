"""A real CPU quota on a real cgroup (as root, as CI runs): the cores the application sizes its thread
pools and simulation workers by are the quota's, not the visible ones."""

import os
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT

PRINT_CORES = "import sys; sys.path.insert(0, %r); from host import cpuinfo; print(cpuinfo.usable_cores())"


def _fresh_cgroup(name: str, limited: bool):
  """The folder of a fresh cgroup at the root of the CPU hierarchy, limited to half a core or, if not
  `limited`, without a quota (v1's cpu controller, else v2's cpu.max), or None where this process may
  not make one. The caller removes it."""
  candidates = [("/sys/fs/cgroup/cpu", "cpu.cfs_quota_us", "50000", "-1"),
                ("/sys/fs/cgroup/cpu,cpuacct", "cpu.cfs_quota_us", "50000", "-1"),
                ("/sys/fs/cgroup", "cpu.max", "50000 100000", "max 100000")]
  for root, quota_file, half, unlimited in candidates:
    if not os.path.isdir(root) or not os.access(root, os.W_OK):
      continue
    folder = os.path.join(root, name)
    try:
      os.mkdir(folder)
    except OSError:
      continue
    try:
      with open(os.path.join(folder, quota_file), "w") as target:
        target.write(half if limited else unlimited)
      return folder
    except OSError:
      os.rmdir(folder)
  return None


def _cores_in(folder: str) -> subprocess.CompletedProcess:
  return subprocess.run(["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec "$2" -c "$3"', "sh", folder,
                         sys.executable, PRINT_CORES % REPO_ROOT], capture_output=True, text=True, timeout=120)


def test_usable_cores_follow_a_real_cgroup_quota():
  """Both processes run in sibling cgroups of their own, so that a quota on the suite's cgroup (a
  container's --cpus, a CPU-limited test run) changes neither's answer."""
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("one visible core: a half-core quota would change nothing to see")
  folders = [_fresh_cgroup("neuron-inverter-test-%d-%s" % (os.getpid(), kind), kind == "half")
             for kind in ("half", "unlimited")]
  try:
    if None in folders:
      pytest.skip("cannot create a cgroup with a CPU quota here (needs root and a writable cgroup tree)")
    inside, outside = (_cores_in(folder) for folder in folders)
  finally:
    for folder in folders:
      if folder:
        os.rmdir(folder)
  assert inside.returncode == 0 and outside.returncode == 0, inside.stderr + outside.stderr
  assert int(inside.stdout) == 1
  assert int(outside.stdout) == len(os.sched_getaffinity(0))
