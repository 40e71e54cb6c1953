"""Interrupted training: SIGKILL at random points, SIGTERM/SIGINT graceful save, NaN, disk full.

Real training processes (`python main.py`, dev design, a small file, 32 steps per epoch) are killed and
resumed; each run's outputs are checked: every epoch accounted for, checkpoints readable, none lost,
and the final losses those of an uninterrupted run (to 1e-3: without dropout, whose masks a resumed
run would draw anew, the data order, weights and optimizer state carry the run on as if unbroken). A NaN run is poisoned in-process. The unit tests of the
same parts: tests/test_interrupt.py (the signal flag, a resumed epoch's batches) and
tests/test_checkpoints.py (failed saves).
"""

import json
import os
import random
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
import yaml

from errors import UserError
from run_config import RunConfig
from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import (REPO_ROOT, WITH_DEFAULT_SIGHUP, WITH_DEFAULT_SIGINT, assert_names,
                                   can_mount_tmpfs, line_naming, train_in_process)
from tests.support.training_parts import free_ports, readable_state, with_first_callback
from training.checkpoints import read_index

EPOCHS = 10
STEPS = 32          # 256 train samples / batch 8
ARGS = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=8", "--warmup_epochs=1",
        "--seed=3", "--dropout=0")
LOSS_RTOL = 1e-3    # without dropout a resumed run repeats the uninterrupted one (equal to 1e-5 when measured)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
  return write_cellspike(str(tmp_path_factory.mktemp("data") / "faults.h5"),
                         sizes={"train": 256, "val": 32, "test": 32})


