"""The post-training analysis in-process (analysis/): metric and verdict maths on synthetic arrays, and
an export that computes exactly as the application. End to end through the tools: tests/e2e/test_predict.py.
"""

import os

import numpy as np
import pytest
import yaml

from analysis import evaluation, plots
from run_config import RunConfig
from tests.support.cellspike_files import PAR_NAMES
from tests.support.helpers import assert_names


# --- Metrics and verdicts on synthetic arrays ---------------------------------------------------------

def test_perfect_predictions_are_learned():
  truth = np.random.RandomState(0).uniform(-1, 1, size=(500, 3))
  figures = evaluation.compute_metrics(truth, truth.copy(), ["a", "b", "c"])
  assert figures["mse"] == 0.0 and figures["verdict_counts"] == {"learned": 3, "weak": 0, "not learned": 0}
  for p in figures["parameters"]:
    assert p["pearson_r"] == pytest.approx(1.0) and p["residual_std"] == 0.0 and p["verdict"] == "learned"


def test_random_and_constant_predictions_are_not_learned():
  rng = np.random.RandomState(1)
  truth = rng.uniform(-1, 1, size=(5000, 2))
  prediction = np.stack([rng.uniform(-1, 1, 5000), np.full(5000, 0.25)], axis=1)
  figures = evaluation.compute_metrics(truth, prediction, ["random", "constant"])
  random_par, constant_par = figures["parameters"]
  assert abs(random_par["pearson_r"]) < 0.05 and random_par["verdict"] == "not learned"
  assert constant_par["pearson_r"] == 0.0 and constant_par["verdict"] == "not learned"
  assert constant_par["prediction_std"] == 0.0


def test_hand_computed_figures():
  truth = np.array([[0.0], [1.0], [2.0], [3.0]])
  prediction = np.array([[1.0], [1.0], [3.0], [3.0]])   # residuals 1, 0, 1, 0
  figures = evaluation.compute_metrics(truth, prediction, ["x"])
  p = figures["parameters"][0]
  assert p["mse"] == pytest.approx(0.5) and figures["mse"] == pytest.approx(0.5)
  assert p["residual_mean"] == pytest.approx(0.5) and p["residual_std"] == pytest.approx(0.5)
  # r = cov / (sd_u sd_z) = 1.0 / (sqrt(1.25) * 1.0)
  assert p["pearson_r"] == pytest.approx(1.0 / np.sqrt(1.25))
  assert figures["mean_predictor_mse"] == pytest.approx(1.25) and figures["mean_predictor"] == "split mean"
  assert figures["num_samples"] == 4
  # Against the training set's mean, as the training run's report: (1 + 0 + 1 + 4) / 4.
  figures = evaluation.compute_metrics(truth, prediction, ["x"], baseline_mean=np.array([1.0]))
  assert figures["mean_predictor_mse"] == pytest.approx(1.5)
  assert figures["mean_predictor"] == "training-set mean"


@pytest.mark.parametrize("r, expected", [(1.0, "learned"), (0.7, "learned"), (0.6999, "weak"), (0.3, "weak"),
                                         (0.2999, "not learned"), (-0.9, "not learned"),
                                         (float("nan"), "not learned")])
def test_verdict_thresholds(r, expected):
  assert evaluation.verdict(r) == expected
  assert (evaluation.LEARNED_MIN_R, evaluation.WEAK_MIN_R) == (0.7, 0.3)


def test_weak_correlation_is_weak():
  rng = np.random.RandomState(2)
  truth = rng.randn(20000, 1)
  prediction = 0.5 * truth + np.sqrt(1 - 0.25) * rng.randn(20000, 1)    # r = 0.5 by construction
  p = evaluation.compute_metrics(truth, prediction, ["half"])["parameters"][0]
  assert p["pearson_r"] == pytest.approx(0.5, abs=0.02) and p["verdict"] == "weak"


# --- End to end: a tiny trained run -------------------------------------------------------------------


