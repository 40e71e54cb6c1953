"""Absurd sizes, flag values that leave --data_path's folder, and stop signals in every phase of the
set-up, as a hostile or unlucky user meets them, through `python main.py`.

- Every size a flag implies is checked before TensorFlow builds anything (data/sizes.py,
  host/cpuinfo.py): an error line naming the flags and the limit, and no backend line before it.
- A flag value that fills in a file name is a name, refused as a path the same way for every such flag
  (data/cellspike_file.py `resolve`).
- A stop signal from the first line of the program to the end of the first training step (imports,
  flags, data check, TensorFlow's import, the strategy, the model, the step's tracing) ends the process
  within a few seconds: one `interrupted by ...` line, status 128 + signal number, no traceback
  (errors.py, training/interrupt.py). The time bounds here catch a hang, they time nothing.
"""

import os
import resource
import signal
import subprocess
import sys
import threading
import time

import h5py
import psutil
import pytest

from host.cpuinfo import MAX_CPU_REPLICAS
from stop_signals import STOP_GRACE_SECONDS
from tests.support.cellspike_files import write_cellspike, write_meta_yaml
from tests.support.helpers import REPO_ROOT, WITH_DEFAULT_SIGINT, assert_one_line_error, run_main

BACKEND_LINE = "] Backend CPU"  # select.py's line, once TensorFlow has made the devices
TINY = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--epochs=1", "--steps_per_epoch=2",
        "--eval_steps=1")
EXIT_BOUND = 10.0  # seconds from a signal to the exit: a hang, not a slow exit


@pytest.fixture(name="tiny_file")
def _tiny_file(tmp_path):
  """64 train, 32 val and 32 test samples."""
  return str(write_cellspike(str(tmp_path / "tiny.h5")))


def _sparse_cellspike(path, train_rows, eval_rows=32, time_bins=1600, probes=4, params=15):
  """A cellSpike file whose train split is declared `train_rows` long but written only in its last
  sample: the rest is a hole of the file system, so a file larger than the machine's memory takes a
  few kB of disk. It passes the file check (zeros are finite, the last sample is written)."""
  with h5py.File(path, "w") as f:
    for dom, rows in (("train", train_rows), ("val", eval_rows), ("test", eval_rows)):
      for key, shape in ((dom + "_frames", (rows, time_bins, probes)), (dom + "_unitStar_par", (rows, params))):
        creation = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        creation.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        creation.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        h5py.h5d.create(f.id, key.encode(), h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple(shape), dcpl=creation)
        f[key][rows - 1] = 1.0
  return path


# --- Sizes ------------------------------------------------------------------------------------------------

def test_replicas_beyond_what_a_cpu_holds_are_refused_before_any_device(tmp_path):
  """--replicas=10000 on the CPU made 10,000 logical devices and inter-op threads: 20 s silent (the
  output held back while TensorFlow started), a SIGTERM held back for seconds, 2 minutes to exit. With
  --backend=auto the backend is known after TensorFlow's import only, so the refusal comes then, but
  before any device; with --backend=cpu before TensorFlow."""
  for backend, bound in (("auto", 60), ("cpu", 30)):
    started = time.monotonic()
    result = run_main("--replicas=10000", "--backend=%s" % backend, "--logdir=%s" % (tmp_path / backend))
    assert time.monotonic() - started < bound, result.stderr[-2000:]
    assert_one_line_error(result, "--replicas=10000", "at most --replicas=%d" % MAX_CPU_REPLICAS)
    assert BACKEND_LINE not in result.stderr
    assert not (tmp_path / backend).exists()


@pytest.mark.parametrize("args, fragments", [
    (("--replicas=9", "--batch_size=8"), ("--replicas=9", "--batch_size=8", "72 rows", "64", "train split")),
    (("--batch_size=4", "--gradient_accumulation=20"), ("--gradient_accumulation=20", "80 rows", "64")),
    (("--replicas=40", "--batch_size=1"), ("--replicas=40", "32 samples", "test split")),
], ids=["train-batch", "accumulation", "evaluation"])
def test_replicas_and_batches_beyond_the_splits_are_refused_before_tensorflow(tmp_path, tiny_file, args,
                                                                              fragments):
  result = run_main(*TINY, "--data_path=%s" % tiny_file, "--logdir=%s" % (tmp_path / "run"), *args)
  assert_one_line_error(result, tiny_file, *fragments)
  assert BACKEND_LINE not in result.stderr  # refused before TensorFlow made anything
  assert not (tmp_path / "run").exists()


@pytest.fixture(name="larger_than_memory")
def _larger_than_memory(tmp_path):
  """A sparse cellSpike file of twice this machine's memory (frames of 25,600 bytes per sample)."""
  rows = 2 * psutil.virtual_memory().total // (1600 * 4 * 4) + 1
  try:
    return _sparse_cellspike(str(tmp_path / "huge.h5"), rows)
  except OSError as error:  # a file system without holes, or a file-size limit
    pytest.skip("cannot write a sparse file of %d rows here: %s" % (rows, error))


