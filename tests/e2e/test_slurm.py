"""The job scripts on a real Slurm: a one-node cluster on localhost (tools/slurm/local_cluster.sh).

Run with `make test-slurm`, which installs Slurm and munge where it can; the main suite leaves these
tests out (marker `slurm`). Each test trains the dev design of neuron_inverter on a small cellSpike
file with two CPU workers found through Slurm's variables.
"""

import os
import re
import shlex
import subprocess
import sys
import time

import pytest
import yaml

from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import REPO_ROOT, assert_names, line_naming, other_process_report
from training.checkpoints import read_index

pytestmark = pytest.mark.slurm

SLURM_TOOLS = os.path.join(REPO_ROOT, "tools", "slurm")
JOB_SECONDS = 600
TERM_STEPS = 200  # steps per epoch of the interrupted run: seconds of training, time for the signal
# On CPUs: 2 tasks on the one node, no GPUs, one core each (the script's defaults are for GPU nodes).
CPU_TASKS = ["--ntasks-per-node=2", "--gpus-per-task=0", "--cpus-per-task=1"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  """Starts the cluster; yields the environment for Slurm commands (SLURM_CONF, PYTHON, APP_DIR)."""
  folder = str(tmp_path_factory.mktemp("slurm"))
  script = os.path.join(SLURM_TOOLS, "local_cluster.sh")
  started = subprocess.run([script, "start", folder], capture_output=True, text=True, timeout=120)
  assert started.returncode == 0, started.stderr
  env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  env.update(SLURM_CONF=os.path.join(folder, "slurm.conf"), PYTHON=sys.executable, APP_DIR=REPO_ROOT)
  yield env
  subprocess.run([script, "stop", folder], check=True, timeout=120)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
  return write_cellspike(str(tmp_path_factory.mktemp("data") / "cell.h5"),
                         sizes={"train": 8192, "val": 64, "test": 64})


def _train_args(data_path, logdir=None, steps=3):
  return ["--backend=cpu", "--nojit_compile", "--design=dev", "--batch_size=16", "--epochs=2",
          "--steps_per_epoch=%d" % steps, "--eval_steps=1", "--cache_dir=", "--data_path=" + data_path
          ] + (["--logdir=" + logdir] if logdir else [])


def _sbatch(env, cwd, *args):
  result = subprocess.run(["sbatch", "--parsable"] + list(args), env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  return result.stdout.strip().split(";")[0]


def _job(env, job_id) -> dict:
  text = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True,
                        check=True).stdout
  return dict(re.findall(r"(\w+)=(\S+)", text))


def _wait_for_job(env, job_id, timeout=JOB_SECONDS) -> dict:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    job = _job(env, job_id)
    if job["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
      return job
    time.sleep(1)
  subprocess.run(["scancel", job_id], env=env)
  raise AssertionError("job %s did not finish within %d s" % (job_id, timeout))


def _wait_for_text(path, text, env, job_id, timeout=JOB_SECONDS):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path) and text in open(path).read():
      return
    assert _job(env, job_id)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), \
        open(path).read()[-3000:] if os.path.exists(path) else "no output"
    time.sleep(0.5)
  raise AssertionError("%r not in %s within %d s" % (text, path, timeout))


def _event_writers(folder: str) -> set:
  """Process ids in the names of the event files under `folder` (events.out.tfevents.TIME.HOST.PID.N.v2)."""
  return {name.split(".")[5] for _, _, names in os.walk(folder) for name in names
          if name.startswith("events.out.tfevents.")}


def _check_two_workers_trained(output: str, logdir: str, chief_runs: int = 1) -> dict:
  assert_names(line_naming(output, "rank 0 of 2"), "Multi-worker", "slurm", "(chief)")
  assert_names(line_naming(output, "rank 1 of 2"), "Multi-worker", "slurm")
  summary = yaml.safe_load(open(os.path.join(logdir, "summary.yaml")))
  worker_dir, worker_weights = other_process_report(output)
  assert summary["world_size"] == 2 and summary["replicas"] == 2 and summary["rank"] == 0
  assert worker_weights == summary["weights_sha256"]
  # Only the chief writes to the run folder: the other worker's events (their file names carry the
  # writing process's id) and checkpoints went to a scratch folder elsewhere, removed at its end.
  assert os.path.commonpath([worker_dir, logdir]) != logdir and not os.path.exists(worker_dir)
  assert len(_event_writers(logdir)) == chief_runs
  return summary


