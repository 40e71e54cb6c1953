"""Evaluation of a trained Neuron-Inverter: per-parameter figures, verdicts, sum_pred.yaml and plots.

    python tools/predict.py --logdir=RUN                     # the command-line way
    python main.py --model=neuron_inverter ... --predict     # the same at the end of training

A run is reloaded from its logdir alone: the saved run configuration (run_config.yaml, else summary.yaml's
`params`) and the weights of `checkpoints/best` (else `checkpoints/last`). The chosen split is fed
through the backend's batch layout exactly as in training, with the inference graph (dropout off,
BatchNorm moving statistics), and the truth U and prediction Z are compared parameter by parameter.

Verdicts use the Pearson correlation r between truth and prediction and nothing else:
  learned      r >= LEARNED_MIN_R (0.7): roughly half the variance or more follows the truth (r^2 >= 0.49)
  weak         WEAK_MIN_R (0.3) <= r < 0.7: a real but loose relation (r^2 between 0.09 and 0.49)
  not learned  r < 0.3 (or constant predictions): under 9% of the variance explained
Correlation, unlike MSE, does not depend on the parameter's range, so one pair of thresholds serves all
fifteen conductances; MSE and the residual mean/std are reported beside it for bias and spread.
"""

import dataclasses
import glob
import math
import os
import time
from typing import Optional

import numpy as np
import tensorflow as tf
from absl import logging

import model as model_registry
from analysis import events
from data import cellspike
from data.splits import eval_layout
from errors import UserError
from host import atomic_files
from host.output_paths import check_output_path
from run_config import RunConfig
from stderr_lines import DroppedLines
from strategies.backend import Backend
from training import checkpoints as checkpoints_lib
from training import logs
from training import summary as summary_lib
from training.callbacks import epoch_step

LEARNED_MIN_R = 0.7
WEAK_MIN_R = 0.3
LEARNED, WEAK, NOT_LEARNED = "learned", "weak", "not learned"
# Pearson's r needs two samples; below about 20 its spread (about 1/sqrt(N-3) for weak links) is larger
# than the gaps between the verdicts' thresholds, so the report says they are unreliable.
MIN_SAMPLES, RELIABLE_SAMPLES = 2, 20
SPLIT_KEYS = {"train": "train", "validation": "val", "val": "val", "test": "test"}
PREDICT_DIR = "predict"
SUM_PRED = "sum_pred.yaml"
PREDICTIONS = "predictions.npz"


def verdict(r: float) -> str:
  """learned / weak / not learned from the Pearson correlation alone (NaN: not learned)."""
  if r is not None and r >= LEARNED_MIN_R:
    return LEARNED
  if r is not None and r >= WEAK_MIN_R:
    return WEAK
  return NOT_LEARNED


def pearson_r(u: np.ndarray, z: np.ndarray) -> float:
  """Pearson correlation of two 1-D arrays; 0.0 when either is constant (nothing is followed)."""
  u, z = u - u.mean(), z - z.mean()
  denominator = math.sqrt(float(np.dot(u, u)) * float(np.dot(z, z)))
  return float(np.dot(u, z) / denominator) if denominator > 0 else 0.0


def compute_metrics(truth: np.ndarray, prediction: np.ndarray, par_names, baseline_mean=None) -> dict:
  """Overall and per-parameter figures of (N, P) truth U and prediction Z (float64 arithmetic).

  Residual is Z - U (prediction minus truth). The baseline is the MSE of always predicting
  `baseline_mean` (the training set's mean target, as in the training run's report), or U's own mean
  when there is none. Returns a plain dict ready for YAML.
  """
  u, z = np.asarray(truth, np.float64), np.asarray(prediction, np.float64)
  if u.shape != z.shape or u.ndim != 2 or len(u) < 2:
    raise ValueError("truth %s and prediction %s must be equal (N>=2, P) arrays" % (u.shape, z.shape))
  if len(par_names) != u.shape[1]:
    raise ValueError("%d parameter names for %d parameters" % (len(par_names), u.shape[1]))
  residual = z - u
  predicted_mean = u.mean(axis=0) if baseline_mean is None else np.asarray(baseline_mean, np.float64)
  parameters = []
  for i, name in enumerate(par_names):
    r = pearson_r(u[:, i], z[:, i])
    parameters.append({
        "index": i, "name": str(name),
        "mse": float(np.mean(residual[:, i] ** 2)),
        "residual_mean": float(residual[:, i].mean()),
        "residual_std": float(residual[:, i].std()),
        "pearson_r": r,
        "truth_std": float(u[:, i].std()),
        "prediction_std": float(z[:, i].std()),
        "verdict": verdict(r),
    })
  counts = {name: sum(p["verdict"] == name for p in parameters) for name in (LEARNED, WEAK, NOT_LEARNED)}
  return {
      "num_samples": int(len(u)),
      "mse": float(np.mean(residual ** 2)),
      "mean_predictor_mse": float(np.mean((u - predicted_mean) ** 2)),
      "mean_predictor": "split mean" if baseline_mean is None else "training-set mean",
      "verdict_rule": {"statistic": "pearson_r", "learned_min_r": LEARNED_MIN_R, "weak_min_r": WEAK_MIN_R,
                       "rule": "learned if r >= %g; weak if %g <= r < %g; else not learned"
                               % (LEARNED_MIN_R, WEAK_MIN_R, LEARNED_MIN_R)},
      "verdict_counts": counts,
      "parameters": parameters,
  }