class Job:
  """One `python main.py` process, output to files, always killed in `close`."""

  def __init__(self, logdir, data_file, *extra, prefix=()):
    self.logdir = logdir
    os.makedirs(os.path.dirname(logdir) or ".", exist_ok=True)
    self.log_path = logdir.rstrip("/") + ".%d.log" % time.monotonic_ns()
    self._log = open(self.log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_USE_LEGACY_KERAS", None)
    command = list(prefix) + [sys.executable, "-c", WITH_DEFAULT_SIGINT,
                              os.path.join(REPO_ROOT, "main.py"), *ARGS, "--data_path=" + data_file,
                              "--logdir=" + logdir, *extra]
    self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=self._log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

  def output(self) -> str:
    self._log.flush()
    with open(self.log_path) as f:
      return f.read()

  def wait_for(self, predicate, timeout=90.0, what="a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if predicate():
        return
      if self.process.poll() is not None:
        raise AssertionError("the run ended (status %s) before %s:\n%s"
                             % (self.process.returncode, what, self.output()[-3000:]))
      time.sleep(0.02)
    raise AssertionError("timed out waiting for %s:\n%s" % (what, self.output()[-3000:]))

  def wait(self, timeout=120.0) -> int:
    return self.process.wait(timeout=timeout)

  def close(self):
    if self.process.poll() is None:
      try:
        os.killpg(self.process.pid, signal.SIGKILL)
      except OSError:
        self.process.kill()
      self.process.wait(timeout=30)
    self._log.close()


def run_to_end(logdir, data_file, *extra, timeout=120.0):
  job = Job(logdir, data_file, *extra)
  try:
    status = job.wait(timeout)
    assert status == 0, job.output()[-3000:]
    return job.output()
  finally:
    job.close()


def summary_of(logdir):
  with open(os.path.join(logdir, "summary.yaml")) as f:
    return yaml.safe_load(f)


def last_state(logdir):
  """The run state of checkpoints/last, after checking that every tensor of it reads back."""
  path = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints", "last"))
  assert path is not None, os.listdir(os.path.join(logdir, "checkpoints", "last"))
  return readable_state(path)


def assert_checkpoints_sound(logdir):
  """Every checkpoint an index lists is complete and readable; no staging leftovers are listed."""
  for which in ("last", "best"):
    folder = os.path.join(logdir, "checkpoints", which)
    if not os.path.isdir(folder):
      continue
    for name in read_index(folder):
      readable_state(os.path.join(folder, name))


def index_epoch(logdir):
  """(epoch, step) of the checkpoint the index of checkpoints/last names (from its name), or None."""
  folder = os.path.join(logdir, "checkpoints", "last")
  names = read_index(folder) if os.path.isdir(folder) else []
  match = re.match(r"ckpt-(\d+)(?:-step(\d+))?", names[-1]) if names else None
  return (int(match.group(1)), int(match.group(2) or 0)) if match else None


class Reference:
  """The uninterrupted run that interrupted ones are compared with, trained alongside them."""

  def __init__(self, logdir, data_file):
    self.logdir = logdir
    self.job = Job(logdir, data_file, "--epochs=%d" % EPOCHS)

  def summary(self):
    status = self.job.wait(180)
    assert status == 0, self.job.output()[-3000:]
    return summary_of(self.logdir)


@pytest.fixture
def reference(tmp_path, data_file):
  ref = Reference(str(tmp_path / "reference"), data_file)
  try:
    yield ref
  finally:
    ref.job.close()


def assert_close_to_reference(summary, reference, epochs=EPOCHS):
  reference = reference.summary()
  assert summary["history"]["epoch"] == list(range(1, epochs + 1))
  for key in ("loss", "val_loss"):
    ours, theirs = summary["history"][key][epochs - 1], reference["history"][key][epochs - 1]
    assert ours == pytest.approx(theirs, rel=LOSS_RTOL), (key, summary["history"][key],
                                                          reference["history"][key])
  np.testing.assert_allclose(summary["history"]["lr"], reference["history"]["lr"][:epochs])


# ---------------------------------------------------------------------------------------------------
# (a) SIGKILL at random points, resume each time; (b) then SIGTERM mid-epoch and a graceful save.

def test_sigkill_at_random_points_then_sigterm_then_resume(tmp_path, data_file, reference):
  seed = int(os.environ.get("FAULT_SEED", time.time_ns() % 10**6))
  rng = random.Random(seed)
  logdir = str(tmp_path / "run")
  kills, progress = [], []
  for attempt in range(3):
    resume = ("--resume",) if attempt else ()
    before = index_epoch(logdir) or (0, 0)
    job = Job(logdir, data_file, "--epochs=%d" % EPOCHS, *resume)
    try:
      # Kill after this process has saved a checkpoint of its own, at a random point after it.
      job.wait_for(lambda: (index_epoch(logdir) or (0, 0)) > before, what="a new checkpoint")
      delay = rng.uniform(0.0, 0.5)
      time.sleep(delay)
      assert job.process.poll() is None, "finished too early: " + job.output()[-2000:]
      os.killpg(job.process.pid, signal.SIGKILL)
      job.wait(30)
      kills.append(round(delay, 3))
    finally:
      job.close()
    assert_checkpoints_sound(logdir)
    progress.append(index_epoch(logdir))
    context = "FAULT_SEED=%d kills after %s s, checkpoints %s" % (seed, kills, progress)
    assert progress[-1] > before, context   # nothing lost, always forward
    assert progress[-1][0] < EPOCHS, context

  # SIGTERM once the resumed process has trained a step: it saves where it is, mid-epoch, and exits.
  # With Keras' progress bar, whose line is still open mid-epoch (a pipe would get one line per epoch).
  job = Job(logdir, data_file, "--epochs=%d" % EPOCHS, "--resume", "--progress=bar")
  try:
    job.wait_for(lambda: "Compilation and first step done" in job.output(), what="the first step")
    job.process.send_signal(signal.SIGTERM)
    job.wait_for(lambda: "SIGTERM received" in job.output(), what="the first signal's line")
    # A second signal while it stops changes nothing: noted while it saves, ignored after (the flag's
    # tests below show both; which one this process meets depends on how fast it saves).
    job.process.send_signal(signal.SIGTERM)
    status = job.wait(60)
    output = job.output()
  finally:
    job.close()
  assert status == 128 + signal.SIGTERM, output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  lines = [line for line in output.splitlines() if "Training interrupted by SIGTERM" in line]
  assert len(lines) == 1, output[-3000:]
  assert lines[0].startswith("W"), lines[0]  # absl's warning, not glued to the progress bar's last update
  state = last_state(logdir)
  epoch, step = state["epoch"], state["step"]
  assert epoch == progress[-1][0] and 0 < step < STEPS, (lines[0], context)
  checkpoint = os.path.join(logdir, "checkpoints", "last", "ckpt-%d-step%d" % (epoch, step))
  assert_names(lines[0], "in epoch %d " % (epoch + 1), "after step %d of %d;" % (step, STEPS),
               "checkpoint: %s;" % checkpoint, "--resume --logdir=%s " % logdir, "(exit status 143)")
  # The next line is that command, to paste: this run's flags, with the resume's put in.
  command = shlex.split(output[output.index("Continue with:\n"):].splitlines()[1])
  assert command[1:] == ["main.py", *ARGS, "--data_path=" + data_file, "--progress=bar", "--logdir=" + logdir,
                         "--resume", "--epochs=%d" % EPOCHS], command
  assert np.isfinite(state["partial_logs"]["loss"])
  assert_checkpoints_sound(logdir)

  output = run_to_end(logdir, data_file, "--epochs=%d" % EPOCHS, "--resume")
  assert_names(line_naming(output, "continuing with"), "epoch %d of %d" % (epoch + 1, EPOCHS),
               "at step %d of %d" % (step + 1, STEPS))
  summary = summary_of(logdir)
  assert summary["first_epoch"] == epoch + 1, context
  assert last_state(logdir)["epoch"] == EPOCHS
  assert read_index(os.path.join(logdir, "checkpoints", "last"))[-1] == "ckpt-%d" % EPOCHS
  assert_checkpoints_sound(logdir)
  assert_close_to_reference(summary, reference)
  leftovers = [name for name in os.listdir(os.path.join(logdir, "checkpoints", "last"))
               if name.startswith(".saving-") or ".tmp" in name]
  assert not leftovers


# ---------------------------------------------------------------------------------------------------
# (d) Disk full on a real (tiny) file system, where the test may mount one.

def test_ctrl_c_before_training_is_one_line_and_exit_130(tmp_path, data_file):
  """Ctrl-C while --autotune times the forms (before training, where no graceful stop applies): no
  traceback, one line, the shell's status for SIGINT, and no half-written timings or run folder."""
  logdir, cache = str(tmp_path / "run"), str(tmp_path / "cache")
  # ontra4, not dev: its forms take seconds to build and time (about 3 s), so the
  # signal lands in the timing on a fast CPU too.
  job = Job(logdir, data_file, "--design=ontra4", "--epochs=1", "--precision=32.32", "--autotune=on",
            "--cache_dir=" + cache)
  try:
    job.wait_for(lambda: "Autotune: timing" in job.output(), what="the autotune's first line")
    time.sleep(0.3)  # into the building and timing
    # How the process treats SIGINT (/proc/PID/status: ignored and caught signal masks), and what it
    # had done by then, for a failure's message.
    with open("/proc/%d/status" % job.process.pid) as status_file:
      dispositions = [line.strip() for line in status_file if line.startswith(("SigIgn", "SigCgt"))]
    before = job.output()
    job.process.send_signal(signal.SIGINT)
    status = job.wait(60)
    output = job.output()
  finally:
    job.close()
  assert status == 130, "%s\nat the signal:\n%s\nat the end:\n%s" % (dispositions, before[-2000:],
                                                                     output[-1500:])
  assert "Traceback" not in output, output[-3000:]
  assert_names(line_naming(output, "by SIGINT (Ctrl-C)"), "interrupted by SIGINT")
  assert not os.path.exists(os.path.join(cache, "autotune")) or not os.listdir(os.path.join(cache, "autotune"))
  assert not os.path.exists(os.path.join(logdir, "summary.yaml"))


def test_disk_full_during_training_keeps_the_previous_checkpoint(tmp_path, data_file):
  mount = tmp_path / "mnt"
  mount.mkdir()
  if not can_mount_tmpfs(str(mount)):
    pytest.skip("cannot mount a tmpfs here (needs unshare and mount rights); the in-process test covers it")
  copy = str(tmp_path / "copied")
  logdir = os.path.join(str(mount), "run")
  # In a private mount namespace: a 64 MB tmpfs; fill it once the first checkpoint exists.
  script = """
mount -t tmpfs -o size=64m tmpfs "$MNT" || exit 77
"$@" &
pid=$!
while [ ! -f "$MNT/run/checkpoints/last/checkpoint" ] && kill -0 $pid 2>/dev/null; do sleep 0.02; done
dd if=/dev/zero of="$MNT/filler" bs=1M 2>/dev/null
wait $pid
status=$?
cp -a "$MNT/run" "$COPY"
exit $status
"""
  os.environ["MNT"], os.environ["COPY"] = str(mount), copy
  try:
    job = Job(logdir, data_file, "--epochs=%d" % EPOCHS, prefix=("unshare", "-m", "sh", "-c", script, "sh"))
  finally:
    del os.environ["MNT"], os.environ["COPY"]
  try:
    status = job.wait(120)
    output = job.output()
  finally:
    job.close()
  assert status == 1, output[-3000:]
  errors = [line for line in output.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, output[-3000:]
  assert "could not save checkpoint" in errors[0] and "No space left on device" in errors[0], errors[0]
  assert "Traceback" not in output
  state = last_state(copy)
  assert 1 <= state["epoch"] < EPOCHS
  intact = re.search(r"the previous checkpoint (\S+) is intact", errors[0]).group(1)
  assert intact.startswith(os.path.join(logdir, "checkpoints", "")), errors[0]  # last or best
  readable_state(os.path.join(copy, os.path.relpath(intact, logdir)))
  assert_checkpoints_sound(copy)
  assert not [n for n in os.listdir(os.path.join(copy, "checkpoints", "last")) if n.startswith(".saving-")]


# ---------------------------------------------------------------------------------------------------
# In-process: a diverging run (NaN) keeps its last good checkpoint.

class _PoisonAtEpoch(tf.keras.callbacks.Callback):
  """Makes the weights NaN when epoch `epoch` (0-based) begins, as a diverging run would."""

  def __init__(self, epoch):
    super().__init__()
    self.epoch = epoch

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self.epoch:
      for weight in self.model.trainable_weights:
        weight.assign(tf.fill(tf.shape(weight), float("nan")))


def test_nan_loss_keeps_the_last_good_checkpoint(tmp_path, data_file, monkeypatch):
  logdir = str(tmp_path / "run")
  config = RunConfig(model="neuron_inverter", model_options={"design": "dev"}, backend="cpu", batch_size=8,
                     learning_rate=1e-3, optimizer="adam", data_path=data_file, logdir=logdir, epochs=3,
                     warmup_epochs=1, steps_per_epoch=8, eval_steps=2)
  with_first_callback(monkeypatch, _PoisonAtEpoch(1))
  with pytest.raises(UserError) as error:
    train_in_process(config)
  good = os.path.join(logdir, "checkpoints", "last", "ckpt-1")
  assert_names(error.value, "loss became NaN/Inf", "in epoch 2", "last good checkpoint: %s" % good)
  assert read_index(os.path.join(logdir, "checkpoints", "last")) == ["ckpt-1"]
  state = readable_state(good)
  assert state["epoch"] == 1
  reader = tf.train.load_checkpoint(good)
  assert all(np.all(np.isfinite(reader.get_tensor(key))) for key in reader.get_variable_to_shape_map()
             if reader.get_variable_to_dtype_map()[key].is_floating)


# ---------------------------------------------------------------------------------------------------
# Multi-worker: a signal to one worker stops all of them at the same point, however many epochs in
# (tests/e2e/test_multiworker.py stops them mid-epoch and resumes).

def _two_workers(tmp_path, jobs, *args):
  """Starts two TF_CONFIG workers on 127.0.0.1 into `jobs` (the caller closes them), training on a small
  file into tmp_path/run; returns that folder."""
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 256, "val": 64, "test": 64})
  logdir = str(tmp_path / "run")
  cluster = {"worker": ["127.0.0.1:%d" % port for port in free_ports(2)]}
  for index in range(2):
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
    try:
      jobs.append(Job(logdir, data_path, *args))
    finally:
      del os.environ["TF_CONFIG"]
  return logdir


def test_sigterm_to_one_worker_stops_all_workers_at_the_same_point(tmp_path):
  jobs = []
  try:
    logdir = _two_workers(tmp_path, jobs, "--epochs=40", "--steps_per_epoch=3", "--eval_steps=1",
                          "--batch_size=16")
    jobs[0].wait_for(lambda: index_epoch(logdir) is not None, what="the chief's first checkpoint")
    jobs[1].process.send_signal(signal.SIGTERM)   # only the non-chief worker is signalled
    statuses = [job.wait(120) for job in jobs]
    outputs = [job.output() for job in jobs]
  finally:
    for job in jobs:
      job.close()
  assert statuses == [143, 143], [output[-2000:] for output in outputs]
  # Every epoch up to the stop trained: Keras keeps one iterator for all epochs of a multi-worker
  # fit, and an input that ends after one epoch ends the fit early, as if it were done.
  assert not any("ran out of data" in output for output in outputs), [o[-2000:] for o in outputs]
  # Mid-epoch ("in epoch E after step S of 3") or, for a signal during validation, at an epoch end.
  stops = [re.search(r"Training interrupted by SIGTERM (in epoch (\d+) after step (\d+)|at the end of "
                     r"epoch (\d+))", output) for output in outputs]
  assert all(stops), [output[-2000:] for output in outputs]
  assert stops[0].group(1) == stops[1].group(1)
  state = last_state(logdir)
  if stops[0].group(4):
    assert state["epoch"] == int(stops[0].group(4)) < 40 and not state.get("step")
  else:
    assert (state["epoch"] + 1, state["step"]) == (int(stops[0].group(2)), int(stops[0].group(3)))


@pytest.mark.parametrize("signalled", [(0, 1), (1,)], ids=["all", "one"])
def test_sigterm_to_the_workers_before_training_stops_them_on_one_line(tmp_path, signalled):
  """srun delivers a time limit's SIGTERM to every task; before training it stops each worker as it
  stops one process, although the strategy's coordination service installs a SIGTERM handler of its
  own (which only logged "SIGTERM caught", and the workers trained on). A worker left alone finds its
  partner gone at its next collective and says so on one line."""
  jobs = []
  try:
    logdir = _two_workers(tmp_path, jobs, "--epochs=2", "--steps_per_epoch=3", "--eval_steps=1")
    for index in signalled:  # the strategy exists: the backend's line comes after it
      jobs[index].wait_for(lambda job=jobs[index]: "running on CPU" in job.output(), what="the backend")
    for index in signalled:
      jobs[index].process.send_signal(signal.SIGTERM)
    statuses = [job.wait(120) for job in jobs]
    outputs = [job.output() for job in jobs]
  finally:
    for job in jobs:
      job.close()
  assert statuses == [143 if index in signalled else 1 for index in range(2)], [o[-2000:] for o in outputs]
  for index, output in enumerate(outputs):
    last = output.rstrip().splitlines()[-1]
    assert "Traceback" not in output, output[-2000:]
    if index in signalled:
      assert last == "interrupted by SIGTERM", output[-2000:]
    else:
      assert last.startswith("error: another process"), last
      assert_names(last, "2-process run", "cannot be reached (")
      # TensorFlow's reason names the lost task (2.21: "tasks are unhealthy", 2.6: "cluster check alive failed").
      assert "/job:worker/replica:0/task:1" in last and "[_Derived_]" not in last, last
      assert last.endswith("saved no checkpoint yet)") and "launch all 2 again (" in last, last
  assert not os.path.exists(os.path.join(logdir, "summary.yaml"))


def test_sigterm_while_the_builtin_dataset_is_generated_leaves_nothing_behind(tmp_path):
  """scancel or a time limit before training: the generation stops (its worker processes too), its
  temporary file and the still empty run folder are removed, and the job says so on one line with
  status 143 instead of dying where it stood."""
  cache, logdir = tmp_path / "cache", tmp_path / "run"
  log_path = tmp_path / "job.log"
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.pop("TF_USE_LEGACY_KERAS", None)
  with open(log_path, "w") as log:
    process = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter",
                                "--data_cache=%s" % cache, "--logdir=%s" % logdir], cwd=REPO_ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
      deadline = time.monotonic() + 180
      while "] generating " not in log_path.read_text():  # its temporary file is created right after
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.05)
      time.sleep(1.0)
      assert [name for _, _, names in os.walk(cache) for name in names if name.endswith(".tmp")]
      process.send_signal(signal.SIGTERM)
      status = process.wait(timeout=60)
    finally:
      if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
  output = log_path.read_text()
  assert status == 128 + signal.SIGTERM and output.rstrip().endswith("interrupted by SIGTERM"), output[-3000:]
  assert "Traceback" not in output
  # No partial dataset; only the generation's empty lock file, kept (removing it would let a waiting
  # process and a new one hold two different locks).
  left = [name for _, _, names in os.walk(cache) for name in names]
  assert left == [".synth_excite.cellSpike_4prB8kHz.data.h5.lock"], left
  assert not logdir.exists()
  deadline = time.monotonic() + 15   # and no simulation worker lives on (the job's process group)
  while _group_alive(process.pid):
    assert time.monotonic() < deadline, "the generation's worker processes outlived the job"
    time.sleep(0.1)


