"""TensorBoard on a run folder, with a quiet start on a machine without a GPU.

    .venv/bin/python tools/serve_tensorboard.py --logdir logs/neuron_inverter/20261125-221940 [--port 6006]

Every argument goes to TensorBoard unchanged (`--help` lists them). `tensorboard --logdir ...` shows the
same pages, but TensorBoard imports TensorFlow, whose CUDA probe writes "failed call to cuInit" and
"Could not find cuda drivers" errors on a CPU-only machine before the server starts; here they are
dropped. A local `--logdir` that does not exist is an error instead of an empty dashboard, a `--port`
outside 0..65535 one line instead of TensorBoard's two, and a bad TensorBoard flag is one
`tensorboard: error:` line without the page of usage.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import OneLineArgumentParser, UserError, report_missing_packages, reported_on_one_line  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

from strategies.environment import quiet_tensorflow_import  # noqa: E402  pylint: disable=wrong-import-position


def _values(argv, flag="--logdir"):
  """The values of `flag` in TensorBoard's arguments, in either spelling."""
  values = []
  for index, argument in enumerate(argv):
    if argument.startswith(flag + "="):
      values.append(argument[len(flag + "="):])
    elif argument == flag and index + 1 < len(argv):
      values.append(argv[index + 1])
  return values


def check_logdirs(argv) -> None:
  for logdir in _values(argv):
    if "://" not in logdir and not os.path.isdir(logdir):  # gs:// and other remote paths: TensorBoard's
      raise UserError("--logdir=%s: no such folder (a run folder, or a folder of runs such as "
                      "logs/neuron_inverter)" % logdir)


def check_ports(argv) -> None:
  """--port is TensorBoard's flag, not ours (no absl bounds): a number out of range is checked here,
  before TensorFlow's start; a value that is no number ("default") is TensorBoard's to judge."""
  for port in _values(argv, "--port"):
    try:
      number = int(port)  # as TensorBoard reads it
    except ValueError:
      continue
    if not 0 <= number <= 65535:
      raise UserError("--port=%s: expected a port number from 0 to 65535 (0: any free port)" % port)


def main(argv) -> int:
  with reported_on_one_line():  # a bad --logdir, or Ctrl-C during the import: one line
    check_logdirs(argv[1:])
    check_ports(argv[1:])
    with quiet_tensorflow_import():
      import tensorflow  # pylint: disable=import-outside-toplevel
      tensorflow.config.list_physical_devices()  # the CUDA probe runs here, inside the quiet block
      from tensorboard import main as tensorboard_main  # pylint: disable=import-outside-toplevel
  sys.argv = ["tensorboard"] + list(argv[1:])
  # TensorBoard's flags are argparse (tensorboard/program.py), whose error prints the whole usage
  # first; this process has no other parser, so its errors become our one line (`--help` shows usage).
  argparse.ArgumentParser.error = OneLineArgumentParser.error
  return tensorboard_main.run_main()  # TensorBoard's own handling of its flags, Ctrl-C and SIGTERM


if __name__ == "__main__":
  sys.exit(main(sys.argv))
