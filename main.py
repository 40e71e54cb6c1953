"""Trains and tests a model on IPUs, GPUs or CPUs.

    python main.py --model=neuron_inverter --replicas=4     # the main job (`make run`)
    python main.py --model=mnist                            # the first check of a new system
    python main.py --model=neuron_inverter --logdir=RUN --resume --epochs=6   # continue a run

The application's flags are listed below (`--helpfull` adds absl's); README.md has more examples.
"""

# The entry point is kept thin on purpose: parse flags, freeze them into a RunConfig, set TensorFlow's
# start-up environment, then `train_and_evaluate(config)` (tests call it too). A UserError anywhere
# below becomes one line on stderr and exit status 1. The docstring above is absl's --help text.

import dataclasses
import os
import sys
import time

STARTED = time.monotonic()  # the process's start, near enough: the run's total time counts from here

from errors import parse_flags, refuse_arguments, report_missing_packages, reported_on_one_line
from stop_signals import exit_on_stop_signals, ignore_stops_while_exiting
if __name__ == "__main__":
  exit_on_stop_signals()  # a stop while the imports and flags load: its line and status too
report_missing_packages()  # before the first third-party import: run by a Python without them, one line

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags as absl_flags  # noqa: E402  pylint: disable=wrong-import-position
import data  # noqa: E402  pylint: disable=wrong-import-position
from data import sizes  # noqa: E402  pylint: disable=wrong-import-position
import flags  # noqa: E402  pylint: disable=wrong-import-position
import model  # noqa: E402  pylint: disable=wrong-import-position
from strategies import environment, start  # noqa: E402  pylint: disable=wrong-import-position
from training import logs, run_folder  # noqa: E402  pylint: disable=wrong-import-position
from training import summary as summary_lib  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = absl_flags.FLAGS


def train_and_evaluate(config, dated_logdir: bool = False, then_exit: bool = False) -> dict:
  """Everything after the flags: the backend, training and test, the --predict report, the closing
  report (or, after a graceful stop, the command that continues the run). TensorFlow's start-up
  environment must already be set (`environment.prepare`). `dated_logdir`: config.logdir is the dated
  default, which the run makes its own (another name if another run took it). `then_exit`: the process
  ends after the closing report, so stop signals are ignored from just before it: one sent as its last
  line is read (a time limit) could otherwise land before the exit began and make the finished run
  look killed. Returns the run's summary; a problem is a UserError."""
  # The data files that the flags name, and the sizes the flags imply, before TensorFlow's start: a
  # wrong one is an error at once.
  sizes.check(config, data.check_named_files(model.get_model_info(config.model).dataset, config))
  # The run folder, claimed before TensorFlow's start where this process is the run's only one (and so
  # its writer); in a run of several, the backend says which one is the chief (training/run_folder.py).
  alone = sizes.processes() == 1
  if alone:
    config = _claim_run_folder(config, dated_logdir)
  try:
    # Imports TensorFlow; from here the config holds what the backend decided (strategies/select.py settle),
    # and sys.argv the flags as typed, which a resume repeats.
    config, backend = start.start_backend(config)
    config = model.settle_options(config, backend.hardware)  # the model's "auto" options, for this hardware
    if not alone and backend.is_chief:
      config = _claim_run_folder(config, dated_logdir)
    from analysis.evaluation import check_report_possible, report  # pylint: disable=import-outside-toplevel
    from training.loop import run  # pylint: disable=import-outside-toplevel
    from training.interrupt import TrainingInterrupted  # pylint: disable=import-outside-toplevel
    check_report_possible(config)  # before training, not after it
  except BaseException:
    run_folder.abandon(config.logdir)  # the run (training/loop.py) releases the folder from here on
    raise
  def print_how_to_continue(intro=""):
    if backend.is_chief:
      print(intro + summary_lib.interrupted_report(sys.argv, config.logdir, config.epochs, backend.world_size),
            flush=True)
  try:
    summary = run(config, backend, process_started=STARTED, command_line=sys.argv)
  except TrainingInterrupted:
    print_how_to_continue()
    raise
  try:
    report(config, backend)  # --predict: sum_pred.yaml and figures into <logdir>/predict
  except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP (stop_signals.Terminated): its one line follows
    print_how_to_continue("\nThe run is finished (summary.yaml), its --predict report is not. ")
    raise
  if then_exit:
    ignore_stops_while_exiting()  # finished, and written: a signal must not make it look killed
  if backend.is_chief and not config.compile_only:
    closing = summary_lib.closing_report(summary, config.logdir, sys.argv, backend.world_size)
    print(closing, flush=True)
    logs.append_to_file(os.path.join(config.logdir, logs.LOG_FILE), closing)
  return summary


def _claim_run_folder(config, dated_logdir: bool):
  """Makes (`dated_logdir`) and claims the run's folder (training/run_folder.py: a finished run there is
  refused); prints where it is and how to watch it. Returns the config with the folder's name."""
  logdir = run_folder.open_for_run(config.logdir, config.resume, dated=dated_logdir)
  if not config.compile_only:  # nothing to watch: its folder is removed at its end
    print(summary_lib.run_folder_lines(logdir), flush=True)
  return dataclasses.replace(config, logdir=logdir)


def main(argv):
  refuse_arguments(argv)
  logs.setup()
  with reported_on_one_line():
    config = flags.to_config(FLAGS, command_line=sys.argv[1:])
    environment.prepare(config)
    train_and_evaluate(config, dated_logdir=FLAGS.logdir is None, then_exit=True)


def run_command_line():
  """The command line's run: flags defined (one per registered model's option too), parsed, `main`."""
  flags.define_flags()
  absl_flags.adopt_module_key_flags(flags)  # --help lists the application's flags, not only --helpfull
  app.run(main, flags_parser=parse_flags)  # a bad flag: one `error:` line, exit status 2


if __name__ == "__main__":
  run_command_line()