def test_in_memory_mode_of_a_file_larger_than_memory_is_refused_with_the_figures(tmp_path, larger_than_memory):
  """Before, the run gathered the blocks into host memory until the kernel's OOM killer ended it."""
  result = run_main(*TINY, "--data_path=%s" % larger_than_memory, "--in_memory", "--batch_size=8",
                    "--logdir=%s" % (tmp_path / "run"))
  assert_one_line_error(result, "--in_memory", larger_than_memory, "GB available")
  assert BACKEND_LINE not in result.stderr


def test_batches_larger_than_memory_are_refused_with_the_figures(tmp_path, larger_than_memory):
  """A batch that a file long enough allows, but that no memory holds."""
  with h5py.File(larger_than_memory, "r") as f:
    batch = f["train_frames"].shape[0]
  result = run_main(*TINY, "--data_path=%s" % larger_than_memory, "--batch_size=%d" % batch,
                    "--logdir=%s" % (tmp_path / "run"))
  assert_one_line_error(result, "--batch_size=%d" % batch, "input pipeline", "GB available")
  assert BACKEND_LINE not in result.stderr


@pytest.mark.parametrize("flag", ["read_chunk", "steps_per_execution", "shuffle_buffer"])
def test_counts_beyond_64_bits_are_refused_as_flags(tmp_path, tiny_file, flag):
  """--read_chunk=10**19 and --steps_per_execution=10**19 ended in TensorFlow tracebacks (an int64
  overflow); every integer flag without a range of its own is bounded at 2**31 - 1."""
  result = run_main(*TINY, "--data_path=%s" % tiny_file, "--%s=%d" % (flag, 10**19),
                    "--logdir=%s" % (tmp_path / "run"))
  assert result.returncode == 2
  assert_one_line_error(result, "--%s" % flag, str(2**31 - 1))


def test_a_pipeline_longer_than_any_system_is_refused_before_its_rules_fill_the_memory(tmp_path):
  """The pipeline's rules walk the stage mapping while the flags are parsed: --pipeline_stages=2**31
  filled a 24 GB machine's memory there (the OOM killer ended the process). Run under an address-space
  limit, so that a return of that fails alone, with a MemoryError."""
  limit = 4 * 2**30
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "main.py"), "--pipeline_stages=%d" % 2**31,
                           "--ipus_per_replica=%d" % 2**31, "--logdir=%s" % (tmp_path / "run")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
  assert result.returncode == 2
  assert_one_line_error(result, "--ipus_per_replica", "at most 64")


# --- Flag values that leave the data folder ------------------------------------------------------------

@pytest.fixture(name="data_folder")
def _data_folder(tmp_path):
  """--data_path's folder (a cell's file, the meta yaml), and beside it, outside, a meta yaml that a
  path in --probe_type could reach: read, its settings would train on the folder's file."""
  data, outside = tmp_path / "data", tmp_path / "outside"
  data.mkdir()
  outside.mkdir()
  write_cellspike(str(data / "cellA.h5"))
  write_meta_yaml(str(data / "meta.cellSpike_excite_4prB8kHz.yaml"), template="*.h5")
  write_meta_yaml(str(outside / "x.yaml"), template="*.h5")  # read, it would name data/cellA.h5: no error
  (data / "meta.cellSpike_x").mkdir()  # the folder the kernel walks through for "x/../../outside/x"
  return data


@pytest.mark.parametrize("args, flag", [
    (("--cell_name=cellA", "--probe_type=x/../../outside/x"), "--probe_type=x/../../outside/x"),
    (("--cell_name=../outside/x",), "--cell_name=../outside/x"),
], ids=["probe_type", "cell_name"])
def test_a_flag_value_that_leaves_the_data_folder_is_refused_the_same_way(tmp_path, data_folder, args, flag):
  """--probe_type=x/../../outside/x read outside/x.yaml (and trained on the file it named), where
  --cell_name=../outside/x was refused: both are names, refused as paths in one line."""
  result = run_main(*TINY, "--data_path=%s" % data_folder, "--batch_size=8",
                    "--logdir=%s" % (tmp_path / "run"), *args)
  assert_one_line_error(result, flag, "outside --data_path=%s" % data_folder)
  assert BACKEND_LINE not in result.stderr


def test_a_probe_type_path_beside_a_data_file_is_refused(tmp_path, data_folder):
  """With --data_path a file, the meta yaml is looked for beside it: the same rule."""
  result = run_main(*TINY, "--data_path=%s" % (data_folder / "cellA.h5"), "--probe_type=x/../../outside/x",
                    "--batch_size=8", "--logdir=%s" % (tmp_path / "run"))
  assert_one_line_error(result, "--probe_type=x/../../outside/x", "outside --data_path")


# --- Stop signals before the first step -------------------------------------------------------------------

