"""Figures of a Neuron-Inverter evaluation and of a run's training, for people without TensorBoard at hand.

- `truth_vs_pred.png`: one panel per parameter (a 4 x 4 grid for 15), a 2-D histogram of prediction
  against truth with the diagonal, the panel's MSE, Pearson r and residual mean/std, and the verdict in
  its colour (frame and label); the spare panel holds the run's figures. One colour scale for all
  panels (samples per bin, logarithmic), shown by the colour bar at the right.
- `residuals.png`: per-parameter histograms of the residual (prediction - truth) on one shared axis,
  samples per bin on the y axis, and a bar chart of r against the verdict thresholds.

Both are in the targets' unit u* (`<split>_unitStar_par`, docs/data.md): each conductance g as
(log10 g - centre) / half-range, about -1 to 1 over the decades the data's conductances span.
- `training_curves.png`: train/validation loss and learning rate per epoch, from the TensorBoard events
  (complete across resumed and unfinished runs), else from summary.yaml's `history`.

matplotlib's Agg backend is selected before pyplot is imported: the figures render the same on a
headless machine, and nothing opens a window.
"""

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
import yaml  # noqa: E402  pylint: disable=wrong-import-position

from host import atomic_files  # noqa: E402  pylint: disable=wrong-import-position
from training.summary import read_run_config  # noqa: E402  pylint: disable=wrong-import-position

# Colour-blind-safe verdict colours (green / orange / red from ColorBrewer RdYlGn, darkened for text).
VERDICT_COLORS = {"learned": "#1a9641", "weak": "#e66101", "not learned": "#c51b1b"}
TRUTH_VS_PRED_PNG = "truth_vs_pred.png"
RESIDUALS_PNG = "residuals.png"
TRAINING_CURVES_PNG = "training_curves.png"
_DPI = 110
COUNTS_LABEL = "samples per bin"
# What u* means, said on the figures that use it: the unit of every truth, prediction and residual.
U_STAR = "u* = (log10 g - centre) / half-range: each conductance g on a log scale, about -1 to 1"


def _grid(num_panels: int):
  """Rows x columns for `num_panels` plus one spare panel (4 x 4 for 15 parameters)."""
  columns = max(1, int(math.ceil(math.sqrt(num_panels + 1))))
  rows = int(math.ceil((num_panels + 1) / columns))
  return rows, columns


def _limits(truth: np.ndarray):
  """Common axis range of truth and prediction: the truth's range plus a 10% margin."""
  low, high = float(np.min(truth)), float(np.max(truth))
  margin = 0.1 * max(high - low, 1e-6)
  return low - margin, high + margin


def _short(name: str, width: int = 30) -> str:
  """`name` in at most `width` characters, cut in the middle: a file's or run's end (extension,
  timestamp) tells it from its neighbours more often than its start does."""
  if len(name) <= width:
    return name
  head = (width - 1) // 2
  return name[:head] + "…" + name[len(name) - (width - 1 - head):]


def _color_frame(ax, color: str) -> None:
  for spine in ax.spines.values():
    spine.set_edgecolor(color)
    spine.set_linewidth(2.2)


def _run_lines(results: dict) -> list:
  train = results.get("train") or {}
  counts = results["verdict_counts"]
  rule = results["verdict_rule"]
  lines = [
      "%s / %s" % (results["model"], results["design"]),
      "run: %s" % _short(os.path.basename(results["logdir"].rstrip("/")), 34),
      "data: %s" % _short(os.path.basename(results["data_path"]), 34),
      "split: %s, %d samples" % (results["split"], results["num_samples"]),
      "checkpoint epoch: %s" % results.get("checkpoint_epoch"),
      "",
      "MSE: %.4f" % results["mse"],
      "mean-predictor MSE: %.4f" % results["mean_predictor_mse"],
  ]
  if train.get("val_loss") is not None:
    lines.append("val loss, last epoch: %.4f" % train["val_loss"])
  if train.get("epochs") is not None:
    lines.append("trained: %s epochs, %s x %s" % (train["epochs"], train.get("replicas"),
                                                   str(train.get("backend", "")).upper()))
  lines += ["", "learned (r >= %g): %d" % (rule["learned_min_r"], counts["learned"]),
            "weak (%g <= r < %g): %d" % (rule["weak_min_r"], rule["learned_min_r"], counts["weak"]),
            "not learned (r < %g): %d" % (rule["weak_min_r"], counts["not learned"])]
  return lines


