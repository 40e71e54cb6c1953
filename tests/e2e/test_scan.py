"""tools/scan.py: a learning-rate scan run serially with real trainings; failed points are listed."""

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from analysis.events import read_hparams
from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import REPO_ROOT

SCAN = os.path.join(REPO_ROOT, "tools", "scan.py")


def _scan(*args):
  env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  return subprocess.run([sys.executable, SCAN] + list(args), cwd=REPO_ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def _main_args(data_path):
  return ["--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16", "--epochs=1",
          "--steps_per_epoch=2", "--eval_steps=1", "--data_path=" + data_path]


def test_a_serial_scan_reports_every_point_and_lists_the_failed_one(tmp_path):
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 128, "val": 32, "test": 32})
  scan_dir = str(tmp_path / "scan")
  result = _scan("--scan_dir=" + scan_dir, "--learning_rates=1e-3,3e-3,-1", "--replicas=2", "--",
                 *_main_args(data_path))
  assert result.returncode == 1, result.stdout + result.stderr
  assert "error: 1 of 3 scan points did not finish: replicas2_lr-1" in result.stdout
  table = yaml.safe_load(open(os.path.join(scan_dir, "scan.yaml")))
  rows = {row["name"]: row for row in table["points"]}
  assert sorted(rows) == ["replicas2_lr-1", "replicas2_lr0.001", "replicas2_lr0.003"]
  assert rows["replicas2_lr-1"]["status"] == "failed" and rows["replicas2_lr-1"]["returncode"] != 0
  assert "learning_rate" in rows["replicas2_lr-1"]["error"]
  for name in ("replicas2_lr0.001", "replicas2_lr0.003"):
    summary = yaml.safe_load(open(os.path.join(scan_dir, name, "summary.yaml")))
    assert summary["replicas"] == 2 and summary["params"]["learning_rate"] == rows[name]["learning_rate"]
    assert rows[name]["best_val_loss"] == pytest.approx(summary["best_val_loss"])
    trial, settings = read_hparams(os.path.join(scan_dir, name))  # TensorBoard's HParams row of the point
    assert trial == name and settings["replicas"] == 2
    assert settings["learning_rate"] == pytest.approx(rows[name]["learning_rate"])
  assert table["best"]["name"] in ("replicas2_lr0.001", "replicas2_lr0.003")
  assert "best: %s, validation loss %.4f (epoch 1)" % (table["best"]["name"], table["best"]["best_val_loss"]) \
      in result.stdout
  assert os.path.getsize(os.path.join(scan_dir, "scan.png")) > 10000

  # Run again: the finished points are skipped, the failed one is tried again (and fails again).
  again = _scan("--scan_dir=" + scan_dir, "--learning_rates=1e-3,3e-3,-1", "--replicas=2", "--",
                *_main_args(data_path))
  assert again.stdout.count("finished earlier, skipped") == 2 and again.returncode == 1
  # Another grid in the same folder is refused.
  other = _scan("--scan_dir=" + scan_dir, "--learning_rates=1e-2", "--", *_main_args(data_path))
  assert other.returncode == 1 and "holds another scan's grid" in other.stderr


def test_a_scan_folder_that_cannot_be_written_is_one_error_line(tmp_path):
  (tmp_path / "a_file").write_text("x")
  scan_dir = str(tmp_path / "a_file" / "scan")
  result = _scan("--scan_dir=" + scan_dir, "--learning_rates=1e-3", "--", "--epochs=1")
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.splitlines() == ["error: --scan_dir=%s: cannot write %s/grid.yaml (Not a directory)"
                                        % (scan_dir, scan_dir)]


def test_ctrl_c_stops_the_point_with_a_checkpoint_and_the_scan_continues_it(tmp_path):
  """Ctrl-C on a serial scan: the running point's main.py stops gracefully (its checkpoint saved, not
  killed mid-save), the scan ends in one line with status 130, and the same command resumes it."""
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 128, "val": 32, "test": 32})
  scan_dir = str(tmp_path / "scan")
  args = ["--scan_dir=" + scan_dir, "--learning_rates=1e-3,2e-3", "--replicas=1", "--"] + [
      arg for arg in _main_args(data_path) if not arg.startswith(("--epochs", "--steps_per_epoch"))] + [
      "--epochs=2", "--steps_per_epoch=400"]
  env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  scan = subprocess.Popen([sys.executable, SCAN] + args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  log = os.path.join(scan_dir, "replicas1_lr0.001.log")
  deadline = time.time() + 120
  while not (os.path.exists(log) and "first step done" in open(log).read()):
    assert scan.poll() is None and time.time() < deadline, scan.communicate()
    time.sleep(0.1)
  scan.send_signal(signal.SIGINT)
  out, err = scan.communicate(timeout=120)
  assert scan.returncode == 130, out + err
  assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted by SIGINT: the scan "
                                                                            "stopped"), err
  assert "Training interrupted by SIGINT" in open(log).read()  # a graceful stop, with its checkpoint
  assert "replicas1_lr0.002" not in out                         # the next point did not start
  again = _scan(*args)
  assert again.returncode == 0, again.stdout + again.stderr
  assert "--resume" in again.stdout.splitlines()[0]             # the stopped point continued
  assert "Resumed from" in open(log).read()
