"""The cost of the progress lines and the step-level TensorBoard scalars: the default job trained with
both off (--log_every=0 --log_every_n_steps=0) and on (--log_every, --log_every_n_steps), one main.py
run of each per round, their order alternating from round to round so that both see the machine in the
same state; prints each round's step times and the median ratio of on to off.

    python tools/benchmark_logging.py [--rounds=3] [--epochs=3] [--log_every_n_steps=50] [--log_every=30]
        [--replicas=4] [--batch_size=48] [--data_path=FILE.h5] [--main_flag=--design=dev ...] [--json=FILE]

A run's step time is its global batch over its training speed (summary.yaml's samples/s per replica x
replicas: the first epoch's compilation left out); both runs have --progress=epoch, as a Slurm job
writing to a file. Each run has a folder of its own under a temporary one, removed at the end. Nothing
in the test suite asserts a speed.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from errors import UserError, parse_flags, report_missing_packages, with_one_line_errors  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing
from host import atomic_files  # noqa: E402  pylint: disable=wrong-import-position

import yaml  # noqa: E402  pylint: disable=wrong-import-position
from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

flags.DEFINE_integer("rounds", 3, "Rounds of one run with the logging off and one with it on.", lower_bound=1)
flags.DEFINE_integer("epochs", 3, "Epochs of each run (the first, with compilation, is not timed).", lower_bound=2)
flags.DEFINE_integer("log_every_n_steps", 50, "main.py's --log_every_n_steps of the runs with it on.", lower_bound=1)
flags.DEFINE_float("log_every", 30.0, "main.py's --log_every of the runs with it on.", lower_bound=0.0)
flags.DEFINE_integer("replicas", 4, "main.py's --replicas (the default job's 4).", lower_bound=1)
flags.DEFINE_integer("batch_size", 48, "main.py's --batch_size (the default job's 48).", lower_bound=1)
flags.DEFINE_string("data_path", None, "cellSpike .h5 file (default: the built-in dataset).")
flags.DEFINE_multi_string("main_flag", [], "A further flag for every main.py run (repeat the flag for more).")
flags.DEFINE_string("json", None, "Write the results to this JSON file.")
FLAGS = flags.FLAGS


def _mode_flags(mode: str) -> tuple:
  if mode == "off":
    return ("--log_every=0", "--log_every_n_steps=0")
  return ("--log_every=%g" % FLAGS.log_every, "--log_every_n_steps=%d" % FLAGS.log_every_n_steps)


def _step_seconds(mode: str, logdir: str) -> float:
  """Trains the default job in `logdir` with the logging `mode` ("off", "on"); its seconds per step."""
  command = [sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter",
             "--replicas=%d" % FLAGS.replicas, "--batch_size=%d" % FLAGS.batch_size, "--epochs=%d" % FLAGS.epochs,
             "--progress=epoch", "--logdir=" + logdir, *_mode_flags(mode), *FLAGS.main_flag]
  if FLAGS.data_path:
    command.append("--data_path=" + FLAGS.data_path)
  result = subprocess.run(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  if result.returncode != 0:
    last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    raise UserError("the run with the logging %s failed (exit %d): %s" % (mode, result.returncode, last))
  with open(os.path.join(logdir, "summary.yaml"), encoding="utf-8") as handle:
    summary = yaml.safe_load(handle)
  rate = summary.get("samples_per_sec_per_replica")
  if not rate:
    raise UserError("the run with the logging %s has no timed epoch (summary.yaml: samples_per_sec_per_replica "
                    "is %r): raise --epochs" % (mode, rate))
  return summary["global_batch_size"] / (rate * summary["replicas"])


def main(argv):
  del argv
  if FLAGS.json:  # checked first: a mistyped path would fail after the benchmark
    from host.output_paths import check_output_path  # pylint: disable=import-outside-toplevel
    check_output_path("--json", FLAGS.json)
  rounds = []
  with tempfile.TemporaryDirectory(prefix="benchmark_logging.") as folder:
    for index in range(FLAGS.rounds):
      order = ("off", "on") if index % 2 == 0 else ("on", "off")
      seconds = {mode: _step_seconds(mode, os.path.join(folder, "%d-%s" % (index, mode))) for mode in order}
      rounds.append(dict(seconds, ratio=seconds["on"] / seconds["off"]))
      print("round %d/%d: off %.1f ms/step, on %.1f ms/step, on / off %.3f" % (
          index + 1, FLAGS.rounds, 1e3 * seconds["off"], 1e3 * seconds["on"], rounds[-1]["ratio"]), flush=True)
  ratio = statistics.median(entry["ratio"] for entry in rounds)
  print("step time with --log_every=%g --log_every_n_steps=%d over without: median %.3f (%+.1f %%) of %d round(s)"
        % (FLAGS.log_every, FLAGS.log_every_n_steps, ratio, 100 * (ratio - 1), len(rounds)))
  if FLAGS.json:
    results = {"rounds": rounds, "median_ratio": ratio, "log_every": FLAGS.log_every,
               "log_every_n_steps": FLAGS.log_every_n_steps, "replicas": FLAGS.replicas,
               "batch_size": FLAGS.batch_size, "epochs": FLAGS.epochs, "main_flags": FLAGS.main_flag}
    with atomic_files.replaced(FLAGS.json) as f:  # whole or not at all, never through a link
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(with_one_line_errors(main), flags_parser=parse_flags)  # bad flag: `error:` line, exit 2