def _info_panel(ax, results: dict) -> None:
  ax.axis("off")
  lines = _run_lines(results)
  ax.text(0.02, 0.98, "\n".join(lines[:-3]), transform=ax.transAxes, va="top", ha="left", fontsize=9.5,
          family="monospace")
  # The three verdict lines in their colours, at the bottom.
  for i, (line, verdict) in enumerate(zip(lines[-3:], ("learned", "weak", "not learned"))):
    ax.text(0.02, 0.2 - 0.09 * i, line, transform=ax.transAxes, va="top", ha="left", fontsize=9.5,
            family="monospace", color=VERDICT_COLORS[verdict], fontweight="bold")


def _density_colormap():
  """Blues without its near-white end: a bin holding a single sample must still show."""
  from matplotlib.colors import ListedColormap  # pylint: disable=import-outside-toplevel
  return ListedColormap(plt.get_cmap("Blues")(np.linspace(0.3, 1.0, 256)))


def _shared_log_norm(truth, prediction, parameters, bins: int):
  """One colour scale for every panel's 2-D histogram: logarithmic from 1 sample per bin (a learned
  parameter piles hundreds of samples into its diagonal's bins, a lone sample must still show) to the
  fullest bin of any panel, so that the colour bar reads the same in each."""
  from matplotlib.colors import LogNorm  # pylint: disable=import-outside-toplevel
  peak = 1.0
  for p in parameters:
    i = p["index"]
    low, high = _limits(truth[:, i])
    counts, _, _ = np.histogram2d(truth[:, i], prediction[:, i], bins=bins, range=[[low, high], [low, high]])
    peak = max(peak, float(counts.max()))
  return LogNorm(vmin=1.0, vmax=max(peak, 2.0))


