"""Prediction and analysis end to end: `main.py --predict`, `tools/predict.py`, plots, export.

One tiny run (dev design, 2 epochs on a hand-made file) is trained once for the module; the tools are
then run against it as a user would, in subprocesses. The metric and verdict maths and the export's
exactness are unit-tested in tests/test_evaluation.py.
"""

import glob
import os
import struct
import shutil
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import yaml
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

from errors import UserError
from run_config import RunConfig
import saved_config
from tests.support.cellspike_files import PAR_NAMES, write_cellspike, write_meta_yaml
from tests.support.helpers import REPO_ROOT, assert_names, assert_one_line_error, line_naming, run_main
from analysis import evaluation, plots
from analysis.events import read_scalars
from training import summary

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_predict(*args, timeout=300):
  env = dict(os.environ)
  for variable in ("TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL"):  # the tool must set them itself
    env.pop(variable, None)
  return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "predict.py")] + list(args),
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def png_size(path):
  """(width, height) of a PNG file; fails unless the file starts with a PNG signature and IHDR."""
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", path
  return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
  folder = tmp_path_factory.mktemp("data")
  write_meta_yaml(str(folder / "meta.cellSpike_excite_4prB8kHz.yaml"))
  # Evaluation splits that are no multiple of the batch: every sample is evaluated all the same.
  return write_cellspike(str(folder / "tiny.h5"), sizes={"train": 256, "val": 70, "test": 70})


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_file):
  """`main.py ... --predict`: trains two epochs and writes the report into <logdir>/predict."""
  logdir = str(tmp_path_factory.mktemp("runs") / "tiny")
  result = run_main("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16",
                    "--data_path=" + data_file, "--logdir=" + logdir, "--epochs=2", "--warmup_epochs=1",
                    "--precision=32.32", "--predict")
  assert result.returncode == 0, result.stderr[-3000:]
  return logdir, result


def _load_yaml(path):
  with open(path) as f:
    return yaml.safe_load(f)


def _check_sum_pred(sum_pred, split, num_samples):
  assert sum_pred["split"] == split and sum_pred["num_samples"] == num_samples
  assert sum_pred["model"] == "neuron_inverter" and sum_pred["design"] == "dev"
  assert sum_pred["verdict_rule"]["learned_min_r"] == 0.7 and sum_pred["verdict_rule"]["weak_min_r"] == 0.3
  assert [p["name"] for p in sum_pred["parameters"]] == PAR_NAMES      # the meta yaml's parName
  for p in sum_pred["parameters"]:
    assert p["verdict"] == evaluation.verdict(p["pearson_r"])        # derived from the stated r only
    assert np.isfinite([p["mse"], p["residual_mean"], p["residual_std"], p["pearson_r"]]).all()
    assert p["mse"] == pytest.approx(p["residual_mean"] ** 2 + p["residual_std"] ** 2, rel=1e-6)
  assert np.mean([p["mse"] for p in sum_pred["parameters"]]) == pytest.approx(sum_pred["mse"], rel=1e-6)
  assert sum(sum_pred["verdict_counts"].values()) == 15


