"""Inputs that change under a running job, and data written under a file-size limit.

A run reads the data file it checked at its start until its end (data/pinned_files.py): a file renamed
over or deleted meanwhile changes nothing, and one changed in place (truncated, written to) stops the
run in one `error:` line naming it, with its checkpoints kept; a truncated file's mapping faults
(SIGBUS), which must not end the process without a word. The dataset generator and staging write
under a file-size limit (`ulimit -f`) with one line and nothing left (data/hdf5_writes.py). Each case
runs for real: a contiguous HDF5 file truncated, replaced or deleted while `main.py` trains on it,
and processes started under RLIMIT_FSIZE.
"""

import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import pytest
import tensorflow as tf
import yaml

from tests.support.cellspike_files import make_arrays
from tests.support.helpers import REPO_ROOT, assert_names, assert_one_line_error, line_naming
from tests.support.training_parts import readable_state

ARGS = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=8", "--seed=3",
        "--epochs=40")    # long enough that the file changes while the run trains
SIZES = {"train": 256, "val": 32, "test": 32}


def write_contiguous(path, sizes=None, seed=0):
  """A cellSpike file whose datasets are contiguous, as the real ones: memory-mapped, not staged."""
  with h5py.File(path, "w") as f:
    for i, (dom, n) in enumerate((sizes or SIZES).items()):
      frames, targets = make_arrays(n, seed + i)
      f.create_dataset(dom + "_frames", data=frames)
      f.create_dataset(dom + "_unitStar_par", data=targets)
  return str(path)