def truth_vs_prediction_figure(truth, prediction, results: dict, bins: int = 0):
  """The 4 x 4 grid of 2-D histograms (prediction against truth) with each parameter's figures and the
  colour bar of their shared scale; returns the matplotlib figure (`plot_truth_vs_prediction` writes it)."""
  parameters = results["parameters"]
  bins = bins or int(np.clip(0.8 * math.sqrt(len(truth)), 10, 40))  # about 1 sample per bin on average
  cmap = _density_colormap()
  norm = _shared_log_norm(truth, prediction, parameters, bins)
  rows, columns = _grid(len(parameters))
  fig, axes = plt.subplots(rows, columns, figsize=(4.0 * columns, 3.9 * rows), squeeze=False)
  axes = axes.ravel()
  image = None
  for ax, p in zip(axes, parameters):
    i = p["index"]
    low, high = _limits(truth[:, i])
    color = VERDICT_COLORS[p["verdict"]]
    image = ax.hist2d(truth[:, i], prediction[:, i], bins=bins, range=[[low, high], [low, high]], cmap=cmap,
                      cmin=1, norm=norm)[3]
    ax.plot([low, high], [low, high], color="#d01c8b", linestyle="--", linewidth=1.2)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal")
    ax.set_title("%d: %s" % (i, _short(p["name"])), fontsize=10)
    ax.tick_params(labelsize=8)
    ax.text(0.03, 0.97, "MSE   %.4f\nr     %.3f\nresid %+.3f ± %.3f" % (
        p["mse"], p["pearson_r"], p["residual_mean"], p["residual_std"]),
            transform=ax.transAxes, va="top", ha="left", fontsize=8.5, family="monospace",
            bbox=dict(boxstyle="round,pad=0.25", facecolor="white", edgecolor="#bbbbbb", alpha=0.85))
    ax.text(0.97, 0.03, p["verdict"].upper(), transform=ax.transAxes, va="bottom", ha="right",
            fontsize=9, fontweight="bold", color="white",
            bbox=dict(boxstyle="round,pad=0.3", facecolor=color, edgecolor=color))
    _color_frame(ax, color)
  for ax in axes[:len(parameters)]:
    if ax.get_subplotspec().is_last_row() or ax is axes[len(parameters) - 1]:
      ax.set_xlabel("truth (u*)", fontsize=9)
    if ax.get_subplotspec().is_first_col():
      ax.set_ylabel("prediction (u*)", fontsize=9)
  _info_panel(axes[len(parameters)], results)
  title = ("Truth vs prediction per parameter: %s split, %d samples, MSE %.4f\n(dashed: perfect prediction; "
           "colour: samples per bin, bar at right; resid = prediction - truth, mean ± std; frame colour: "
           "verdict)\n%s" % (results["split"], results["num_samples"], results["mse"], U_STAR))
  _lay_out_grid(fig, axes[len(parameters) + 1:], title, top=0.945, right=0.94)
  colour_bar = fig.colorbar(image, cax=fig.add_axes([0.952, 0.3, 0.011, 0.4]), format="%g",
                            ticks=matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, ...
  colour_bar.set_label(COUNTS_LABEL + " (all panels, log scale)", fontsize=10)
  colour_bar.ax.tick_params(labelsize=8)
  return fig


def plot_truth_vs_prediction(truth, prediction, results: dict, path: str, bins: int = 0) -> str:
  """Writes `truth_vs_prediction_figure` to `path`; returns `path`."""
  return _save(truth_vs_prediction_figure(truth, prediction, results, bins), path)


def residuals_figure(truth, prediction, results: dict, bins: int = 50):
  """Per-parameter residual histograms on a shared axis, and r per parameter against the thresholds;
  returns the matplotlib figure (`plot_residuals` writes it)."""
  parameters = results["parameters"]
  residual = np.asarray(prediction, np.float64) - np.asarray(truth, np.float64)
  reach = float(np.percentile(np.abs(residual), 99.5)) or 1.0
  edges = np.linspace(-reach, reach, bins + 1)
  rows, columns = _grid(len(parameters))
  fig, axes = plt.subplots(rows, columns, figsize=(4.0 * columns, 3.1 * rows), squeeze=False)
  axes = axes.ravel()
  for ax, p in zip(axes, parameters):
    i = p["index"]
    color = VERDICT_COLORS[p["verdict"]]
    ax.hist(np.clip(residual[:, i], -reach, reach), bins=edges, color=color, alpha=0.75,
            histtype="stepfilled")
    ax.axvline(0.0, color="black", linewidth=1.0)
    ax.axvline(p["residual_mean"], color="#d01c8b", linestyle="--", linewidth=1.2)
    ax.set_xlim(-reach, reach)
    ax.set_title("%d: %s" % (i, _short(p["name"])), fontsize=10)
    ax.tick_params(labelsize=8)
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=4, integer=True))
    ax.text(0.03, 0.97, "mean %+.3f\nstd  %.3f\nr    %.3f" % (p["residual_mean"], p["residual_std"],
                                                              p["pearson_r"]),
            transform=ax.transAxes, va="top", ha="left", fontsize=8.5, family="monospace",
            bbox=dict(boxstyle="round,pad=0.25", facecolor="white", edgecolor="#bbbbbb", alpha=0.85))
    if ax.get_subplotspec().is_last_row() or ax is axes[len(parameters) - 1]:
      ax.set_xlabel("prediction - truth (u*)", fontsize=9)
    if ax.get_subplotspec().is_first_col():
      ax.set_ylabel(COUNTS_LABEL, fontsize=9)
  _correlation_bars(axes[len(parameters)], results)
  title = ("Residuals (prediction - truth) per parameter: %s split, %d samples\n(dashed: mean; "
           "colour: verdict; shared x axis, the outer 0.5%% piled at the edges; y: %s, per panel)\n%s"
           % (results["split"], results["num_samples"], COUNTS_LABEL, U_STAR))
  _lay_out_grid(fig, axes[len(parameters) + 1:], title, top=0.93)
  return fig


def plot_residuals(truth, prediction, results: dict, path: str, bins: int = 50) -> str:
  """Writes `residuals_figure` to `path`; returns `path`."""
  return _save(residuals_figure(truth, prediction, results, bins), path)