def test_main_predict_writes_the_report(trained_run):
  logdir, result = trained_run
  assert "Prediction (" in result.stdout and "verdict" in result.stdout
  # TensorFlow 2.6 (the IPU SDK's) printed "Cleanup called..." for each figure it decoded for TensorBoard.
  assert "Cleanup called" not in result.stderr
  assert _load_yaml(os.path.join(logdir, "run_config.yaml"))["design"] == "dev"   # written at the start
  sum_pred = _load_yaml(os.path.join(logdir, "predict", "sum_pred.yaml"))
  _check_sum_pred(sum_pred, "test", 70)
  # Its paths, all absolute: the checkpoint's inside the run folder it names.
  assert sum_pred["logdir"] == os.path.abspath(logdir) and os.path.isabs(sum_pred["data_path"])
  assert sum_pred["checkpoint"].startswith(os.path.join(sum_pred["logdir"], "checkpoints", "best") + os.sep)
  assert _load_yaml(os.path.join(logdir, "summary.yaml"))["test_samples"] == 70
  # The test split is evaluated with the weights the run tested: its MSE is the run's test loss, and
  # its baseline the one the run's report gave for the test split (the training mean's MSE there).
  run_summary = _load_yaml(os.path.join(logdir, "summary.yaml"))
  assert sum_pred["mse"] == pytest.approx(run_summary["test_loss"], rel=1e-4)
  assert sum_pred["mean_predictor"] == "training-set mean"
  assert sum_pred["mean_predictor_mse"] == pytest.approx(run_summary["mean_predictor_test_loss"], rel=1e-9)
  assert run_summary["mean_predictor_test_loss"] != pytest.approx(run_summary["mean_predictor_val_loss"])
  assert_names(line_naming(result.stdout, "  test: loss"), "loss %.4f" % run_summary["test_loss"],
               "%.3f" % (run_summary["test_loss"] / run_summary["mean_predictor_test_loss"]),
               "baseline %.4f" % run_summary["mean_predictor_test_loss"])
  for name in ("truth_vs_pred.png", "residuals.png", "training_curves.png"):
    width, height = png_size(os.path.join(logdir, "predict", name))
    assert width >= 800 and height >= 600
  # TensorBoard shows the same figures (as decoded images), the table and the MSE under the run's predict/.
  accumulator = event_accumulator.EventAccumulator(os.path.join(logdir, "predict"), size_guidance={"tensors": 0})
  accumulator.Reload()
  for name in ("truth_vs_pred", "residuals"):  # TF 2 images: a tensor of width, height and the PNG
    image, = accumulator.Tensors("prediction/" + name)
    width, height, png = tensor_util.make_ndarray(image.tensor_proto)
    # At the step of the weights' epoch, as Keras numbers it (from 0) in train/ and validation/.
    assert png.startswith(PNG_SIGNATURE) and image.step == sum_pred["checkpoint_epoch"] - 1
    assert (int(width), int(height)) == png_size(os.path.join(logdir, "predict", name + ".png"))
  table, = accumulator.Tensors("prediction/parameters")
  assert "p14" in tensor_util.make_ndarray(table.tensor_proto).item().decode()
  assert read_scalars(os.path.join(logdir, "predict"))["prediction/test_mse"] == [
      (sum_pred["checkpoint_epoch"] - 1, pytest.approx(sum_pred["mse"], rel=1e-6))]
  # The closing report lists the folder as it is, and the report tool for this regression model.
  closing = result.stdout[result.stdout.index("Run finished: " + logdir):]
  outputs = next(line for line in closing.splitlines() if line.strip().startswith("outputs:"))
  for name in ("summary.yaml", "run_config.yaml", "log.txt", "history.csv", "checkpoints/", "predict/"):
    assert name in outputs, outputs
  assert_names(line_naming(closing, "tools/predict.py"), "--logdir " + logdir)
  with open(os.path.join(logdir, "log.txt"), encoding="utf-8") as f:  # also where the terminal is gone
    assert f.read().endswith(closing)


def _cell_folder(data_file, tmp_path):
  """A data folder as docs/data.md names cellSpike data: its meta yaml, and a copy of `data_file` as the
  file of cell cellB."""
  folder = tmp_path / "cells"
  folder.mkdir()
  write_meta_yaml(str(folder / "meta.cellSpike_excite_4prB8kHz.yaml"))
  shutil.copy(data_file, str(folder / "cellB_excite.cellSpike_4prB8kHz.data.h5"))
  return folder


