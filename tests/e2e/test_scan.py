"""tools/scan.py: a learning-rate scan run serially with real trainings; failed points are listed."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from analysis.events import read_hparams
from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import REPO_ROOT, WITH_DEFAULT_SIGHUP, assert_names, assert_one_line_error, line_naming
from tools import scan

SCAN = os.path.join(REPO_ROOT, "tools", "scan.py")


def _scan(*args):
  env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  return subprocess.run([sys.executable, SCAN] + list(args), cwd=REPO_ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def _main_args(data_path):
  return ["--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16", "--epochs=1",
          "--steps_per_epoch=2", "--eval_steps=1", "--data_path=" + data_path]


def _scan_in(folder, *args, **env):
  """tools/scan.py run from `folder` (a user's own), with more environment variables."""
  environment = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  environment.update(env)
  return subprocess.run([sys.executable, SCAN] + list(args), cwd=str(folder), env=environment,
                        capture_output=True, text=True, timeout=600)


def test_a_serial_scan_reports_every_point_and_lists_the_failed_one(tmp_path):
  """Typed in the user's folder with a relative --scan_dir and --data_path=data.h5: each point's main.py
  runs there, so the two good points train (they ran in the repository, where data.h5 did not exist),
  and the third, whose rate main.py refuses, is reported and makes the exit status 1."""
  write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 128, "val": 32, "test": 32})
  scan_dir = str(tmp_path / "scan")  # --scan_dir=scan, made absolute by the scan
  result = _scan_in(tmp_path, "--scan_dir=scan", "--learning_rates=1e-3,3e-3,-1", "--replicas=2", "--",
                    *_main_args("data.h5"))
  assert result.returncode == 1, result.stdout + result.stderr
  assert_names(result.stdout, "error: 1 of 3", "replicas2_lr-1")
  # Each point's line starts with an interpreter, so it can be pasted: the tool's own, as a user types it,
  # and the words are quoted for the shell (a checkout in a folder whose name has a space). The flags
  # after `--` are kept as typed (the relative data.h5, for the point run in the same folder); main.py
  # and the logdir are absolute.
  line = next(line for line in result.stdout.splitlines() if line.startswith("point 0 (replicas2_lr0.001): "))
  words = shlex.split(line.split(": ", 1)[1])
  assert re.fullmatch(r"\S*python[\d.]*", words[0]) and words[1] == os.path.join(REPO_ROOT, "main.py"), line
  assert words[2:-2] == _main_args("data.h5") + [
      "--learning_rate=0.001", "--replicas=2", "--logdir=" + os.path.join(scan_dir, "replicas2_lr0.001")], line
  assert words[-2:] == [">", os.path.join(scan_dir, "replicas2_lr0.001.log")], line
  table = yaml.safe_load(open(os.path.join(scan_dir, "scan.yaml")))
  rows = {row["name"]: row for row in table["points"]}
  assert sorted(rows) == ["replicas2_lr-1", "replicas2_lr0.001", "replicas2_lr0.003"]
  assert rows["replicas2_lr-1"]["status"] == "failed" and rows["replicas2_lr-1"]["returncode"] != 0
  assert "learning_rate" in rows["replicas2_lr-1"]["error"]
  for name in ("replicas2_lr0.001", "replicas2_lr0.003"):
    # The relative --data_path was found: the point finished, its summary in the relative --scan_dir.
    # (The failed third point is why the scan's own exit status is 1, not 0.)
    assert rows[name]["status"] == "finished" and (tmp_path / "scan" / name / "summary.yaml").exists()
    summary = yaml.safe_load(open(os.path.join(scan_dir, name, "summary.yaml")))
    assert summary["replicas"] == 2 and summary["params"]["learning_rate"] == rows[name]["learning_rate"]
    assert rows[name]["best_val_loss"] == pytest.approx(summary["best_val_loss"])
    trial, settings = read_hparams(os.path.join(scan_dir, name))  # TensorBoard's HParams row of the point
    assert trial == name and settings["replicas"] == 2
    assert settings["learning_rate"] == pytest.approx(rows[name]["learning_rate"])
  assert table["best"]["name"] in ("replicas2_lr0.001", "replicas2_lr0.003")
  assert_names(line_naming(result.stdout, "best: "), table["best"]["name"], "validation loss",
               "%.4f (epoch 1)" % table["best"]["best_val_loss"])
  assert os.path.getsize(os.path.join(scan_dir, "scan.png")) > 10000

  # Run again: the finished points are skipped, the failed one is tried again (and fails again).
  again = _scan_in(tmp_path, "--scan_dir=scan", "--learning_rates=1e-3,3e-3,-1", "--replicas=2", "--",
                   *_main_args("data.h5"))
  assert again.stdout.count("finished earlier, skipped") == 2 and again.returncode == 1
  # Another grid in the same folder is refused.
  other = _scan_in(tmp_path, "--scan_dir=scan", "--learning_rates=1e-2", "--", *_main_args("data.h5"))
  assert other.returncode == 1 and "holds another scan's grid" in other.stderr