def _lay_out_grid(fig, unused_axes, title: str, top: float, right: float = 1.0) -> None:
  """Blanks the grid's unused panels, titles the figure and lays the panels out below the title (and
  left of `right`, the figure's share kept for a colour bar)."""
  for ax in unused_axes:
    ax.axis("off")
  fig.suptitle(title, fontsize=13)
  fig.tight_layout(rect=(0, 0, right, top))


def _save(fig, path: str) -> str:
  """Writes `fig` as the PNG `path` (whole or not at all, never through a link: host/atomic_files.py;
  a failed write is a UserError naming it) and closes it; returns `path`."""
  try:
    with atomic_files.replaced(path, "wb") as handle:
      fig.savefig(handle, format="png", dpi=_DPI)
  finally:
    plt.close(fig)
  return path


def _correlation_bars(ax, results: dict) -> None:
  parameters = results["parameters"]
  rule = results["verdict_rule"]
  positions = np.arange(len(parameters))
  ax.barh(positions, [p["pearson_r"] for p in parameters],
          color=[VERDICT_COLORS[p["verdict"]] for p in parameters])
  for threshold in (rule["weak_min_r"], rule["learned_min_r"]):
    ax.axvline(threshold, color="#555555", linestyle=":", linewidth=1.2)
  ax.set_yticks(positions)
  ax.set_yticklabels([str(p["index"]) for p in parameters], fontsize=7)
  ax.invert_yaxis()
  ax.set_xlim(min(0.0, min(p["pearson_r"] for p in parameters)), 1.0)
  ax.set_xlabel("Pearson r (dotted: %g, %g)" % (rule["weak_min_r"], rule["learned_min_r"]), fontsize=9)
  ax.set_ylabel("parameter", fontsize=9)
  ax.tick_params(labelsize=8)
  ax.set_title("correlation per parameter", fontsize=10)


def plot_prediction(truth, prediction, results: dict, outdir: str, meta=None) -> list:
  """Writes the truth-vs-prediction grid and the residual figure into `outdir`; returns their paths."""
  del meta  # parameter names already come with the results (the file's parName)
  return [plot_truth_vs_prediction(truth, prediction, results, os.path.join(outdir, TRUTH_VS_PRED_PNG)),
          plot_residuals(truth, prediction, results, os.path.join(outdir, RESIDUALS_PNG))]


# --- Training curves -----------------------------------------------------------------------------------

def _series_by_epoch(pairs) -> dict:
  """{epoch (1-based): value}; a step logged twice (a resumed run redoing an epoch) keeps the last."""
  return {int(step) + 1: value for step, value in pairs}


def _history_from_events(logdir: str) -> dict:
  from analysis.events import read_scalars  # pylint: disable=import-outside-toplevel
  train_dir, val_dir = os.path.join(logdir, "train"), os.path.join(logdir, "validation")
  if not os.path.isdir(train_dir):
    return {}
  train = read_scalars(train_dir)
  if "epoch_loss" not in train:
    return {}
  series = {"loss": _series_by_epoch(train["epoch_loss"])}
  if "epoch_lr" in train:
    series["lr"] = _series_by_epoch(train["epoch_lr"])
  if os.path.isdir(val_dir):
    validation = read_scalars(val_dir)
    if "epoch_loss" in validation:
      series["val_loss"] = _series_by_epoch(validation["epoch_loss"])
  epochs = sorted(series["loss"])
  return {"source": "TensorBoard events", "epoch": epochs,
          **{key: [values.get(e, float("nan")) for e in epochs] for key, values in series.items()}}


def _history_from_summary(logdir: str) -> dict:
  path = os.path.join(logdir, "summary.yaml")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    summary = yaml.safe_load(f) or {}
  history = summary.get("history") or {}
  if not history.get("loss"):
    return {}
  epochs = history.get("epoch") or list(range(1, len(history["loss"]) + 1))  # every epoch of the run
  return dict({key: history[key] for key in ("loss", "val_loss", "lr") if key in history},
              epoch=epochs, source="summary.yaml")