class _Job:
  """main.py in its own process group, its output (both streams) collected line by line."""

  def __init__(self, args, launcher=()):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for variable in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR"):
      env.pop(variable, None)
    self.process = subprocess.Popen([sys.executable, *launcher, os.path.join(REPO_ROOT, "main.py"), *args],
                                    cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stdout:
      self.lines.append(line)

  def output(self) -> str:
    return "".join(self.lines)

  def wait_for(self, text: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while text not in self.output():
      assert self.process.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
      time.sleep(0.02)

  def stop(self, signum) -> tuple:
    """Sends `signum`; returns (exit status, seconds to the exit), the process killed after 60 s."""
    sent = time.monotonic()
    self.process.send_signal(signum)
    try:
      status = self.process.wait(60)
    except subprocess.TimeoutExpired:
      os.killpg(self.process.pid, signal.SIGKILL)
      self.process.wait()
      status = None
    seconds = time.monotonic() - sent
    self._reader.join(10)
    return status, seconds

  def close(self):
    if self.process.poll() is None:
      os.killpg(self.process.pid, signal.SIGKILL)
      self.process.wait()


def _assert_stopped(job, status, seconds, signum):
  output = job.output()
  assert status == 128 + signum, output[-3000:]
  assert seconds < EXIT_BOUND, (seconds, output[-3000:])
  assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
  name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
  assert output.rstrip().splitlines()[-1] == "interrupted by %s" % name, output[-3000:]


@pytest.mark.parametrize("wait_for, delay, signum", [
    (BACKEND_LINE, 0, signal.SIGTERM),             # the strategy made, the data next
    ("] MNIST source:", 0, signal.SIGINT),         # the data loaded, the model being built
    ("Compiling the training step", 0.5, signal.SIGTERM),  # the first step traced: 64 replicas, a minute
], ids=["after-the-backend", "model-build", "first-step-trace"])
def test_a_signal_in_the_set_up_stops_within_seconds(tmp_path, wait_for, delay, signum):
  """A stop in the first step's tracing used to wait for the step (a minute or more with many CPU
  replicas, for its whole compilation on IPUs), then save a checkpoint of one step."""
  job = _Job(["--replicas=64", "--batch_size=1", "--epochs=1", "--steps_per_epoch=2",
              "--logdir=%s" % (tmp_path / "run")], launcher=("-c", WITH_DEFAULT_SIGINT))
  try:
    job.wait_for(wait_for)
    time.sleep(delay)
    status, seconds = job.stop(signum)
  finally:
    job.close()
  _assert_stopped(job, status, seconds, signum)
  # Nothing was trained: no checkpoint, and a resume says to start again (training/run_folder.py).
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_signal_while_the_flags_are_read_stops_with_its_line(tmp_path):
  """A --flagfile that is a FIFO holds the flag parsing in open() until a writer comes: the process is
  in its first second, before the application's handlers, where SIGTERM killed it without a line."""
  fifo = tmp_path / "flags"
  os.mkfifo(fifo)
  job = _Job(["--flagfile=%s" % fifo])
  try:
    deadline = time.monotonic() + 30
    while not _blocked_in_open(job.process.pid):
      assert job.process.poll() is None and time.monotonic() < deadline, job.output()
      time.sleep(0.05)
    status, seconds = job.stop(signal.SIGTERM)
  finally:
    job.close()
  _assert_stopped(job, status, seconds, signal.SIGTERM)


def _blocked_in_open(pid: int) -> bool:
  """Whether process `pid` waits in the open() of a FIFO for a writer (the kernel's wait_for_partner)."""
  try:
    with open("/proc/%d/wchan" % pid) as wchan:
      return wchan.read().strip() == "wait_for_partner"
  except OSError:
    return False


def test_a_stop_held_back_in_native_code_ends_the_process_after_the_grace(tmp_path):
  """A call into C++ that no signal interrupts (here pthread_mutex_lock on a mutex the thread holds;
  in a run, an XLA or Poplar compilation, or a wait for another process) keeps Python's handler from
  running: the watchdog ends the process after STOP_GRACE_SECONDS with the line and the status."""
  code = ("import ctypes, sys; sys.path.insert(0, %r)\n"
          "from errors import reported_on_one_line\n"
          "mutex = ctypes.create_string_buffer(64)\n"
          "lock = ctypes.CDLL(None).pthread_mutex_lock\n"
          "with reported_on_one_line():\n"
          "  lock(mutex)\n"
          "  print('holding', flush=True)\n"
          "  lock(mutex)\n" % REPO_ROOT)
  process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
  try:
    assert process.stdout.readline().strip() == "holding"
    time.sleep(0.2)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=STOP_GRACE_SECONDS + EXIT_BOUND)
    seconds = time.monotonic() - sent
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
  assert process.returncode == 128 + signal.SIGTERM, err
  assert STOP_GRACE_SECONDS - 0.5 < seconds < STOP_GRACE_SECONDS + EXIT_BOUND
  assert err.strip().splitlines() == ["interrupted by SIGTERM"], err