# --- Loading a run -----------------------------------------------------------------------------------

def build_model(config: RunConfig, input_shape, num_outputs, backend: Backend) -> tf.keras.Model:
  """The run's network for inference on `backend`, built in its strategy's scope, uncompiled, its
  layers in their built-in form for the backend's hardware (_layer_form)."""
  with backend.strategy.scope():
    net, boundaries = model_registry.build_network(model_registry.get_model_module(config.model), config,
                                                   input_shape, num_outputs, _layer_form(config, backend))
    return backend.inference_model(net, boundaries)


def _layer_form(config: RunConfig, backend: Backend) -> dict:
  """The built-in form of the model's layers on `backend`'s hardware (model.layer_forms): every form
  computes the same function, so inference needs no timing of them."""
  return model_registry.layer_forms(model_registry.get_model_module(config.model), backend.hardware)[0]


def _checkpoint_model_shapes(path: str) -> list:
  """Shapes of the model variables stored in checkpoint `path` (optimizer slots left out)."""
  return sorted(tuple(shape) for name, shape in tf.train.list_variables(path)
                if name.startswith("model/") and name.endswith("/.ATTRIBUTES/VARIABLE_VALUE")
                and ".OPTIMIZER_SLOT" not in name)


def restore_weights(net: tf.keras.Model, path: str, input_shape, num_outputs) -> None:
  """Loads the model weights of checkpoint `path`; a model/data mismatch is a UserError naming both."""
  expected = sorted(tuple(weight.shape.as_list()) for weight in net.weights)
  if _checkpoint_model_shapes(path) != expected:
    raise UserError("checkpoint %s does not fit a %s model for data of shape %s -> %d parameters: the "
                    "weight shapes differ (is --data_path the kind of file the run was trained on?)"
                    % (path, net.name, tuple(input_shape), num_outputs))
  try:
    # expect_partial: the optimizer slots and the run state are not needed for inference. Where the
    # option exists (TF >= 2.12), slots are not even queued: the optimizer that compile() creates
    # later (Keras' default, of the TF >= 2.11 family) refuses slots written by the legacy family.
    try:
      options = tf.train.CheckpointOptions(experimental_skip_slot_variables=True)
    except TypeError:
      options = None  # TF 2.6: one optimizer family, nothing to refuse
    tf.train.Checkpoint(model=net).restore(path, options=options).expect_partial()
  except (ValueError, tf.errors.OpError) as error:
    raise UserError("checkpoint %s does not fit a model for data of shape %s -> %d parameters: %s"
                    % (path, tuple(input_shape), num_outputs, " ".join(str(error).split())[:300])) from None


# --- Predicting --------------------------------------------------------------------------------------

def collect_predictions(net: tf.keras.Model, dataset: tf.data.Dataset, steps: int = None):
  """(U, Z): truth and prediction of every sample of `dataset`, in the order the model consumed them.

  The dataset yields (x, y) elements laid out for the backend (a global batch that tf.distribute splits
  in order, or one element per IPU replica in turn); Keras' predict returns its outputs in the same
  element order, so the truth is read from the same elements. Evaluation splits are not shuffled, so
  the second pass over the dataset repeats the first.
  """
  with DroppedLines(logs.ONE_OFF_NATIVE_LINES):  # TensorFlow's one-off lines; verbose=0 prints none
    truth = np.concatenate([y.numpy() for _, y in dataset], axis=0)
    prediction = net.predict(dataset.map(lambda x, y: x), steps=steps, verbose=0)
  prediction = np.asarray(prediction, np.float32)
  if prediction.shape != truth.shape:
    raise RuntimeError("predict returned %s for truth %s" % (prediction.shape, truth.shape))
  return truth.astype(np.float32), prediction