def test_sbatch_and_srun_train_two_workers_found_through_slurm(slurm, data_path, tmp_path):
  job_id = _sbatch(slurm, str(tmp_path), *CPU_TASKS, os.path.join(SLURM_TOOLS, "gpu.sbatch"),
                   *_train_args(data_path, str(tmp_path / "sbatch-run")))
  job = _wait_for_job(slurm, job_id)
  output = open(tmp_path / ("neuron-inverter-gpu-%s.out" % job_id)).read()
  assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
  by_sbatch = _check_two_workers_trained(output, str(tmp_path / "sbatch-run"))

  # The same run started by hand with srun: the same workers, the same trained weights.
  by_hand = subprocess.run(["srun", "-n", "2", "--cpus-per-task=1", sys.executable,
                            os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter"]
                           + _train_args(data_path, str(tmp_path / "srun-run")),
                           env=slurm, cwd=str(tmp_path), capture_output=True, text=True, timeout=JOB_SECONDS)
  assert by_hand.returncode == 0, by_hand.stderr[-3000:]
  by_srun = _check_two_workers_trained(by_hand.stdout + by_hand.stderr, str(tmp_path / "srun-run"))
  assert by_srun["weights_sha256"] == by_sbatch["weights_sha256"]


def test_scancel_term_mid_epoch_checkpoints_and_the_resubmitted_job_finishes(slurm, data_path, tmp_path):
  logdir = str(tmp_path / "run")
  script = os.path.join(SLURM_TOOLS, "gpu.sbatch")
  job_id = _sbatch(slurm, str(tmp_path), *CPU_TASKS, script, *_train_args(data_path, logdir, steps=TERM_STEPS))
  output_path = str(tmp_path / ("neuron-inverter-gpu-%s.out" % job_id))
  _wait_for_text(output_path, "Compilation and first step done", slurm, job_id)
  subprocess.run(["scancel", "--signal=TERM", job_id], env=slurm, check=True)
  job = _wait_for_job(slurm, job_id)
  output = open(output_path).read()
  assert job["ExitCode"] == "143:0", output[-3000:]
  # Both tasks exit 143; srun reports them on one line ("tasks 0-1") or, a moment apart, on two.
  exited = re.findall(r"tasks? ([\d-]+): Exited with exit code 143", output)
  assert sorted(exited) in (["0-1"], ["0", "1"]), output[-3000:]
  stops = re.findall(r"SIGTERM in epoch 1 .*step (\d+) of %d" % TERM_STEPS, output)
  assert len(stops) == 2 and stops[0] == stops[1], output[-3000:]
  assert read_index(os.path.join(logdir, "checkpoints", "last"))[-1] == "ckpt-0-step" + stops[0]

  # The chief's report gives the job again, its flags as given, then the run's folder: the test submits
  # that. No python line: a batch job is continued by a new job.
  assert output.count("Continue with:") == 1 and "main.py --model" not in output, output[-3000:]
  hint = shlex.split(output[output.index("Continue with:\n"):].splitlines()[1])
  assert hint[:2] == ["sbatch", script] and hint[-3:] == ["--logdir=" + logdir, "--resume", "--epochs=2"], hint
  resumed_id = _sbatch(slurm, str(tmp_path), *CPU_TASKS, script, *hint[2:])
  resumed = _wait_for_job(slurm, resumed_id)
  output = open(tmp_path / ("neuron-inverter-gpu-%s.out" % resumed_id)).read()
  assert (resumed["JobState"], resumed["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
  assert_names(line_naming(output, "continuing with epoch"), "epoch 1 of 2",
               "step %d of %d" % (int(stops[0]) + 1, TERM_STEPS))
  summary = _check_two_workers_trained(output, logdir, chief_runs=2)  # stopped, then resumed
  assert summary["history"]["epoch"] == [1, 2]  # the epochs of an uninterrupted run


def test_a_job_array_scan_reports_every_point(slurm, data_path, tmp_path):
  scan_dir = str(tmp_path / "scan")
  env = dict(slurm)
  submitted = subprocess.run(
      [sys.executable, os.path.join(REPO_ROOT, "tools", "scan.py"), "--mode=slurm", "--scan_dir=" + scan_dir,
       "--learning_rates=1e-3,3e-3,-1", "--replicas=1", "--sbatch_args=--cpus-per-task=1", "--",
       "--model=neuron_inverter"] + _train_args(data_path),
      env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
  assert submitted.returncode == 0, submitted.stderr
  report_id = re.search(r"report job (\d+)", submitted.stdout).group(1)
  report = _wait_for_job(slurm, report_id)
  assert report["ExitCode"] == "1:0"  # one point failed: the report says so
  table = yaml.safe_load(open(os.path.join(scan_dir, "scan.yaml")))
  statuses = {row["name"]: row["status"] for row in table["points"]}
  assert statuses == {"replicas1_lr0.001": "finished", "replicas1_lr0.003": "finished",
                      "replicas1_lr-1": "failed"}
  assert table["not_finished"] == ["replicas1_lr-1"]
  assert os.path.getsize(os.path.join(scan_dir, "scan.png")) > 10000
  assert len([name for name in os.listdir(scan_dir) if re.match(r"slurm-\d+_\d\.out$", name)]) == 3
