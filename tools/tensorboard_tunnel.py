"""Start TensorBoard on a run's logdir and print the SSH tunnel that shows it on your laptop.

    python tools/tensorboard_tunnel.py --logdir=logs/neuron_inverter/ipu-1234 [--port=6006]
        [--login_host=login.example.org] [--user=$USER] [--nostart]

On HPC systems the compute or IPU host is reached through a login node, so the tunnel forwards a
laptop port to this host's TensorBoard port via the login node (the ALCF and Neuron-Inverter guides
do the same by hand with `ssh -L`).
"""

import getpass
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import parse_flags, refuse_arguments, report_missing_packages  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

flags.DEFINE_string("logdir", None, "Run folder (or a parent of several runs).", required=True)
flags.DEFINE_integer("port", 6006, "TensorBoard port on this host and on the laptop.", lower_bound=1,
                     upper_bound=65535)  # checked before the ssh line is printed, not by TensorBoard after it
flags.DEFINE_string("login_host", os.environ.get("LOGIN_HOST", "<login-node>"),
                    "Login node that reaches this host (default: $LOGIN_HOST).")
flags.DEFINE_string("user", getpass.getuser(), "User name on the login node.")
flags.DEFINE_bool("start", True, "Start TensorBoard (else only print the commands).")
FLAGS = flags.FLAGS


def tunnel_command(user: str, login_host: str, host: str, port: int) -> str:
  return "ssh -N -L %d:%s:%d %s@%s" % (port, host, port, user, login_host)


def main(argv):
  refuse_arguments(argv)  # a stray word (a logdir without --logdir=): one line, as the other tools say it
  if not os.path.isdir(FLAGS.logdir):
    sys.exit("error: --logdir=%s is not a folder" % FLAGS.logdir)
  host = socket.gethostname()
  print("On your laptop run:\n  %s\nthen open http://localhost:%d/" % (
      tunnel_command(FLAGS.user, FLAGS.login_host, host, FLAGS.port), FLAGS.port), flush=True)
  if FLAGS.start:
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_tensorboard.py"),
               "--logdir", FLAGS.logdir, "--port", str(FLAGS.port), "--host", "0.0.0.0"]
    print("Starting: " + " ".join(command), flush=True)
    os.execv(sys.executable, command)  # TensorBoard in this process: Ctrl-C and SIGTERM go to it alone


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)  # a bad flag: one `error:` line, exit status 2
