"""The training loop (training/loop.py) end to end through `python main.py` on neuron_inverter: 2 replicas,
checkpoints, resume, the learning-rate schedules, bad input met while training.

Each `python main.py` costs its TensorFlow start-up (about 5 s of CPU), so tests that can share one run
do: the module's fixtures run it once, and a test that continues a shared run (a resume) either is its
only writer or works on a copy (shutil.copytree)."""

import os
import shutil

import numpy as np
import pytest
import yaml

from strategies import cpu
from tests.support.cellspike_files import write_cellspike
from training import logs
from tests.support.helpers import assert_names, assert_one_line_error, line_naming, run_main
from analysis.events import read_scalars


@pytest.fixture(scope="module")
def fp16_file(tmp_path_factory):
  """A hand-made reference-format file: fp16, with the optional extra keys."""
  path = str(tmp_path_factory.mktemp("data") / "hand_made.h5")
  return write_cellspike(path, sizes={"train": 256, "val": 64, "test": 64}, dtype=np.float16)


def _run(data_path, logdir, *extra, **options):
  return run_main("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16",
                  "--data_path=" + data_path, "--logdir=" + logdir, "--warmup_epochs=1", *extra, **options)


def _summary(logdir):
  with open(os.path.join(logdir, "summary.yaml")) as f:
    return yaml.safe_load(f)


@pytest.fixture(scope="module")
def two_replicas_run(tmp_path_factory, fp16_file):
  """(result, logdir) of a 1-epoch run on 2 replicas: checked by test_two_replicas_one_epoch, and the
  run that test_resume_with_another_learning_rate_is_refused tries to resume (in a copy of its folder,
  which no test writes to)."""
  logdir = str(tmp_path_factory.mktemp("two_replicas") / "run")
  return _run(fp16_file, logdir, "--replicas=2", "--epochs=1"), logdir


_PLATEAU = ("--lr_schedule=plateau", "--lr_patience=0", "--lr_cooldown=0", "--lr_factor=0.5")


@pytest.fixture(scope="module")
def plateau_run(tmp_path_factory, fp16_file):
  """(result, logdir, summary) of a 2-epoch run on the plateau schedule, shown with Keras' bar
  (--progress=bar) and with stdout and stderr in one stream, as a terminal shows them: the run that
  test_resume_continues_epochs_and_schedule continues (the only test that writes to its folder), and
  whose output test_each_epoch_line_starts_a_line_of_its_own_after_the_progress_bar reads. Its summary is
  read here, before the resume replaces it."""
  logdir = str(tmp_path_factory.mktemp("plateau") / "run")
  result = _run(fp16_file, logdir, "--epochs=2", *_PLATEAU, "--progress=bar", one_stream=True)
  summary = _summary(logdir) if result.returncode == 0 else None
  return result, logdir, summary


def test_two_replicas_one_epoch(two_replicas_run):
  result, logdir = two_replicas_run
  assert result.returncode == 0, result.stderr[-3000:]
  assert_names(result.stdout, "Neuron-Inverter", "on CPU")
  assert_names(line_naming(result.stderr, "Global batch"), "Global batch 32 =", "16 per replica",
               "1 gradient accumulation", "2 replicas")
  # TensorFlow's one-off C++ lines of a first step and of the test evaluation are dropped
  # (the float16 file's frames are cast; the replicas are fed through tf.distribute's generators).
  for line in logs.ONE_OFF_NATIVE_LINES:
    assert line not in result.stderr, line
  assert result.stderr.index("Compiling the training") < result.stderr.index("Compilation and first")
  summary = _summary(logdir)
  assert summary["replicas"] == 2 and summary["global_batch_size"] == 32
  assert summary["steps_per_epoch"] == 8                       # 256 // 2 // 16
  assert np.isfinite(summary["val_loss"]) and np.isfinite(summary["test_loss"])
  assert "test_accuracy" not in summary
  assert summary["test_samples"] == 64  # 2 x 32
  assert_names(line_naming(result.stdout, "weights of epoch"), "(64 samples", "epoch 1)")
  assert summary["mean_predictor_val_loss"] == pytest.approx(1 / 3, rel=0.3)
  assert summary["best_val_epoch"] == 1 and summary["params"]["design"] == "dev"
  with open(os.path.join(logdir, "run_config.yaml")) as f:   # --precision=auto, resolved once for both
    recorded = yaml.safe_load(f)["precision"]
  assert summary["precision"] == summary["params"]["precision"] == recorded and recorded in ("16.32", "32.32")
  ratio = summary["best_val_loss"] / summary["mean_predictor_val_loss"]
  assert_names(line_naming(result.stdout, "validation: best"), "best %.4f" % summary["best_val_loss"], "%.3f" % ratio,
               "baseline %.4f" % summary["mean_predictor_val_loss"], "epoch 1")
  for which in ("last", "best"):
    assert os.path.isfile(os.path.join(logdir, "checkpoints", which, "checkpoint"))
  scalars = read_scalars(os.path.join(logdir, "train"))
  assert scalars["epoch_lr"][0][1] == pytest.approx(1e-3)
  assert "epoch_samples_per_sec_per_replica" in scalars and "epoch_seconds" in scalars
  assert "epoch_wall_seconds" in scalars and not any("epoch_epoch" in tag for tag in scalars)
  assert "epoch_learning_rate" not in scalars   # one rate chart: the schedule's epoch_lr
  assert "epoch_loss" in read_scalars(os.path.join(logdir, "validation"))


