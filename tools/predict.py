"""Evaluate a trained Neuron-Inverter run: sum_pred.yaml, per-parameter figures, an optional export.

    python tools/predict.py --logdir=logs/neuron_inverter/RUN                 # test split, built-in data
    python tools/predict.py --logdir=RUN --data_path=/data/cell.h5 --split=validation --max_samples=20000
    python tools/predict.py --logdir=RUN --export_dir=RUN/saved_model         # + a standalone SavedModel

The run is reloaded from its logdir alone: run_config.yaml (or summary.yaml's `params`) gives the
model, design, data and precision it was trained with, and checkpoints/best (else last) the weights;
`--data_path` and `--backend` may point elsewhere. Writes into `--outdir` (default `<logdir>/predict`):
`sum_pred.yaml` (overall and per-parameter MSE, residual mean/std, Pearson r, learned/weak/not-learned
verdicts with their thresholds), `truth_vs_pred.png`, `residuals.png`, `training_curves.png`, and
prints the per-parameter table. A problem (no run, no checkpoint, data that do not fit, an output folder
that is full or has a link at an output's name) is one `error:` line and exit status 1. The outputs are
written together (analysis/evaluation.py): a report that fails leaves the folder's earlier one as it was.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import UserError, parse_flags, refuse_arguments, report_missing_packages, reported_on_one_line  # noqa: E402  pylint: disable=wrong-import-position
from stop_signals import ignore_stops_while_exiting  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

import flags as app_flags  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
SPLITS = ("test", "validation", "train")


def define_flags() -> None:
  """Flags only when run as a program: tests import modules beside main.py's flags."""
  flags.DEFINE_string("logdir", None, "Folder of the trained run (its run_config.yaml/summary.yaml and "
                      "checkpoints/).", required=True)
  flags.DEFINE_string("data_path", None, "cellSpike .h5 file (or folder, with the run's --cell_name) to "
                      "evaluate; default: the data the run was trained on.")
  flags.DEFINE_string("cell_name", None, "With a folder --data_path: the cell whose file to evaluate "
                      "(default: the run's).")
  flags.DEFINE_string("probe_type", None, "With a folder --data_path: the meta yaml's probe type "
                      "(default: the run's).")
  flags.DEFINE_enum("split", "test", SPLITS, "Which split of the file to evaluate.")
  flags.DEFINE_enum("backend", "auto", app_flags.BACKENDS, "Where to run the model.")
  flags.DEFINE_integer("replicas", 1, "Data-parallel replicas for the evaluation.", lower_bound=1)
  flags.DEFINE_integer("batch_size", None, "Batch per replica (default: the run's).", lower_bound=1)
  flags.DEFINE_integer("max_samples", 0, "Evaluate the split's first this many samples (at least one per "
                       "replica; on IPUs whole batches of them; 0: the whole split).",
                       lower_bound=0)
  flags.DEFINE_string("outdir", None, "Output folder (default: <logdir>/predict).")
  flags.DEFINE_string("export_dir", None, "Also export the model as a self-contained float32 SavedModel "
                      "here (loadable with tf.saved_model.load, no application code needed).")
  flags.DEFINE_bool("plots", True, "Write the PNG figures.")


def _cell_name():
  """--cell_name; else, with a --data_path file, none (the run's cell picked a file in its folder),
  else (None) the run's own."""
  if FLAGS.cell_name:
    return FLAGS.cell_name
  return "" if FLAGS.data_path and os.path.isfile(FLAGS.data_path) else None


def main(argv):
  refuse_arguments(argv)
  from training import logs  # pylint: disable=import-outside-toplevel
  logs.setup()
  with reported_on_one_line():
    # Plain Python first: the saved configuration decides TensorFlow's start-up environment.
    from strategies import environment, start  # pylint: disable=import-outside-toplevel
    from saved_config import load_run_config  # pylint: disable=import-outside-toplevel
    if FLAGS.data_path and not os.path.exists(FLAGS.data_path):
      raise UserError("--data_path=%s does not exist" % FLAGS.data_path)
    # This tool's --backend=auto and --replicas=1 apply unless given (a run trained on 4 IPUs is evaluated
    # where this runs), but only flags the user typed are named in an error about them.
    settings = {"backend": FLAGS.backend, "replicas": FLAGS.replicas}
    typed = {name: value for name, value in settings.items() if FLAGS[name].present}
    config = load_run_config(
        FLAGS.logdir, tool_defaults={name: settings[name] for name in settings if name not in typed}, **typed,
        data_path=FLAGS.data_path and os.path.abspath(FLAGS.data_path), cell_name=_cell_name(),
        probe_type=FLAGS.probe_type, batch_size=FLAGS.batch_size)
    environment.prepare(config)
    import data  # pylint: disable=import-outside-toplevel
    import model  # pylint: disable=import-outside-toplevel
    data.check_named_files(model.get_model_info(config.model).dataset, config)  # as main.py: at once
    config, backend = start.start_backend(config)  # imports TensorFlow
    config = model.settle_options(config, backend.hardware)  # a run's own file has them settled already
    from analysis import evaluation  # pylint: disable=import-outside-toplevel
    result = evaluation.evaluate_run(config, backend, split=FLAGS.split,
                                     max_samples=FLAGS.max_samples, outdir=FLAGS.outdir,
                                     plots=FLAGS.plots, export_dir=FLAGS.export_dir)
    ignore_stops_while_exiting()  # everything is written: only the lines below and the exit are left
  print(evaluation.format_table(result.results))
  print("Wrote " + ", ".join(result.files), flush=True)
  print("In TensorBoard (Images, Text and Scalars of the run %s): %s" % _tensorboard_hint(result.files),
        flush=True)


def _tensorboard_hint(files) -> tuple:
  """The report's TensorBoard run name and the command that shows it: over the run folder when the
  report lies inside it (beside the training curves), else over the report's own folder."""
  from training.summary import tool_command  # pylint: disable=import-outside-toplevel
  outdir = os.path.dirname(next(path for path in files if os.path.basename(path).startswith("events.out.")))
  inside = os.path.abspath(outdir).startswith(os.path.abspath(FLAGS.logdir) + os.sep)
  logdir = FLAGS.logdir if inside else outdir
  return os.path.relpath(outdir, logdir), tool_command("serve_tensorboard.py", logdir)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)  # a bad flag: one `error:` line, exit status 2