def check_report_possible(config: RunConfig) -> None:
  """Refuses `main.py --predict` before training where its report could not be made after it: a test
  split with fewer samples than the correlations need (found at the end, it cost the whole run)."""
  if not config.predict or config.compile_only or config.synthetic_data:
    return
  info = cellspike.open_configured(config)
  samples = info.splits[SPLIT_KEYS["test"]].num_samples
  if samples < MIN_SAMPLES:
    raise UserError("%s: %d test sample%s, and the --predict report's correlations need at least %d; "
                    "leave --predict off, or give a file with a larger test split"
                    % (info.path, samples, "" if samples == 1 else "s", MIN_SAMPLES))


def _eval_split(config: RunConfig, backend: Backend, split: str, max_samples: int):
  """(cellSpike file info, Split) of `split`, unshuffled, in the backend's evaluation layout."""
  info = cellspike.open_configured(config)
  key = SPLIT_KEYS[split]
  batch = config.batch_size
  replicas = max(1, backend.replicas)
  if max_samples:
    batch = max(1, min(batch, max_samples // replicas))
  # The split's first `max_samples` rows (at least one per replica): all of them where the backend
  # takes a short last batch; on IPUs whole batches, of a size that divides each replica's share
  # where one does (data.splits.eval_layout).
  max_rows = max(max_samples, replicas) if max_samples else 0
  rows = info.splits[key].num_samples
  rows = min(rows, max_rows) if max_rows else rows
  # A network with batch statistics evaluates in the batches it trained with (model.batch_dependent).
  layout = eval_layout(backend.layout(batch, model_registry.batch_dependent(config)), rows)
  data_split = cellspike.split_from_file(info, key, config, layout, first_epoch=0, shuffle=False, max_steps=0,
                                        max_rows=max_rows)
  chosen = " (--max_samples=%d)" % max_samples if max_samples else ""
  if data_split.samples < MIN_SAMPLES:
    raise UserError("%s: %d %s sample%s to evaluate%s; the report's correlations need at least %d"
                    % (info.path, data_split.samples, split, "" if data_split.samples == 1 else "s", chosen,
                       MIN_SAMPLES))
  if data_split.samples < RELIABLE_SAMPLES:
    logging.warning("Only %d %s samples%s: the per-parameter correlations and verdicts are unreliable "
                    "below %d", data_split.samples, split, chosen, RELIABLE_SAMPLES)
  return info, data_split


@dataclasses.dataclass
class Evaluation:
  """What an evaluation produced: figures (as in sum_pred.yaml), U, Z and the files written."""
  results: dict
  truth: np.ndarray
  prediction: np.ndarray
  files: list


def evaluate_run(config: RunConfig, backend: Backend, split: str = "test", max_samples: int = 0,
                 outdir: str = None, plots: bool = True, export_dir: str = None) -> Evaluation:
  """Evaluates the run in `config.logdir` on `split`; writes sum_pred.yaml and the PNGs into `outdir`.

  Args:
    config: the run's configuration (`saved_config.load_run_config`), possibly with another data_path/backend.
    backend: where to run; its strategy scope holds the model and its batch layout shapes the data.
    split: "test", "validation" or "train" of the cellSpike file.
    max_samples: evaluate the split's first `max_samples` samples (0: the whole split); fewer where
      they do not divide evenly between the replicas, and on IPUs, whole batches of them.
    outdir: output folder (default <logdir>/predict).
    plots: also write the PNG figures.
    export_dir: also export the model as a self-contained SavedModel there.
  Returns:
    An Evaluation.
  Raises:
    UserError: no checkpoint, unreadable data, data that do not fit the trained model.
  """
  outdir = _checked_request(config, split, outdir, export_dir)
  checkpoint = checkpoints_lib.best_or_last(config.logdir)
  state = checkpoints_lib.peek_state(checkpoint, purpose="predict")
  info, data_split = _eval_split(config, backend, split, max_samples)
  net = build_model(config, info.input_shape, info.num_params, backend)
  restore_weights(net, checkpoint, info.input_shape, info.num_params)
  with backend.strategy.scope():
    net.compile(loss=model_registry.get_model_module(config.model).loss(),
                **backend.compile_kwargs(None, [data_split.steps]))
  logging.info("Evaluating %s (epoch %s) on the %s split of %s: %d samples", checkpoint,
               state.get("epoch", "?"), split, info.path, data_split.samples)
  started = time.perf_counter()
  x, steps = backend.fit_input(data_split.dataset, data_split.steps)
  with backend.device_errors():  # on IPUs the device is attached at the first execution
    truth, prediction = collect_predictions(net, x, steps)
  seconds = time.perf_counter() - started

  results = _what_was_evaluated(config, backend, split, checkpoint, state, info, seconds)
  results.update(compute_metrics(truth, prediction, info.par_names, cellspike.training_mean(info.path)))
  results["train"] = _training_summary(config.logdir)
  files = _write_outputs(outdir, results, truth, prediction, info, plots)
  if export_dir:
    from analysis import export as export_lib  # pylint: disable=import-outside-toplevel
    files.append(export_lib.export_saved_model(net, config, info.input_shape, info.num_params,
                                               export_dir, par_names=info.par_names,
                                               model_options=_layer_form(config, backend)))
  return Evaluation(results=results, truth=truth, prediction=prediction, files=files)


def _checked_request(config: RunConfig, split: str, outdir: str, export_dir: str) -> str:
  """Refuses what evaluate_run cannot do before it evaluates anything (not in os.makedirs after it);
  returns the output folder, defaulted."""
  if model_registry.get_model_info(config.model).task != "regression":
    raise UserError("prediction reports are for regression models (neuron_inverter), not %s"
                    % config.model)
  if split not in SPLIT_KEYS:
    raise UserError("unknown split %r; valid splits: test, validation, train" % split)
  default_outdir = outdir is None
  outdir = outdir or os.path.join(config.logdir, PREDICT_DIR)
  if default_outdir:  # inside the run folder, where a link can only be planted (a given one is the user's)
    atomic_files.refuse_link(outdir, folder=True)
  check_output_path("--outdir", outdir, folder=True, default=default_outdir)
  for name in _report_names():  # before the evaluation, not after it
    atomic_files.refuse_link(os.path.join(outdir, name))
  if export_dir:
    check_output_path("--export_dir", export_dir, folder=True)
  return outdir


def _what_was_evaluated(config: RunConfig, backend: Backend, split: str, checkpoint: str, state: dict,
                        info, seconds: float) -> dict:
  """The head of sum_pred.yaml: which weights, data and hardware the evaluation used. Its paths are all
  absolute: the report may lie outside the run folder (--outdir), and is read from any folder."""
  return {
      "model": config.model,
      **model_registry.option_values(config),
      "logdir": os.path.abspath(config.logdir),
      "checkpoint": os.path.abspath(checkpoint),
      "checkpoint_epoch": state.get("epoch"),
      "data_path": os.path.abspath(info.path),
      "split": split,
      "backend": backend.kind,
      "replicas": backend.replicas,
      "precision": str(backend.precision),  # its name, e.g. "16.32"
      "input_shape": list(info.input_shape),
      "predict_seconds": seconds,
  }


def _training_summary(logdir: str) -> Optional[dict]:
  """The training run's own figures from its summary.yaml (None if it has none)."""
  summary = summary_lib.read_summary(logdir)
  if not summary:
    return None
  return {key: summary.get(key) for key in ("epochs", "train_loss", "val_loss", "test_loss", "best_val_loss",
                                            "wall_seconds", "replicas", "backend")}


# The files a report writes into its folder (with a TensorBoard event file of a fresh name).
def _report_names() -> tuple:
  from analysis import plots as plots_lib  # pylint: disable=import-outside-toplevel
  return (SUM_PRED, PREDICTIONS, plots_lib.TRUTH_VS_PRED_PNG, plots_lib.RESIDUALS_PNG,
          plots_lib.TRAINING_CURVES_PNG)


def _write_outputs(outdir: str, results: dict, truth, prediction, info, plots: bool) -> list:
  """sum_pred.yaml, U and Z, the figures (with `plots`) and their TensorBoard events into `outdir`;
  returns the paths written.

  They are written into a private folder inside `outdir` and moved into it together once all are
  written (host/atomic_files.py: staged_files): a full disk or a file-size limit is one error naming
  the file, and `outdir` keeps the report it held, never part of a new one. A link at one of their
  names is an error naming it, never written through."""
  try:
    os.makedirs(outdir, exist_ok=True)
  except OSError as error:
    raise atomic_files.write_error(outdir, error) from None
  for name in _report_names():
    atomic_files.refuse_link(os.path.join(outdir, name))
  with atomic_files.staged_files(outdir) as staging:
    files = [summary_lib.write_yaml(os.path.join(staging, SUM_PRED), results)]
    # U and Z themselves, for further analysis (rows in the order the model read them).
    with atomic_files.replaced(os.path.join(staging, PREDICTIONS), "wb") as handle:
      np.savez(handle, truth=truth, prediction=prediction,
               par_names=np.array([str(name) for name in info.par_names]))
    files.append(os.path.join(staging, PREDICTIONS))
    figures = []
    if plots:
      from analysis import plots as plots_lib  # pylint: disable=import-outside-toplevel
      figures = plots_lib.plot_prediction(truth, prediction, results, staging, meta=info.meta)
      files += figures
      history = plots_lib.load_history(results["logdir"])
      if history:
        files.append(plots_lib.plot_training_curves(history, staging, title=_run_title(results)))
    try:
      files.append(events.write_prediction_events(staging, figures, format_table(results), results["split"],
                                                  results["mse"],
                                                  epoch_step(results["checkpoint_epoch"] or 0)))
    except (OSError, tf.errors.OpError) as error:  # TensorFlow's writer names the cause in its message
      if not atomic_files.is_write_error(error):
        raise
      written = glob.glob(os.path.join(staging, "events.out.tfevents.*"))
      name = os.path.basename(written[0]) if written else "events.out.tfevents.*"
      raise atomic_files.write_error(os.path.join(outdir, name), error) from None
  return [os.path.join(outdir, os.path.basename(path)) for path in files]


def _run_title(results: dict) -> str:
  return "%s/%s, run %s" % (results["model"], results["design"], os.path.basename(results["logdir"]))


def format_table(results: dict) -> str:
  """The short per-parameter table printed by the tools: within 80 columns (rows of 84 would wrap
  in a terminal of that width), the name column as wide as the longest name (28 at most)."""
  width = max([len("parameter")] + [len(p["name"][:28]) for p in results["parameters"]])
  lines = ["%-3s %-*s %7s %7s %8s %8s  %s" % ("#", width, "parameter", "MSE", "r", "res.mean", "res.std",
                                              "verdict")]
  for p in results["parameters"]:
    lines.append("%-3d %-*s %7.4f %7.3f %8.4f %8.4f  %s" % (
        p["index"], width, p["name"][:28], p["mse"], p["pearson_r"], p["residual_mean"], p["residual_std"],
        p["verdict"]))
  counts = results["verdict_counts"]
  lines.append("%s split, %d samples: MSE %.4f (mean predictor %.4f); %d learned, %d weak, %d not learned "
               "(learned: r >= %g, weak: r >= %g)" % (
                   results["split"], results["num_samples"], results["mse"], results["mean_predictor_mse"],
                   counts[LEARNED], counts[WEAK], counts[NOT_LEARNED], LEARNED_MIN_R, WEAK_MIN_R))
  return "\n".join(lines)


def report(config: RunConfig, backend: Backend) -> None:
  """`main.py --predict`: evaluates the just-trained run on its test split into <logdir>/predict.

  Only the chief writes; the other processes of a multi-process run return at once, and the chief
  evaluates on a backend of its own (`Backend.alone`), so no collective operation waits for them.
  """
  if not config.predict or config.compile_only or not backend.is_chief:
    return
  solo = backend.alone()
  if solo is None:
    logging.warning("--predict is skipped in a multi-process %s run; evaluate the run afterwards in one "
                    "process: python tools/predict.py --logdir=%s", backend.label, config.logdir)
    return
  backend = solo
  evaluation = evaluate_run(dataclasses.replace(config, **summary_lib.EVAL_OVERRIDES), backend)
  print("\nPrediction (%s)\n%s" % (os.path.join(config.logdir, PREDICT_DIR),
                                   format_table(evaluation.results)), flush=True)