def test_resume_continues_epochs_and_schedule(plateau_run, fp16_file):
  """A resume trains on from the last epoch: epoch 3 only, from the restored weights and the plateau
  schedule's state. The first run is the shared `plateau_run`, whose stderr is in its stdout."""
  first, logdir, before = plateau_run
  assert first.returncode == 0, first.stdout[-3000:]
  epoch_2 = before["history"]["epoch_seconds"][1]   # the first carries the compilation: left out
  assert before["seconds_per_epoch"] == {"mean": pytest.approx(epoch_2), "std": 0.0, "epochs": 1}
  resumed = _run(fp16_file, logdir, "--epochs=3", *_PLATEAU, "--resume")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  after = _summary(logdir)
  assert "Resumed from" in resumed.stderr and after["first_epoch"] == 3
  assert after["history"]["epoch"] == [1, 2, 3]                 # the run's, across the resume
  assert after["history"]["loss"][:2] == pytest.approx(before["history"]["loss"])
  # The plateau state carried over: epoch 3 starts from the rate epoch 2 left, not the initial one.
  plateau_lr = before["history"]["lr"][-1]
  assert after["history"]["lr"][2] in (pytest.approx(plateau_lr), pytest.approx(plateau_lr * 0.5))
  assert after["history"]["loss"][2] < before["history"]["loss"][0]  # weights were restored, not re-initialised


def test_bad_data_path_is_one_line_error(tmp_path):
  bad = tmp_path / "bad.h5"
  bad.write_bytes(b"\x89HDF\r\n" + b"\0" * 100)
  result = _run(str(bad), str(tmp_path / "run"), "--epochs=1")
  assert_one_line_error(result, "bad.h5", "not a readable HDF5 file")
  # Found before TensorFlow's start (its 5 s): no line of TensorFlow's, nor of the backend it picks.
  assert result.stderr.startswith("error: ") and "Backend CPU" not in result.stderr, result.stderr
  assert not os.path.exists(str(tmp_path / "run"))


def test_nan_loss_stops_with_a_clear_error(tmp_path, fp16_file):
  result = _run(fp16_file, str(tmp_path / "run"), "--epochs=2", "--optimizer=sgd", "--learning_rate=1e5",
                "--warmup_epochs=0")
  assert_one_line_error(result, "NaN/Inf", "epoch 1", "checkpoint: none")
  assert not os.path.exists(os.path.join(str(tmp_path / "run"), "checkpoints", "last", "checkpoint"))


def test_resume_with_another_learning_rate_is_refused(tmp_path, fp16_file, two_replicas_run):
  """A checkpoint holds the learning rate it was trained with; a resume with another is refused. The
  run is the shared 2-replica one, resumed in a copy of its folder (test_two_replicas_one_epoch reads
  the original) with its --replicas=2, so that the learning rate is the only difference."""
  first, original = two_replicas_run
  assert first.returncode == 0
  logdir = str(tmp_path / "run")
  shutil.copytree(original, logdir)
  assert_one_line_error(_run(fp16_file, logdir, "--replicas=2", "--epochs=2", "--resume",
                             "--learning_rate=0.5"),
                        "learning_rate=0.001", "learning_rate=0.5")