def _group_alive(group: int) -> bool:
  try:
    os.killpg(group, 0)
  except ProcessLookupError:
    return False
  return True


# A login's terminal: the process leads a new session (start_new_session) and takes the pseudo-terminal on
# its stdin as its controlling terminal, with SIGHUP's default action, as a shell gives it.
_IN_A_TERMINAL = "import fcntl, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); " + WITH_DEFAULT_SIGHUP


class _Terminal:
  """The master side of a pseudo-terminal, read in a thread as a terminal emulator reads it; `close`
  hangs it up, as a lost ssh connection does."""

  def __init__(self):
    self.master, self.slave = os.openpty()
    self.chunks, self._done = [], threading.Event()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    while not self._done.is_set():
      if select.select([self.master], [], [], 0.05)[0]:
        try:
          self.chunks.append(os.read(self.master, 65536))
        except OSError:
          return

  def text(self) -> str:
    return b"".join(self.chunks).decode(errors="replace")

  def hang_up(self):
    self._done.set()
    self._reader.join()
    os.close(self.master)


def test_a_closed_terminal_stops_training_with_a_checkpoint_and_status_129(tmp_path, data_file):
  """A terminal that closes sends SIGHUP, whose default action ended the run where it stood, losing the
  epoch's steps; and each write to the closed terminal fails (EIO), the progress bar's first."""
  logdir, epochs = str(tmp_path / "run"), 2   # the hang-up comes in epoch 1; the resume trains the rest
  terminal = _Terminal()
  env = dict(os.environ, PYTHONUNBUFFERED="1", TERM="xterm")
  env.pop("TF_USE_LEGACY_KERAS", None)
  command = [sys.executable, "-c", _IN_A_TERMINAL, "-c", WITH_DEFAULT_SIGINT,
             os.path.join(REPO_ROOT, "main.py"), *ARGS, "--data_path=" + data_file, "--logdir=" + logdir,
             "--epochs=%d" % epochs]
  process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdin=terminal.slave, stdout=terminal.slave,
                             stderr=terminal.slave, start_new_session=True)
  os.close(terminal.slave)
  try:
    deadline = time.monotonic() + 90
    while not re.search(r"Compilation and first step done.*\n.*\d+/%d \[" % STEPS, terminal.text()):
      assert process.poll() is None and time.monotonic() < deadline, terminal.text()[-3000:]
      time.sleep(0.02)
    terminal.hang_up()
    status = process.wait(timeout=60)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  log_file = os.path.join(logdir, "log.txt")  # what the run wrote after the terminal was gone
  assert status == 128 + signal.SIGHUP, terminal.text()[-2000:] + (
      open(log_file).read()[-3000:] if os.path.exists(log_file) else "")
  state = last_state(logdir)
  # Within epoch 1 (a step's checkpoint) or, on a loaded machine, at its end (the hang-up during its validation).
  assert (state["epoch"], state.get("step", 0)) > (0, 0) and state["epoch"] < epochs, state
  assert not os.path.exists(os.path.join(logdir, "summary.yaml"))
  # The stop's line went to a terminal that is gone: the run folder's log keeps it.
  with open(os.path.join(logdir, "log.txt")) as f:
    log = f.read()
  assert_names(line_naming(log, "interrupted by SIGHUP"), "Training interrupted", "SIGHUP", "epoch %d" % (
      state["epoch"] + 1 if "step" in state else state["epoch"]), "--resume --logdir=%s " % logdir,
               "(exit status 129)")
  output = run_to_end(logdir, data_file, "--epochs=%d" % epochs, "--resume")
  assert "Traceback" not in output and summary_of(logdir)["epochs"] == epochs, output[-3000:]


def test_under_nohup_a_hang_up_is_ignored_and_the_run_trains_on(tmp_path, data_file):
  logdir = str(tmp_path / "run")
  job = Job(logdir, data_file, "--epochs=2", prefix=("nohup",))
  try:
    job.wait_for(lambda: "Compilation and first step done" in job.output(), what="the first step")
    os.killpg(job.process.pid, signal.SIGHUP)
    status = job.wait(60)
    output = job.output()
  finally:
    job.close()
  assert status == 0 and "Run finished" in output and "SIGHUP" not in output, output[-3000:]
