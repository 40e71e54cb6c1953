"""A run's first lines name its folder and the commands that watch it; a folder the command may not use is
refused before TensorFlow starts; history.csv holds a row per epoch, appended by --resume.

A tiny run (dev design, short epochs) is trained once for the module. The refusals run main.py with a
stand-in `tensorflow` package first on PYTHONPATH, which ends the process if anything imports it.
"""

import csv
import math
import os
import shutil

import pytest

from tests.support.helpers import assert_one_line_error, run_main

RUN_FLAGS = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16", "--precision=32.32",
             "--warmup_epochs=0", "--steps_per_epoch=2", "--eval_steps=1")
NO_TENSORFLOW = "stand-in-tensorflow-imported"  # what the stand-in package says when imported


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, contiguous_data_file):
  """(logdir, the run's CompletedProcess): 2 epochs."""
  logdir = str(tmp_path_factory.mktemp("runs") / "run")
  result = run_main(*RUN_FLAGS, "--data_path=" + contiguous_data_file, "--logdir=" + logdir, "--epochs=2")
  assert result.returncode == 0, result.stderr[-3000:]
  return logdir, result


@pytest.fixture
def run(tmp_path, finished_run):
  copy = str(tmp_path / "run")
  shutil.copytree(finished_run[0], copy, symlinks=True)
  return copy


@pytest.fixture(scope="module")
def without_tensorflow(tmp_path_factory):
  """The environment of a main.py that must not import TensorFlow: a stand-in package that exits."""
  folder = tmp_path_factory.mktemp("stand_in")
  (folder / "tensorflow").mkdir()
  (folder / "tensorflow" / "__init__.py").write_text(
      "import sys\nsys.stderr.write(%r)\nsys.exit(3)\n" % (NO_TENSORFLOW + "\n"))
  return {"PYTHONPATH": str(folder)}


def snapshot(folder):
  state = {}
  for root, dirs, files in os.walk(folder):
    for name in dirs + files:
      path = os.path.join(root, name)
      key = os.path.relpath(path, folder)
      if os.path.islink(path):
        state[key] = "link to " + os.readlink(path)
      elif os.path.isdir(path):
        state[key] = "folder"
      else:
        with open(path, "rb") as f:
          state[key] = f.read()
  return state


def read_history(logdir):
  with open(os.path.join(logdir, "history.csv"), newline="") as f:
    return list(csv.DictReader(f))


def test_the_first_lines_name_the_run_folder_and_how_to_watch_it(finished_run):
  logdir, result = finished_run
  first = result.stdout.splitlines()[:3]
  assert first[0] == "Run folder: " + logdir, result.stdout[:1000]
  assert first[1].startswith("  watch: ") and first[1].endswith(" --logdir " + logdir)
  assert "tools/serve_tensorboard.py" in first[1]
  assert first[2] == "  tail -F " + os.path.join(logdir, "log.txt")


def test_history_csv_has_a_row_per_epoch_and_a_resume_appends(finished_run, run, contiguous_data_file):
  logdir, result = finished_run
  rows = read_history(logdir)
  assert [row["epoch"] for row in rows] == ["1", "2"]
  with open(os.path.join(logdir, "history.csv")) as f:
    header = f.readline().strip().split(",")
  assert header[0] == "epoch" and header[1:] == sorted(header[1:])
  for column in ("loss", "val_loss", "lr", "samples_per_sec", "epoch_seconds"):
    assert column in header, header
  assert all(math.isfinite(float(row[key])) for row in rows for key in ("loss", "val_loss", "lr"))
  assert float(rows[1]["samples_per_sec"]) > 0
  outputs = [line for line in result.stdout.splitlines() if line.startswith("  outputs: ")]
  assert len(outputs) == 1 and "history.csv" in outputs[0], result.stdout[-2000:]

  resumed = run_main(*RUN_FLAGS, "--data_path=" + contiguous_data_file, "--logdir=" + run, "--resume", "--epochs=3")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert resumed.stdout.startswith("Run folder: " + run + "\n")
  rows = read_history(run)
  assert [row["epoch"] for row in rows] == ["1", "2", "3"]
  with open(os.path.join(run, "history.csv")) as f:
    assert f.read().count("epoch,") == 1


def test_a_resume_drops_the_rows_of_epochs_it_trains_again(tmp_path):
  """A run killed after an epoch's row but before its checkpoint: the resumed run trains that epoch again."""
  from training.callbacks import HistoryCSV  # pylint: disable=import-outside-toplevel
  path = tmp_path / "history.csv"
  path.write_text("epoch,loss\n1,0.5\n2,0.4\n3,0.3\n")
  history = HistoryCSV(str(tmp_path), done=2)
  history.on_train_begin()
  history.on_epoch_end(2, {"loss": 0.25, "val_loss": 0.3})
  history.on_train_begin()  # the second fit of a resume within an epoch
  assert path.read_text() == "epoch,loss\n1,0.5\n2,0.4\n3,0.25\n"


@pytest.mark.parametrize("case", ["finished", "resume_of_nothing", "link_at_history"])
def test_a_refused_folder_is_refused_before_tensorflow_starts_and_left_as_it_was(
    case, run, contiguous_data_file, tmp_path, without_tensorflow):
  flags, logdir = ("--epochs=2",), run
  if case == "finished":
    fragments = ("--logdir=" + run, "already holds a run")
  elif case == "resume_of_nothing":
    logdir = str(tmp_path / "nothing")
    flags, fragments = ("--resume", "--epochs=2"), ("--resume", "no run to continue")
  else:
    victim = tmp_path / "precious.txt"
    victim.write_text("kept")
    os.remove(os.path.join(run, "history.csv"))
    os.symlink(str(victim), os.path.join(run, "history.csv"))
    flags, fragments = ("--resume", "--epochs=3"), (os.path.join(run, "history.csv"), "symbolic link")
  before = snapshot(run)
  result = run_main(*RUN_FLAGS, "--data_path=" + contiguous_data_file, "--logdir=" + logdir, *flags, env=without_tensorflow)
  assert_one_line_error(result, *fragments)
  assert NO_TENSORFLOW not in result.stderr and "Run folder" not in result.stdout
  assert snapshot(run) == before
  assert os.path.exists(logdir) == (logdir == run)
  if case == "link_at_history":
    assert victim.read_text() == "kept"