@pytest.mark.parametrize("precision, statistics", [("32.32", "moving"), ("16.32", "moving"),
                                                    ("32.32", "batch")])
def test_export_computes_as_the_application_at_its_precision(tmp_path, precision, statistics):
  """A model trained at mixed 16-bit is exported at the same policy: the same predictions, exactly. A
  model normalised by batch statistics says so in export_info.yaml: its callers must pass batches."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from strategies import cpu, select  # pylint: disable=import-outside-toplevel
  from analysis import export  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  if precision != "32.32" and not cpu.bfloat16_kernels_available():
    precision = "32.32"  # TF 2.6 has no CPU bfloat16 kernels: the float32 case is the one it can run
  config = RunConfig(model="neuron_inverter", model_options={"design": "dev", "batch_norm_statistics": statistics},
                     precision=precision)
  try:
    select.set_precision(precision, "cpu")
    net = model.get_model_module("neuron_inverter").build(config, (1600, 4), 15)
    frames = np.random.RandomState(0).randn(8, 1600, 4).astype(np.float32)
    expected = net.predict(frames, verbose=0)
    export_dir = export.export_saved_model(net, config, (1600, 4), 15, str(tmp_path / "export"), PAR_NAMES)
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")
  loaded = tf.saved_model.load(export_dir)
  got = loaded.signatures["serving_default"](frames=tf.constant(frames))["conductances"].numpy()
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
  info = yaml.safe_load(open(os.path.join(export_dir, "export_info.yaml")))
  assert info["batch_norm_statistics"] == statistics
  assert ("each call's batch" in info.get("note", "")) == (statistics == "batch")


@pytest.mark.parametrize("name, shown", [
    ("synth_excite.cellSpike_4prB8kHz.data.h5", "synth_excite.ce…4prB8kHz.data.h5"),
    ("20261126-190858", "20261126-190858")])
def test_the_info_panel_keeps_the_end_of_a_long_name(name, shown):
  # The end tells a file (its extension) or a run (its timestamp) from its neighbours.
  short = plots._short(name, 32)  # pylint: disable=protected-access
  assert short == shown and len(short) <= 32


# --- The prediction figures and sum_pred.yaml's head ----------------------------------------------------

def _report(num_samples=600):
  """Truth, prediction and the figures of a report on them, 15 parameters from learned to not learned."""
  rng = np.random.RandomState(3)
  truth = rng.uniform(-1, 1, size=(num_samples, 15))
  prediction = truth * np.linspace(1.0, 0.0, 15) + rng.normal(0, 0.3, truth.shape)
  results = dict(evaluation.compute_metrics(truth, prediction, PAR_NAMES), model="neuron_inverter", design="dev",
                 logdir="/runs/tiny", data_path="/data/d.h5", split="test", checkpoint_epoch=2, train=None)
  return truth, prediction, results


def test_truth_vs_prediction_has_a_labelled_colour_bar_and_says_what_u_star_is():
  truth, prediction, results = _report()
  figure = plots.truth_vs_prediction_figure(truth, prediction, results)
  try:
    # 16 panels (15 parameters and the run's figures) and the colour bar beside them.
    assert len(figure.axes) == 17
    bars = [ax for ax in figure.axes if ax.get_ylabel().startswith(plots.COUNTS_LABEL)]
    assert len(bars) == 1 and "log scale" in bars[0].get_ylabel()
    # One scale for all panels: every histogram's colours are the colour bar's.
    norms = {id(ax.collections[0].norm) for ax in figure.axes[:15]}
    assert len(norms) == 1 and figure.axes[0].collections[0].norm.vmin == 1
    assert_names(figure._suptitle.get_text(), "u* = (log10 g", "half-range")  # pylint: disable=protected-access
    assert figure.axes[12].get_xlabel() == "truth (u*)"
  finally:
    plots.plt.close(figure)


def test_the_residual_histograms_count_samples_on_their_y_axis():
  truth, prediction, results = _report()
  figure = plots.residuals_figure(truth, prediction, results)
  try:
    panels = figure.axes[:15]
    assert [ax.get_ylabel() for ax in panels[::4]] == [plots.COUNTS_LABEL] * 4   # the first column's
    assert all(len(ax.get_yticks()) >= 2 for ax in panels)                         # counts, not blank
    assert "u* = " in figure._suptitle.get_text()  # pylint: disable=protected-access
  finally:
    plots.plt.close(figure)


def test_sum_preds_paths_are_all_absolute(tmp_path, monkeypatch):
  """A run named by a relative --logdir: the report held an absolute logdir beside a checkpoint path
  relative to the folder the tool ran in."""
  import types  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(tmp_path)
  config = RunConfig(model="neuron_inverter", logdir="runs/tiny")
  head = evaluation._what_was_evaluated(  # pylint: disable=protected-access
      config, types.SimpleNamespace(kind="cpu", replicas=1, precision="32.32"), "test",
      os.path.join("runs", "tiny", "checkpoints", "best", "ckpt-2"), {"epoch": 2},
      types.SimpleNamespace(path="data/d.h5", input_shape=(1600, 4)), 1.0)
  assert head["logdir"] == str(tmp_path / "runs" / "tiny")
  assert head["checkpoint"] == str(tmp_path / "runs" / "tiny" / "checkpoints" / "best" / "ckpt-2")
  assert head["data_path"] == str(tmp_path / "data" / "d.h5")


# --- Training curves ------------------------------------------------------------------------------------

def _summary_only_run(tmp_path, lr, schedule):
  (tmp_path / "summary.yaml").write_text(yaml.safe_dump({"history": {"loss": [0.3, 0.2, 0.1], "lr": lr}}))
  if schedule:
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump({"lr_schedule": schedule, "epochs": 3}))
  return str(tmp_path)


@pytest.mark.parametrize("lr, schedule, scale", [
    ([7.5e-4, 2.5e-4, 2.35e-9], "cosine", "linear"),   # the default job: a log axis would be mostly 1e-9
    ([1e-3, 1.1e-4, 1.2e-5], "plateau", "log"),        # reduce-on-plateau's cuts
    ([1e-3, 1.1e-4, 1.2e-5], None, "log"),             # a run folder without run_config.yaml
    ([1e-3, 1e-3, 5e-4], "plateau", "linear")])        # within 3x
def test_learning_rate_axis_follows_the_schedule(tmp_path, lr, schedule, scale):
  history = plots.load_history(_summary_only_run(tmp_path, lr, schedule))
  assert history.get("lr_schedule") == schedule
  assert plots.lr_axis_scale(history) == scale
  assert os.path.isfile(plots.plot_training_curves(history, str(tmp_path)))


def test_the_parameter_table_fits_80_columns_with_the_built_in_cells_names():
  """Its rows were 84 columns: in an 80-column terminal "not learned" wrapped after "not lea"."""
  from data import neuron_sim  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(2)
  truth = rng.uniform(-1, 1, size=(2000, neuron_sim.NUM_PAR))
  prediction = truth * np.linspace(1.0, 0.0, neuron_sim.NUM_PAR) - 0.125 + rng.normal(0, 0.5, truth.shape)
  figures = evaluation.compute_metrics(truth, prediction, neuron_sim.PAR_NAMES)
  table = evaluation.format_table(dict(figures, split="test")).splitlines()
  rows = table[:-1]   # the last line is a sentence, which a terminal may wrap
  assert len(rows) == 1 + neuron_sim.NUM_PAR and max(len(row) for row in rows) <= 80, max(rows, key=len)
  assert {row.split(None, 6)[-1] for row in rows[1:]} == {"learned", "weak", "not learned"}
  widest = max(neuron_sim.PAR_NAMES, key=len)
  assert any(row.startswith("%-3s %s " % (neuron_sim.PAR_NAMES.index(widest), widest)) for row in rows), rows
