"""Generates a synthetic cellSpike dataset from the numpy neuron model.

    python tools/generate_cellspike.py --out_dir=DIR [--cell_name=synth] [--num_train=20000]
        [--num_val=2000] [--num_test=2000] [--seed=0] [--fp16] [--probe_type=excite_4prB8kHz]
        [--workers=0] [--batch_size=1024] [--overwrite] [--sensitivity [--sensitivity_draws=8]]

Writes DIR/<cell_name>_excite.cellSpike_4prB8kHz.data.h5 and DIR/meta.cellSpike_<probe_type>.yaml
(see data/cellspike_generate.py). A cell's .h5 file already there is replaced only with --overwrite;
the meta yaml, which the folder's cells share, is rewritten (the keys the loaders read are the same
for every generated cell), unless those keys differ (a folder of other data): then only with
--overwrite. `--sensitivity` prints how much each of the 15 parameters changes the
traces (relative RMS change for u_k = -0.8 vs +0.8); without --out_dir it prints only that table.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import UserError, parse_flags, refuse_arguments, report_missing_packages, reported_on_one_line  # noqa: E402  pylint: disable=wrong-import-position
from stop_signals import ignore_stops_while_exiting  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position
from absl import logging  # noqa: E402  pylint: disable=wrong-import-position

from data import cellspike_generate  # noqa: E402  pylint: disable=wrong-import-position
from data import neuron_sim  # noqa: E402  pylint: disable=wrong-import-position
from host.cpuinfo import usable_cores  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out_dir", None, "Folder for the .h5 file and the meta yaml (created if missing).")
  flags.DEFINE_string("cell_name", "synth", "Cell name: replaces '*' in the h5 name template.")
  flags.DEFINE_integer("num_train", 20000, "Training samples.", lower_bound=1)
  flags.DEFINE_integer("num_val", 2000, "Validation samples.", lower_bound=1)
  flags.DEFINE_integer("num_test", 2000, "Test samples.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Seed of the parameter draws; the output is a function of it.",
                       lower_bound=0)
  flags.DEFINE_bool("fp16", False, "Store frames and parameters as float16 (as the *_fp16 files).")
  flags.DEFINE_string("probe_type", "excite_4prB8kHz",
                      "Names the meta yaml: meta.cellSpike_<probe_type>.yaml.")
  flags.DEFINE_integer("batch_size", 1024, "Cells simulated together (memory: ~60 kB per cell).",
                       lower_bound=1)
  flags.DEFINE_integer("workers", 0, "Simulation processes; 0 = one per core this process may use (its "
                       "affinity, capped by a cgroup CPU quota). Same output for any value.",
                       lower_bound=0)
  flags.DEFINE_bool("overwrite", False, "Replace the cell's dataset if --out_dir already holds one.")
  flags.DEFINE_bool("progress", True, "Progress line on stderr.")
  flags.DEFINE_bool("sensitivity", False, "Print the per-parameter sensitivity table.")
  flags.DEFINE_integer("sensitivity_draws", 8, "Random base cells behind the sensitivity table.",
                       lower_bound=1)


def refuse_to_overwrite(out_dir: str, cell_name: str, overwrite: bool,
                        probe_type: str = "excite_4prB8kHz") -> None:
  """A dataset that runs may have been trained on, or a meta yaml that describes other data, is
  replaced only when asked. (This tool's rule only: main.py's built-in dataset calls
  data/cellspike_generate.py itself, when its file is missing.)"""
  if overwrite:
    return
  path = os.path.join(out_dir, cellspike_generate.h5_name(cell_name))
  if os.path.exists(path):
    raise UserError("--out_dir=%s already holds %s: pass --overwrite to replace it, or choose another "
                    "--out_dir or --cell_name" % (out_dir, os.path.basename(path)))
  conflicts = cellspike_generate.meta_yaml_conflicts(out_dir, probe_type)
  if conflicts:
    raise UserError("--out_dir=%s: its %s describes other data (its %s %s from the generator's): pass "
                    "--overwrite to replace it, or choose another --out_dir"
                    % (out_dir, cellspike_generate.meta_yaml_name(probe_type), ", ".join(conflicts),
                       "differs" if len(conflicts) == 1 else "differ"))


def main(argv):
  refuse_arguments(argv)
  logging.set_verbosity(logging.INFO)
  with reported_on_one_line():
    if FLAGS.out_dir is None and not FLAGS.sensitivity:
      raise UserError("--out_dir is required (or --sensitivity alone for the table)")
    if FLAGS.out_dir is not None:
      refuse_to_overwrite(FLAGS.out_dir, FLAGS.cell_name, FLAGS.overwrite, FLAGS.probe_type)
      path = cellspike_generate.generate_dataset(
          FLAGS.out_dir, cell_name=FLAGS.cell_name, num_train=FLAGS.num_train, num_val=FLAGS.num_val,
          num_test=FLAGS.num_test, seed=FLAGS.seed, fp16=FLAGS.fp16, probe_type=FLAGS.probe_type,
          batch_size=FLAGS.batch_size, progress=FLAGS.progress, workers=FLAGS.workers or usable_cores())
      print(path)
    if FLAGS.sensitivity:
      result = neuron_sim.parameter_sensitivity(num_draws=FLAGS.sensitivity_draws, seed=FLAGS.seed)
      print("Relative RMS change of the traces, u_k = -0.8 vs +0.8, %d random base cells (seed %d):"
            % (FLAGS.sensitivity_draws, FLAGS.seed))
      print(neuron_sim.format_sensitivity(result))
    ignore_stops_while_exiting()  # the dataset is written: a signal must not make the job look killed


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)  # a bad flag: one `error:` line, exit status 2