def load_history(logdir: str) -> dict:
  """Per-epoch loss, val_loss and lr of a run, finished or not; {} if nothing was logged yet.

  The TensorBoard events hold every epoch, across `--resume`s and before the run ends; summary.yaml's
  history (written at the end, covering the last invocation only) is the fallback. Extra keys:
  `epoch` (1-based), `source`, and `mean_predictor_val_loss` / `best_val_epoch` when summary.yaml has them.
  """
  try:
    history = _history_from_events(logdir)
  except Exception:  # pylint: disable=broad-except  (unreadable/partial events: fall back)
    history = {}
  history = history or _history_from_summary(logdir)
  path = os.path.join(logdir, "summary.yaml")
  if history and os.path.isfile(path):
    with open(path) as f:
      summary = yaml.safe_load(f) or {}
    for key in ("mean_predictor_val_loss", "best_val_epoch"):
      if summary.get(key) is not None:
        history[key] = summary[key]
  if history:
    schedule = (read_run_config(logdir) or {}).get("lr_schedule")
    if schedule:
      history["lr_schedule"] = schedule
  return history


def _plain_log_labels(ax) -> None:
  """Log-scale ticks labelled 0.2, 0.3, ... instead of 2 x 10^-1 (the losses span a decade or so)."""
  formatter = matplotlib.ticker.FormatStrFormatter("%.3g")
  ax.yaxis.set_major_formatter(formatter)
  ax.yaxis.set_minor_formatter(formatter)
  ax.tick_params(axis="y", which="both", labelsize=10)


def lr_axis_scale(history: dict) -> str:
  """"log" for rates that span more than 3x in steps (reduce-on-plateau's factor-of-9 cuts), else "linear".

  A cosine ends near 0 (2e-9 after the default job's last epoch), where a log axis would give that last
  point most of the panel.
  """
  lrs = [v for v in history.get("lr") or [] if v and np.isfinite(v) and v > 0]
  if lrs and max(lrs) / min(lrs) > 3 and history.get("lr_schedule") != "cosine":
    return "log"
  return "linear"


def plot_training_curves(history: dict, outdir: str, title: str = "") -> str:
  """Loss (train, validation; log scale) and learning rate per epoch, one above the other."""
  epochs = history["epoch"]
  fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True,
                                       gridspec_kw={"height_ratios": [2.2, 1]})
  marker = "o" if len(epochs) <= 40 else None
  ax_loss.plot(epochs, history["loss"], marker=marker, markersize=4, color="#2c7bb6", label="train loss")
  if history.get("val_loss"):
    ax_loss.plot(epochs, history["val_loss"], marker=marker, markersize=4, color="#d7191c",
                 label="validation loss")
  if history.get("mean_predictor_val_loss"):
    ax_loss.axhline(history["mean_predictor_val_loss"], color="#777777", linestyle="--", linewidth=1.2,
                    label="mean predictor (val) %.3f" % history["mean_predictor_val_loss"])
  best = history.get("best_val_epoch")
  if best in epochs and history.get("val_loss"):
    value = history["val_loss"][epochs.index(best)]
    ax_loss.plot([best], [value], marker="*", markersize=15, color="#d7191c", linestyle="none",
                 label="best val %.4f (epoch %d)" % (value, best))
  values = [v for key in ("loss", "val_loss") for v in history.get(key) or [] if v and np.isfinite(v)]
  if values and min(values) > 0 and max(values) / min(values) > 3:
    ax_loss.set_yscale("log")
    _plain_log_labels(ax_loss)
  ax_loss.set_ylabel("MSE loss", fontsize=11)
  ax_loss.grid(True, which="both", alpha=0.3)
  ax_loss.legend(fontsize=9)
  ax_loss.set_title("Training curves: %s (%d epochs, from %s)" % (title, len(epochs), history["source"]),
                    fontsize=11)
  if history.get("lr"):
    ax_lr.plot(epochs, history["lr"], marker=marker, markersize=4, color="#1a9641")
    if lr_axis_scale(history) == "log":
      ax_lr.set_yscale("log")
    else:
      ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
  else:
    ax_lr.text(0.5, 0.5, "no learning rate logged", transform=ax_lr.transAxes, ha="center")
  ax_lr.set_ylabel("learning rate", fontsize=11)
  ax_lr.set_xlabel("epoch", fontsize=11)
  ax_lr.grid(True, which="both", alpha=0.3)
  ax_lr.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  fig.tight_layout()
  return _save(fig, os.path.join(outdir, TRAINING_CURVES_PNG))