class Run:
  """`python main.py` writing stdout and stderr to one file; always ended in `close`."""

  def __init__(self, tmp_path, *args):
    self.logdir = str(tmp_path / "run")
    self.log = str(tmp_path / "output.txt")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_USE_LEGACY_KERAS", None)
    with open(self.log, "w") as out:
      self.process = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "main.py"), *ARGS,
                                       "--logdir=" + self.logdir, *args], cwd=REPO_ROOT, env=env,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

  def output(self) -> str:
    with open(self.log) as f:
      return f.read()

  def wait_for(self, text: str, timeout=180.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in self.output():
      assert self.process.poll() is None, "ended (%s) before %r:\n%s" % (
          self.process.returncode, text, self.output()[-3000:])
      assert time.monotonic() < deadline, "no %r in time:\n%s" % (text, self.output()[-3000:])
      time.sleep(0.02)

  def finish(self, timeout=240.0) -> subprocess.CompletedProcess:
    self.process.wait(timeout=timeout)
    return subprocess.CompletedProcess(self.process.args, self.process.returncode, "", self.output())

  def close(self) -> None:
    if self.process.poll() is None:
      os.killpg(self.process.pid, signal.SIGKILL)
      self.process.wait(timeout=30)


@pytest.fixture
def run(tmp_path):
  started = []

  def start(*args):
    started.append(Run(tmp_path, *args))
    return started[-1]
  yield start
  for job in started:
    job.close()


def assert_last_checkpoint_kept(logdir):
  path = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints", "last"))
  assert path is not None, os.listdir(os.path.join(logdir, "checkpoints"))
  assert readable_state(path)["epoch"] >= 1


def test_a_data_file_truncated_while_training_is_one_line_and_keeps_the_checkpoint(tmp_path, run):
  """Its mapping faults past the new end: SIGBUS, whose default is "Bus error", status 135, no word."""
  path = write_contiguous(tmp_path / "cell.h5")
  job = run("--data_path=" + path)
  job.wait_for("Epoch 1/40 took")  # logged after epoch 1's checkpoint
  os.truncate(path, os.path.getsize(path) // 3)
  result = job.finish()
  assert result.returncode == 1, result.stderr[-3000:]
  assert_one_line_error(result, path, "shrank", "checkpoints saved before")
  assert_last_checkpoint_kept(job.logdir)
  with open(os.path.join(job.logdir, "log.txt")) as log:
    assert "shrank from" in log.read()
  assert not os.path.exists(os.path.join(job.logdir, ".lock"))  # ended, not killed


def test_a_data_file_written_in_place_while_training_is_one_line(tmp_path, run):
  path = write_contiguous(tmp_path / "cell.h5")
  job = run("--data_path=" + path)
  job.wait_for("Epoch 1/40 took")
  with h5py.File(path, "r+") as f:  # same size, other values
    f["train_unitStar_par"][0] = 0.5
  result = job.finish()
  assert_one_line_error(result, path, "was written to")
  assert_last_checkpoint_kept(job.logdir)


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_a_data_file_replaced_or_deleted_while_training_is_read_to_the_end(tmp_path, run, change):
  """The validation and test streams start after the change: by name they would map the new file with
  the old size ("Readonly memory region has wrong length") or none (NotFoundError)."""
  path = write_contiguous(tmp_path / "cell.h5")
  job = run("--data_path=" + path, "--epochs=2")
  job.wait_for("Compilation and first step done")  # training; the validation stream has not started
  if change == "replaced":
    os.replace(write_contiguous(tmp_path / "other.h5", {"train": 64, "val": 8, "test": 8}, seed=9), path)
  else:
    os.remove(path)
  result = job.finish()
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  assert_names(line_naming(result.stderr, "%s was %s" % (path, change)), "goes on reading", "file it checked")
  with open(os.path.join(job.logdir, "summary.yaml")) as f:
    summary = yaml.safe_load(f)
  assert summary["test_samples"] == SIZES["test"] and len(summary["history"]["val_loss"]) == 2


def test_a_staged_copy_truncated_while_training_is_one_line_naming_it(tmp_path, run):
  """--stage_dir: the run reads its node-local copy, held open the same way."""
  path = write_contiguous(tmp_path / "cell.h5")
  stage = tmp_path / "local"
  job = run("--data_path=" + path, "--stage_dir=%s" % stage)
  job.wait_for("Epoch 1/40 took")
  copy = [name for name in os.listdir(stage) if ".rows0-256." in name]
  assert len(copy) == 1, os.listdir(stage)
  os.truncate(str(stage / copy[0]), 4096)
  result = job.finish()
  assert_one_line_error(result, str(stage / copy[0]), "shrank")
  assert_last_checkpoint_kept(job.logdir)


# What the guard does without any training step: the loader's streams read on past a truncation
# (tf.data's threads fault), or a SIGBUS comes that no data file explains.
_READER = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, %r)
    from errors import reported_on_one_line
    from data import cellspike
    from data.splits import BatchLayout
    from run_config import RunConfig
    path, action = sys.argv[1], sys.argv[2]
    with reported_on_one_line():
      splits = cellspike.load(RunConfig(model="neuron_inverter", data_path=path, batch_size=8), BatchLayout(1, 8))
      batches = iter(splits.train.stream(0))
      next(batches)
      if action == "truncate":
        os.truncate(path, 4096)
        for _ in range(100000):
          next(batches)
      else:
        os.kill(os.getpid(), signal.SIGBUS)
        time.sleep(30)
      print("read on")
    """ % REPO_ROOT)


def test_a_fault_on_a_truncated_mapping_is_one_line_without_any_step(tmp_path):
  path = write_contiguous(tmp_path / "cell.h5")
  size = os.path.getsize(path)
  result = subprocess.run([sys.executable, "-c", _READER, path, "truncate"], capture_output=True, text=True,
                          timeout=180)
  assert result.returncode == 1, result.stderr[-3000:]
  assert_one_line_error(result, path, "shrank", "from %d to 4096 bytes" % size)
  assert "read on" not in result.stdout


def test_a_sigbus_that_no_data_file_explains_ends_the_process_as_before(tmp_path):
  path = write_contiguous(tmp_path / "cell.h5")
  result = subprocess.run([sys.executable, "-c", _READER, path, "kill"], capture_output=True, text=True,
                          timeout=180)
  assert result.returncode == -signal.SIGBUS, result.stderr[-3000:]
  assert_names(result.stderr, "Fatal Python error", "Bus error")
  assert not re.search(r"^error: ", result.stderr, re.MULTILINE), result.stderr[-3000:]


# --- Writing under a file-size limit ------------------------------------------------------------------

GENERATOR = os.path.join(REPO_ROOT, "tools", "generate_cellspike.py")


def _limited(size):
  def limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))  # as `ulimit -f` sets both
  return limit


def test_generating_under_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
  """Left to h5py, EFBIG is a traceback repeated by its clean-up, then h5py 3.1's segmentation fault
  (status 139); the limit is found before anything is written."""
  out_dir = tmp_path / "data"
  result = subprocess.run([sys.executable, GENERATOR, "--out_dir=%s" % out_dir, "--num_train=300",
                           "--num_val=16", "--num_test=16", "--workers=1", "--noprogress"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=180, preexec_fn=_limited(2 * 2**20))
  assert result.returncode == 1, result.stderr[-3000:]
  assert_one_line_error(result, "--out_dir=%s" % out_dir, "at most 2.1 MB", "file-size limit", "ulimit -f")
  assert os.listdir(out_dir) == []


def test_a_file_size_limit_lowered_while_generating_is_one_line_and_no_crash(tmp_path):
  """A write past the limit fails mid-file (EFBIG), after the checks at the start: h5py's file is
  closed in memory, not left to crash in its clean-up, and the partial file is removed."""
  out_dir = tmp_path / "data"
  job = subprocess.Popen([sys.executable, GENERATOR, "--out_dir=%s" % out_dir, "--num_train=3000",
                          "--num_val=16", "--num_test=16", "--workers=1", "--noprogress"], cwd=REPO_ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    while not (out_dir.exists() and any(name.endswith(".tmp") for name in os.listdir(out_dir))):
      assert job.poll() is None and time.monotonic() < deadline, job.communicate()
      time.sleep(0.01)
    # Lowered from outside (prlimit), below the file, the hard limit left as it was.
    resource.prlimit(job.pid, resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))
    out, err = job.communicate(timeout=180)
  finally:
    if job.poll() is None:
      job.kill()
      job.wait()
  result = subprocess.CompletedProcess(job.args, job.returncode, out, err)
  assert result.returncode == 1, err[-3000:]
  assert_one_line_error(result, "--out_dir=%s" % out_dir, out_dir / "synth_excite.cellSpike_4prB8kHz.data.h5",
                        "File too large", "partial file was removed")
  assert os.listdir(out_dir) == []


def test_the_built_in_dataset_under_a_file_size_limit_is_one_line(tmp_path):
  """main.py generates the built-in dataset (0.9 GB) at its first run: refused before the simulation."""
  cache = tmp_path / "cache"
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter",
                           "--epochs=1", "--data_cache=%s" % cache, "--logdir=%s" % (tmp_path / "run")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                          preexec_fn=_limited(64 * 2**20))
  assert_one_line_error(result, "--data_cache=%s" % cache, "file-size limit")
  assert [name for name in os.listdir(cache / "cellspike-v3-seed0") if not name.endswith(".lock")] == []
  assert "generating:" not in result.stderr
