"""A real CPU quota on a real cgroup (as root, as CI runs): the cores the application sizes its thread
pools and simulation workers by are the quota's, not the visible ones."""

import os
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT

PRINT_CORES = "import sys; sys.path.insert(0, %r); from strategies import cpuinfo; print(cpuinfo.usable_cores())"


def _quota_cgroup(name: str):
  """The folder of a fresh cgroup limited to half a core (v1's cpu controller, else v2's cpu.max), or
  None where this process may not make one. The caller removes it."""
  candidates = [("/sys/fs/cgroup/cpu", "cpu.cfs_quota_us", "50000"),
                ("/sys/fs/cgroup/cpu,cpuacct", "cpu.cfs_quota_us", "50000"),
                ("/sys/fs/cgroup", "cpu.max", "50000 100000")]
  for root, quota_file, quota in candidates:
    if not os.path.isdir(root) or not os.access(root, os.W_OK):
      continue
    folder = os.path.join(root, name)
    try:
      os.mkdir(folder)
    except OSError:
      continue
    try:
      with open(os.path.join(folder, quota_file), "w") as target:
        target.write(quota)
      return folder
    except OSError:
      os.rmdir(folder)
  return None


def test_usable_cores_follow_a_real_cgroup_quota():
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("one visible core: a half-core quota would change nothing to see")
  folder = _quota_cgroup("neuron-inverter-test-%d" % os.getpid())
  if folder is None:
    pytest.skip("cannot create a cgroup with a CPU quota here (needs root and a writable cgroup tree)")
  try:
    inside = subprocess.run(["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec "$2" -c "$3"', "sh", folder,
                             sys.executable, PRINT_CORES % REPO_ROOT], capture_output=True, text=True, timeout=120)
    outside = subprocess.run([sys.executable, "-c", PRINT_CORES % REPO_ROOT], capture_output=True, text=True,
                             timeout=120)
  finally:
    os.rmdir(folder)
  assert inside.returncode == 0, inside.stderr
  assert int(inside.stdout) == 1
  assert int(outside.stdout) == len(os.sched_getaffinity(0))