def test_autotune_times_the_forms_once_then_reads_them_and_leaves_the_initial_weights_alone(tmp_path,
                                                                                           fp16_file):
  """--autotune=on in float32: the first run times the CPU's convolution forms and keeps the result in
  --cache_dir, the next reads it; training matches --autotune=off from the same seed (the throwaway
  models of the timing do not shift the initial weights).

  The cached run is also the --synthetic_data test: the file's shapes and step counts, random batches,
  named as such in summary.yaml. The autotune cache is keyed by the batches' shapes, not by where they
  come from (training/autotune.py cache_key), so it still reads the timed run's choice; the losses
  compared are the timed and off runs', both on the file."""
  cache, common = str(tmp_path / "cache"), ("--replicas=2", "--epochs=1", "--precision=32.32")
  runs = {}
  variants = (("timed", "on", ()), ("cached", "on", ("--synthetic_data",)), ("off", "off", ()))
  for name, mode, extra in variants:
    logdir = str(tmp_path / name)
    runs[name] = _run(fp16_file, logdir, *common, "--autotune=" + mode, "--cache_dir=" + cache, *extra)
    assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    runs[name].summary = _summary(logdir)
  timed, cached, off = runs["timed"], runs["cached"], runs["off"]
  # A fifth form where this machine compiled the first block's op: the built-in forms without it.
  compiled = bool(off.summary["layer_forms"].get("first_block_library"))
  assert_names(line_naming(timed.stdout, "Autotune: timing"), "%d forms" % (4 + compiled), "this CPU")
  assert timed.stdout.count(" s per step") == 4 + compiled and "(built-in)" in timed.stdout
  assert ("first_block_library=none: " in timed.stdout) == compiled
  assert "(timed on this machine)" in timed.stdout
  for line in logs.ONE_OFF_NATIVE_LINES:  # the timing runs the process's first steps: still dropped
    assert line not in timed.stderr, line
  assert logs.RETRACING_WARNING not in timed.stderr  # a model per form, traced on purpose
  assert "Autotune: timing" not in cached.stdout and "by an earlier run)" in cached.stdout
  assert "Autotune" not in off.stdout
  stored = os.listdir(os.path.join(cache, "autotune"))
  assert len(stored) == 1 and "timings in %s" % os.path.join(cache, "autotune", stored[0]) in timed.stdout
  assert [run.summary["layer_forms_chosen_by"] for run in (timed, cached, off)] == ["measured", "cached",
                                                                                   "built-in"]
  assert timed.summary["layer_forms"] == cached.summary["layer_forms"]
  assert timed.summary["machine"] == cpu.machine_signature()  # the CPU its step times were measured on
  # Every form computes the same function: from the same initial weights the losses agree to rounding.
  for key in ("train_loss", "val_loss"):
    assert timed.summary[key] == pytest.approx(off.summary[key], rel=1e-4)
  # --synthetic_data (the cached run; in float32 here, which these checks do not depend on).
  synthetic = cached.summary
  assert synthetic["data_source"].startswith("synthetic") and synthetic["steps_per_epoch"] == 8
  assert np.isfinite(synthetic["train_loss"]) and synthetic["samples_per_sec_per_replica"] > 0


def test_each_epoch_line_starts_a_line_of_its_own_after_the_progress_bar(plateau_run):
  """As a terminal shows stdout and stderr together: Keras' bar ends its line before the epoch's log
  line (written by absl to stderr), not glued to the bar's last update. The run is the
  shared 2-epoch `plateau_run` (--progress=bar, one stream); only its captured output is read, which the
  resume of its folder does not change."""
  result = plateau_run[0]
  assert result.returncode == 0, result.stdout[-3000:]
  lines = [line for line in result.stdout.replace("\r", "\n").splitlines() if "Epoch 1/2 took" in line
           or "Epoch 2/2 took" in line]
  assert len(lines) == 2 and all(line.startswith("I") for line in lines), lines
  assert " left for 1 more epoch" in lines[0] and " left" not in lines[1], lines