def test_a_scan_folder_that_cannot_be_written_is_one_error_line(tmp_path):
  (tmp_path / "a_file").write_text("x")
  scan_dir = str(tmp_path / "a_file" / "scan")
  result = _scan("--scan_dir=" + scan_dir, "--learning_rates=1e-3", "--", "--epochs=1")
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  (line,) = result.stderr.splitlines()
  assert line.startswith("error: --scan_dir=%s: " % scan_dir), line
  assert_names(line, "cannot write", "%s/grid.yaml" % scan_dir, "Not a directory")


def _scan_signalled_in_its_first_point(tmp_path, signum, learning_rates):
  """A serial scan signalled once its first point has trained a step; returns (its args, exit status,
  stdout, stderr, the point's log)."""
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 128, "val": 32, "test": 32})
  scan_dir = str(tmp_path / "scan")
  args = ["--scan_dir=" + scan_dir, "--learning_rates=" + learning_rates, "--replicas=1", "--"] + [
      arg for arg in _main_args(data_path) if not arg.startswith(("--epochs", "--steps_per_epoch"))] + [
      "--epochs=2", "--steps_per_epoch=400"]
  env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  scan = subprocess.Popen([sys.executable, "-c", WITH_DEFAULT_SIGHUP, SCAN] + args, cwd=REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  log = os.path.join(scan_dir, "replicas1_lr0.001.log")
  deadline = time.time() + 120
  while not (os.path.exists(log) and "first step done" in open(log).read()):
    assert scan.poll() is None and time.time() < deadline, scan.communicate()
    time.sleep(0.1)
  scan.send_signal(signum)
  out, err = scan.communicate(timeout=120)
  return args, scan.returncode, out, err, log


def test_ctrl_c_stops_the_point_with_a_checkpoint_and_the_scan_continues_it(tmp_path):
  """Ctrl-C on a serial scan: the running point's main.py stops gracefully (its checkpoint saved, not
  killed mid-save), the scan ends in one line with status 130 before the next point, and the same
  command resumes the point to its end and goes on to the next one. That next point has a rate main.py
  refuses before TensorFlow starts: whether it ran shows in the report, without a second training."""
  args, status, out, err, log = _scan_signalled_in_its_first_point(tmp_path, signal.SIGINT, "1e-3,-1")
  assert status == 130, out + err
  assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted by SIGINT"), err
  assert "SIGINT" in line_naming(open(log).read(), "Training interrupted")  # a graceful stop, with its checkpoint
  assert "replicas1_lr-1" not in out                            # the next point did not start
  again = _scan(*args)
  # Status 1 for the refused next point alone (0 when that point trained): the resumed one finished.
  assert again.returncode == 1, again.stdout + again.stderr
  assert_names(again.stdout, "error: 1 of 2", "replicas1_lr-1")
  assert "--resume" in again.stdout.splitlines()[0]             # the stopped point continued
  statuses = {line.split(": ")[0]: line for line in again.stdout.splitlines() if "exit status" in line}
  assert "exit status 0" in statuses["point 0 (replicas1_lr0.001)"], again.stdout
  assert "Resumed from" in open(log).read()
  assert "point 1 (replicas1_lr-1)" in statuses, again.stdout  # and the scan went on to the next point


@pytest.mark.parametrize("rates, replicas, names", [(["nan"], ["1"], ["--learning_rates", "value nan"]),
                                                 (["1e-3", "inf"], ["1"], ["--learning_rates", "value inf"]),
                                                 (["1e-3"], ["4", "0"], ["--replicas", "value 0"])])
def test_grid_values_no_point_could_run_with_are_refused_at_once(rates, replicas, names):
  """Refused before any point runs, not one failed point each (in folders such as replicas0_lrnan)."""
  with pytest.raises(scan.ScanError) as caught:
    scan.make_grid(rates, replicas, ["--model=neuron_inverter"])
  assert_names(caught.value, *names)


@pytest.mark.parametrize("main_arg, flag, own", [("--learning_rate=5", "learning_rate", "--learning_rates"),
                                                ("-replicas", "replicas", "--replicas"),
                                                ("--logdir=logs/mine", "logdir", "--scan_dir")])
def test_main_py_flags_that_the_scan_sets_itself_are_refused(main_arg, flag, own):
  """After `--` they were silently overridden by each point's own."""
  with pytest.raises(scan.ScanError) as error:
    scan.make_grid(["1e-3"], ["1"], ["--model=neuron_inverter", main_arg, "3"])
  assert_names(error.value, main_arg, "--" + flag, own)


def _scan_dir(tmp_path):
  scan_dir = str(tmp_path / "scan")
  scan.save_grid(scan_dir, scan.make_grid(["1e-3"], ["1"], ["--epochs=1"]))
  return scan_dir


@pytest.mark.parametrize("text, expected", [
    ("points: [\n", "not valid YAML"),
    ("[1, 2]\n", "scan grid"),
    ("main_args: []\npoints: [{index: 0}]\n", "scan grid"),
])
def test_a_damaged_grid_is_one_error(tmp_path, text, expected):
  scan_dir = _scan_dir(tmp_path)
  with open(scan.grid_path(scan_dir), "w") as f:
    f.write(text)
  for mode in ("report", "point"):
    result = _scan("--scan_dir=" + scan_dir, "--mode=" + mode, "--point=0")
    assert_one_line_error(result, os.path.join(scan_dir, "grid.yaml"), expected)


@pytest.mark.parametrize("text, names", [
    ("returncode: [\n", ["unreadable"]), ("hello\n", ["no mapping"]),
    ("returncode: x\n", ["returncode is 'x'", "exit status"]),
])
def test_a_damaged_status_file_is_one_error(tmp_path, text, names):
  scan_dir = _scan_dir(tmp_path)
  point = scan.load_grid(scan_dir)["points"][0]
  with open(os.path.join(scan_dir, point["name"] + ".status.yaml"), "w") as f:
    f.write(text)
  with pytest.raises(scan.ScanError) as error:
    scan.report(scan_dir)
  assert str(error.value).startswith(os.path.join(scan_dir, point["name"] + ".status.yaml"))
  assert_names(error.value, *names, "delete it")


@pytest.mark.parametrize("task, names", [
    ("abc", ["SLURM_ARRAY_TASK_ID=abc", "--point=<index>"]),
    (None, ["--mode=point", "--point=<index>", "SLURM_ARRAY_TASK_ID"]),
])
def test_a_point_without_its_index_is_one_error(monkeypatch, task, names):
  if task is None:
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
  else:
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
  with pytest.raises(scan.ScanError) as caught:
    scan._array_task_id()  # pylint: disable=protected-access
  assert_names(caught.value, *names)


def _fake_sbatch(tmp_path):
  """An sbatch that records each call's arguments (NUL-separated) and folder, and prints a job id."""
  calls = tmp_path / "sbatch_calls"
  calls.mkdir()
  fake = tmp_path / "bin" / "sbatch"
  fake.parent.mkdir()
  fake.write_text('#!/bin/sh\nn=$(ls %s | grep -c call)\nprintf "%%s\\0" "$@" > %s/call$n\npwd > %s/cwd$n\n'
                  'echo 4$n\n' % (calls, calls, calls))
  fake.chmod(0o755)
  return calls


def test_slurm_mode_keeps_quoted_options_and_its_points_run_in_the_submit_folder(tmp_path):
  """--sbatch_args was split on blanks (--comment='lr scan' became two words) and the report job's
  --wrap command was unquoted; the array task (tools/slurm/scan.sbatch, run here as Slurm would) runs
  its point in the submit folder, where a relative --data_path is."""
  calls = _fake_sbatch(tmp_path)
  work = tmp_path / "work"
  work.mkdir()
  write_cellspike(str(work / "data.h5"), sizes={"train": 128, "val": 32, "test": 32})
  path = "%s:%s" % (tmp_path / "bin", os.environ["PATH"])
  result = _scan_in(work, "--mode=slurm", "--scan_dir=my scan", "--learning_rates=1e-3",
                    "--sbatch_args=--comment='lr scan' --time=5", "--", *_main_args("data.h5"), PATH=path)
  assert result.returncode == 0, result.stdout + result.stderr
  array, report_job = [(calls / name).read_text().split("\0")[:-1] for name in ("call0", "call1")]
  scan_dir = str(work / "my scan")
  assert array[-4:] == ["--comment=lr scan", "--time=5", os.path.join(REPO_ROOT, "tools", "slurm", "scan.sbatch"),
                        scan_dir]
  (wrap,) = [arg[len("--wrap="):] for arg in report_job if arg.startswith("--wrap=")]
  assert shlex.split(wrap) == [sys.executable, SCAN, "--mode=report", "--scan_dir=" + scan_dir]
  submit_dir = (calls / "cwd0").read_text().strip()
  env = dict(os.environ, SLURM_SUBMIT_DIR=submit_dir, SLURM_ARRAY_TASK_ID="0", PYTHON=sys.executable,
             APP_DIR=REPO_ROOT)
  task = subprocess.run(["bash", os.path.join(REPO_ROOT, "tools", "slurm", "scan.sbatch"), scan_dir], env=env,
                        cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
  assert task.returncode == 0, task.stdout + task.stderr + open(os.path.join(scan_dir, "replicas1_lr0.001.log")).read()
  reported = subprocess.run(["bash", "-c", wrap], cwd=submit_dir, capture_output=True, text=True, timeout=120)
  assert reported.returncode == 0 and "best: replicas1_lr0.001" in reported.stdout, reported.stdout + reported.stderr


def test_sbatch_args_a_shell_could_not_split_are_one_error_before_anything_is_written(tmp_path):
  result = _scan_in(tmp_path, "--mode=slurm", "--scan_dir=scan", "--learning_rates=1e-3",
                    "--sbatch_args=--comment='lr scan", "--", "--epochs=1")
  assert_one_line_error(result, "--sbatch_args", "--comment='lr scan", "No closing quotation")
  assert not (tmp_path / "scan").exists()


def test_an_mnist_scan_is_ranked_by_the_validation_loss(tmp_path):
  """--model=mnist validates every epoch on digits held out of its training set: the points are ranked
  by their best validation loss, as the neuron_inverter's, never by the test loss."""
  result = _scan_in(tmp_path, "--scan_dir=scan", "--learning_rates=1e-3,2e-3", "--", "--model=mnist",
                    "--synthetic_data", "--epochs=1", "--steps_per_epoch=2", "--eval_steps=1")
  assert result.returncode == 0, result.stdout + result.stderr
  table = yaml.safe_load(open(str(tmp_path / "scan" / "scan.yaml")))
  assert table["ranked_by"] == "best_val_loss"
  best = min(table["points"], key=lambda row: row["best_val_loss"])
  assert table["best"]["name"] == best["name"] and 0 <= table["best"]["test_accuracy"] <= 1
  (line,) = [line for line in result.stdout.splitlines() if line.startswith("best: ")]
  assert_names(line, best["name"], "validation loss", "%.4f (epoch 1)" % best["best_val_loss"],
               "%.4f" % best["test_accuracy"])
  assert "ranked by their test loss" not in result.stdout
  assert os.path.getsize(str(tmp_path / "scan" / "scan.png")) > 10000


def _finished_point(scan_dir, point, summary):
  """A point as a finished run leaves it: its exit status and its summary.yaml."""
  with open(scan._status_path(scan_dir, point), "w") as f:  # pylint: disable=protected-access
    yaml.safe_dump({"returncode": 0, "seconds": 1.0}, f)
  os.makedirs(os.path.join(scan_dir, point["name"]))
  with open(os.path.join(scan_dir, point["name"], "summary.yaml"), "w") as f:
    yaml.safe_dump(dict(summary, wall_seconds=1.0), f)


def test_points_without_a_validation_loss_are_ranked_by_their_test_loss_and_the_report_says_so(tmp_path, capsys):
  """Summaries with no validation loss (best_val_loss: null): the test loss ranks them, in scan.yaml, the
  table's last line and the plot; with one point that has a validation loss, that one ranks."""
  scan_dir = str(tmp_path / "scan")
  scan.save_grid(scan_dir, scan.make_grid(["1e-3", "2e-3"], ["1"], ["--epochs=1"]))
  first, second = scan.load_grid(scan_dir)["points"]
  _finished_point(scan_dir, first, {"best_val_loss": None, "test_loss": 0.5, "test_accuracy": 0.8})
  _finished_point(scan_dir, second, {"best_val_loss": None, "test_loss": 0.25, "test_accuracy": 0.9})
  assert scan.report(scan_dir) == 0
  table = yaml.safe_load(open(os.path.join(scan_dir, "scan.yaml")))
  assert table["ranked_by"] == "test_loss" and table["best"]["name"] == second["name"]
  (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("best: ")]
  assert_names(line, second["name"], "test loss 0.2500", "0.9000", "ranked by their test loss")
  with open(os.path.join(scan_dir, first["name"], "summary.yaml"), "w") as f:
    yaml.safe_dump({"best_val_loss": 0.7, "best_val_epoch": 1, "test_loss": 0.5, "wall_seconds": 1.0}, f)
  assert scan.report(scan_dir) == 0
  table = yaml.safe_load(open(os.path.join(scan_dir, "scan.yaml")))
  assert table["ranked_by"] == "best_val_loss" and table["best"]["name"] == first["name"]


def test_the_report_drops_matplotlibs_info_lines(tmp_path):
  """A machine's first plot logged "generated new fontManager" at INFO; main.py and predict.py drop
  libraries' INFO lines (training/logs.py), and so does the scan."""
  scan_dir = _scan_dir(tmp_path)   # a point that did not run: the report still draws its plot
  result = _scan_in(tmp_path, "--mode=report", "--scan_dir=" + scan_dir, MPLCONFIGDIR=str(tmp_path / "mpl"))
  assert result.returncode == 1 and os.path.exists(os.path.join(scan_dir, "scan.png")), result.stderr
  assert result.stderr.splitlines() == [], result.stderr


@pytest.mark.parametrize("rates, replicas, names", [
    (["1e-3", "0.001"], ["1"], ["--learning_rates", "same value", "(1e-3 and 0.001)"]),
    (["1e-3", "2e-3"], ["4", "04", "1"], ["--replicas", "same value", "(4 and 04)"]),
])
def test_a_value_given_twice_is_refused(rates, replicas, names):
  """1e-3 and 0.001 were one folder, listed twice in the report with the same losses."""
  with pytest.raises(scan.ScanError) as caught:
    scan.make_grid(rates, replicas, ["--epochs=1"])
  assert_names(caught.value, *names, "each value once")


def test_distinct_rates_get_distinct_folders():
  """%g named both of these replicas1_lr0.00123457."""
  grid = scan.make_grid(["0.0012345671", "0.0012345679", "1", "5e-05"], ["1"], [])
  assert [point["name"] for point in grid["points"]] == [
      "replicas1_lr0.0012345671", "replicas1_lr0.0012345679", "replicas1_lr1", "replicas1_lr5e-05"]


def test_a_hang_up_stops_the_point_with_a_checkpoint_and_the_scan_with_status_129(tmp_path):
  """The points run in sessions of their own: a closing terminal's SIGHUP reaches the scan alone, which
  must stop its point too, not end on the spot and leave the point training on without it."""
  _, status, out, err, log = _scan_signalled_in_its_first_point(tmp_path, signal.SIGHUP, "1e-3")
  assert status == 129, out + err
  assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted by SIGHUP"), err
  assert "SIGHUP" in line_naming(open(log).read(), "Training interrupted")  # a graceful stop, with its checkpoint