def test_predict_tool_and_export_round_trip(trained_run, data_file, tmp_path):
  """The tool on a slice of a split, its report outside the run folder, and an export that reproduces
  its predictions. The data are named as main.py names them, --data_path=<folder> --cell_name=<cell>
  (the documented way to name cellSpike data): the folder's file is a copy of the run's, so
  the truths are the run's data file's all the same."""
  logdir, _ = trained_run
  outdir, export_dir = str(tmp_path / "out"), str(tmp_path / "export")
  folder = _cell_folder(data_file, tmp_path)
  result = run_predict("--logdir=" + logdir, "--data_path=" + str(folder), "--cell_name=cellB",
                       "--probe_type=excite_4prB8kHz", "--split=validation", "--max_samples=50",
                       "--backend=cpu", "--outdir=" + outdir, "--export_dir=" + export_dir, "--noplots")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "compiled metrics have yet" not in result.stderr  # Keras' warning on exporting
  # TensorFlow's start-up lines, dropped as in main.py's log (the tool sets TF_CPP_MIN_LOG_LEVEL itself).
  for line in ("oneDNN custom operations", "rebuild TensorFlow", "absl::InitializeLog()") + (
      () if glob.glob("/dev/nvidia[0-9]*") else ("find cuda drivers", "cuInit")):
    assert line not in result.stderr, result.stderr[-3000:]
  # 50 samples exactly: 3 batches of 16 and a short one of 2.
  assert "parameter" in result.stdout and "p14" in result.stdout
  assert_names(line_naming(result.stdout, "validation split"), "50 samples")
  # The report outside the run folder: TensorBoard over the report's folder, whose root run holds it.
  assert "of the run .)" in line_naming(result.stdout, "In TensorBoard")
  assert line_naming(result.stdout, "tools/serve_tensorboard.py").endswith(" --logdir %s" % outdir)
  sum_pred = _load_yaml(os.path.join(outdir, "sum_pred.yaml"))
  _check_sum_pred(sum_pred, "validation", 50)
  # The folder's cell file was evaluated (a run of its own evaluated 32 test samples; this one's split
  # and slice serve the checks above and below, and the file's name does not depend on them).
  assert sum_pred["data_path"].endswith("cellB_excite.cellSpike_4prB8kHz.data.h5")
  assert os.path.join("checkpoints", "best") in sum_pred["checkpoint"]
  assert not [name for name in os.listdir(outdir) if name.endswith(".png")]      # --noplots
  saved = np.load(os.path.join(outdir, "predictions.npz"))
  with h5py.File(data_file, "r") as f:  # the evaluated file's original
    frames, targets = f["val_frames"][:50], f["val_unitStar_par"][:50]
  np.testing.assert_array_equal(saved["truth"], targets)           # one replica: file order
  # The export loads in a fresh interpreter without the repository on its path and reproduces Z.
  np.save(str(tmp_path / "frames.npy"), frames)
  script = textwrap.dedent("""
      import importlib.util, os, sys
      import numpy as np, tensorflow as tf
      assert importlib.util.find_spec("run_config") is None, "the application is importable"
      assert os.path.abspath(sys.argv[4]) not in [os.path.abspath(p) for p in sys.path]
      loaded = tf.saved_model.load(sys.argv[1])
      out = loaded.signatures["serving_default"](frames=tf.constant(np.load(sys.argv[2]), tf.float32))
      np.save(sys.argv[3], out["conductances"].numpy())
      print("NAMES", ",".join(n.decode() for n in loaded.par_names().numpy()))
      """)
  env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS")}
  loaded = subprocess.run([sys.executable, "-c", script, export_dir, "frames.npy", "z.npy", REPO_ROOT], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  assert "NAMES " + ",".join(PAR_NAMES) in loaded.stdout
  np.testing.assert_allclose(np.load(str(tmp_path / "z.npy")), saved["prediction"], rtol=1e-5, atol=1e-5)


def test_training_history_from_events_and_from_summary(trained_run, tmp_path):
  logdir, _ = trained_run
  history = plots.load_history(logdir)
  assert history["source"] == "TensorBoard events" and history["epoch"] == [1, 2]
  summary = _load_yaml(os.path.join(logdir, "summary.yaml"))
  assert history["loss"] == pytest.approx(summary["history"]["loss"], rel=1e-5)
  assert history["lr"] == pytest.approx(summary["history"]["lr"], rel=1e-5)
  partial = tmp_path / "summary_only"
  partial.mkdir()
  (partial / "summary.yaml").write_text(yaml.safe_dump(summary))
  assert plots.load_history(str(partial))["loss"] == summary["history"]["loss"]


def test_a_stray_argument_is_one_line_error_not_the_help(tmp_path):
  result = run_predict("--logdir=" + str(tmp_path), "extra")
  assert_one_line_error(result, "argument extra", "flags only")
  assert "--max_samples" not in result.stdout + result.stderr   # not absl's whole --help


def test_missing_logdir_is_one_line_error(tmp_path):
  assert_one_line_error(run_predict("--logdir=" + str(tmp_path / "nowhere")), "nowhere", "does not exist")


def test_run_without_checkpoint_is_a_user_error(trained_run, tmp_path):
  logdir, _ = trained_run
  started = tmp_path / "started"
  started.mkdir()
  (started / "run_config.yaml").write_text(open(os.path.join(logdir, "run_config.yaml")).read())
  with pytest.raises(UserError, match="no checkpoint"):
    evaluation.evaluate_run(saved_config.load_run_config(str(started)), _cpu_backend())


def test_not_a_run_folder_is_a_user_error(tmp_path):
  with pytest.raises(UserError, match="not a training run"):
    saved_config.load_run_config(str(tmp_path))


def test_data_of_another_shape_is_a_user_error(trained_run, tmp_path):
  logdir, _ = trained_run
  other = write_cellspike(str(tmp_path / "short.h5"), sizes={"train": 32, "val": 32, "test": 32},
                          time_bins=800)
  config = saved_config.load_run_config(logdir, data_path=other, backend="cpu")
  with pytest.raises(UserError) as caught:
    evaluation.evaluate_run(config, _cpu_backend(), outdir=str(tmp_path / "out"))
  assert_names(caught.value, "does not fit", "(800, 4) -> 15")
  assert not os.path.exists(str(tmp_path / "out"))


def test_too_few_samples_for_the_reports_correlations(trained_run, tmp_path, caplog):
  """One sample would end in a ValueError traceback (after training, with main.py --predict); a few
  would give confident verdicts from r of +-1."""
  config = saved_config.load_run_config(trained_run[0], backend="cpu")
  with pytest.raises(UserError) as caught:
    evaluation.evaluate_run(config, _cpu_backend(), max_samples=1, outdir=str(tmp_path / "one"))
  assert_names(caught.value, "1 test sample", "--max_samples=1", "at least 2")
  with caplog.at_level("WARNING", logger="absl"):
    result = evaluation.evaluate_run(config, _cpu_backend(), max_samples=3, outdir=str(tmp_path / "three"),
                                     plots=False)
  assert result.results["num_samples"] == 3
  assert_names(line_naming(caplog.text, "Only 3 test samples"), "--max_samples=3", "unreliable below 20")


def test_main_predict_with_a_one_sample_test_split_is_refused_before_training(tmp_path):
  """The report needs two test samples: main.py refuses before training, not after it wrote summary.yaml."""
  data = write_cellspike(str(tmp_path / "one_test.h5"), sizes={"train": 64, "val": 16, "test": 1})
  logdir = tmp_path / "run"
  result = run_main("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16",
                    "--data_path=" + data, "--logdir=" + str(logdir), "--epochs=1", "--precision=32.32",
                    "--predict")
  assert_one_line_error(result, data, "1 test sample", "at least 2", "leave --predict off")
  assert not (logdir / "summary.yaml").exists() and "Epoch 1/1" not in result.stderr


@pytest.mark.parametrize("flag", ["outdir", "export_dir"])
@pytest.mark.parametrize("folder, blocker", [("/dev/null/x", "/dev/null"), ("{a_file}/sub", "{a_file}")])
def test_an_output_folder_that_cannot_be_made_is_refused_before_evaluating(tmp_path, flag, folder, blocker):
  """Checked first, not found by os.makedirs after the whole evaluation ran: this run folder has no
  checkpoint, which evaluating would find first."""
  a_file = str(tmp_path / "a_file")
  with open(a_file, "w") as f:
    f.write("not a folder")
  folder, blocker = folder.format(a_file=a_file), blocker.format(a_file=a_file)
  config = RunConfig(model="neuron_inverter", backend="cpu", logdir=str(tmp_path))
  with pytest.raises(UserError) as error:
    evaluation.evaluate_run(config, _cpu_backend(), **{flag: folder})
  assert_names(error.value, "--%s=%s:" % (flag, folder), "%s is not a folder" % blocker)


def test_the_default_output_folder_is_named_as_the_default(tmp_path):
  """A run folder the user may read but not write (a colleague's): the error named `--outdir=...`, a
  flag the user never typed. Here a file where the report's folder would go blocks it, as root too."""
  (tmp_path / "predict").write_text("not a folder")
  config = RunConfig(model="neuron_inverter", backend="cpu", logdir=str(tmp_path))
  with pytest.raises(UserError) as error:
    evaluation.evaluate_run(config, _cpu_backend())
  assert_names(error.value, "default --outdir=%s" % (tmp_path / "predict"), "is a file", "pass --outdir=")


def _cpu_backend():
  from strategies import select  # pylint: disable=import-outside-toplevel
  return select.select_backend(RunConfig(model="neuron_inverter", backend="cpu"))


def test_bad_tool_flag_is_one_line_error():
  assert_one_line_error(run_predict("--logdir=x", "--split=bogus"), "--split=bogus")


def test_predict_flag_needs_the_regression_model():
  assert_one_line_error(run_main("--model=mnist", "--predict"), "--predict", "neuron_inverter")


def test_predict_names_real_data_as_main_does_a_folder_and_a_cell(trained_run, data_file, tmp_path):
  """A run trained on --data_path=<folder> --cell_name=<cell>, the documented way to name cellSpike data,
  evaluated on a file. (The tool given --data_path=<folder> --cell_name=<cell> itself:
  test_predict_tool_and_export_round_trip, which evaluates the folder's cell in its run.)"""
  folder = _cell_folder(data_file, tmp_path)
  # A run trained on that folder's cell, evaluated on a file: the run's --cell_name picked a file in its
  # folder, and is not carried over to a --data_path file (where main.py refuses it).
  copy = _copy_of(trained_run, tmp_path)
  config_path = os.path.join(copy, "run_config.yaml")
  saved = dict(_load_yaml(config_path), data_path=str(folder), cell_name="cellB",
               probe_type="excite_4prB8kHz")
  with open(config_path, "w") as f:
    yaml.safe_dump(saved, f)
  result = run_predict("--logdir=" + copy, "--data_path=" + data_file, "--max_samples=32", "--backend=cpu",
                       "--noplots")
  assert result.returncode == 0, result.stderr[-3000:]
  assert _load_yaml(os.path.join(copy, "predict", "sum_pred.yaml"))["data_path"] == os.path.abspath(data_file)
  # The report in the run folder (the default --outdir): TensorBoard over the run, beside its training.
  assert "of the run predict)" in line_naming(result.stdout, "In TensorBoard")
  assert line_naming(result.stdout, "tools/serve_tensorboard.py").endswith(" --logdir %s" % copy)


def test_predict_on_a_file_that_is_not_cellspike_data_is_one_line_before_tensorflow(trained_run, tmp_path):
  bad = tmp_path / "notes.h5"
  bad.write_text("not HDF5")
  result = run_predict("--logdir=" + trained_run[0], "--data_path=" + str(bad), "--backend=cpu",
                       "--outdir=" + str(tmp_path / "out"))
  assert_one_line_error(result, "notes.h5", "not a readable HDF5 file")
  assert result.stderr.startswith("error: "), result.stderr  # no line of TensorFlow's came first
  assert not os.path.exists(str(tmp_path / "out"))


def _copy_of(trained_run, tmp_path):
  """A private copy of the trained run, for a test to damage."""
  copy = str(tmp_path / "run")
  shutil.copytree(trained_run[0], copy)
  return copy


@pytest.mark.parametrize("edit, fragments", [
    ({"batch_size": "abc"}, ["--batch_size=abc"]),
    ({"design": "nope"}, ["--design=nope", "ontra4"]),
    ({"precision": "8.8"}, ["--precision=8.8", "32.32"]),
    ({"read_chunk": -5}, ["--read_chunk=-5"]),
    ({"learning_rate": float("nan")}, ["--learning_rate", "finite"]),
])
def test_hand_edited_run_config_is_checked_like_the_flags(trained_run, tmp_path, edit, fragments):
  """One code path for flags and saved configurations."""
  copy = _copy_of(trained_run, tmp_path)
  path = os.path.join(copy, summary.RUN_CONFIG_FILE)
  saved = _load_yaml(path)
  saved.update(edit)
  with open(path, "w") as f:
    yaml.safe_dump(saved, f)
  with pytest.raises(UserError) as error:
    saved_config.load_run_config(copy)
  assert_names(error.value, path, *fragments)


@pytest.mark.parametrize("text", ["model: [unclosed\n", "!!python/object/apply:os.system ['touch pwned']\n"])
def test_malformed_or_hostile_run_config_is_one_line(trained_run, tmp_path, text):
  copy = _copy_of(trained_run, tmp_path)
  with open(os.path.join(copy, summary.RUN_CONFIG_FILE), "w") as f:
    f.write(text)
  result = run_predict("--logdir=" + copy, timeout=120)
  assert_one_line_error(result, summary.RUN_CONFIG_FILE, "not a readable")
  assert not os.path.exists(os.path.join(REPO_ROOT, "pwned"))


@pytest.mark.parametrize("damage", ["empty_data", "garbage_index", "export_dir_is_a_file"])
def test_damaged_checkpoints_and_bad_outputs_are_found_before_evaluating(trained_run, tmp_path, damage):
  """Checked first and reported in one line."""
  copy = _copy_of(trained_run, tmp_path)
  args = ["--logdir=" + copy, "--backend=cpu", "--noplots", "--max_samples=16"]
  if damage == "export_dir_is_a_file":
    target = tmp_path / "model.zip"
    target.write_text("not a folder")
    args.append("--export_dir=%s" % target)
    fragments = ["--export_dir=%s is a file" % target]
  else:
    suffix = ".data-00000-of-00001" if damage == "empty_data" else ".index"
    (target,) = glob.glob(os.path.join(copy, "checkpoints", "best", "*" + suffix))
    with open(target, "wb") as f:
      f.write(b"" if damage == "empty_data" else b"\x00garbage" * 8)
    fragments = ["predict: checkpoint", "is unreadable"]
  assert_one_line_error(run_predict(*args, timeout=120), *fragments)
