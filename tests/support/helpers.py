"""Helpers shared by tests: running main.py as a user does, and checking one-line errors."""

import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_main(*args, timeout=300):
  """Runs `python main.py ARGS` as a user would; returns the CompletedProcess (text mode)."""
  env = dict(os.environ)
  for variable in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR"):  # set by importing TensorFlow in pytest:
    env.pop(variable, None)                                  # main.py must set them itself.
  return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "main.py")] + list(args),
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def hold_lock(logdir):
  """A separate process that takes `logdir`'s run lock (training/run_folder.py) and keeps it until
  killed, as a running job would; returns the Popen once the lock is held."""
  code = ("import sys, time; sys.path.insert(0, %r); from training import run_folder; run_folder.lock(%r); "
          "print('locked', flush=True); time.sleep(120)" % (REPO_ROOT, str(logdir)))
  holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "locked"
  return holder


def assert_one_line_error(result, *fragments):
  """A user error: non-zero exit, no traceback, one line on stderr containing every fragment."""
  assert result.returncode != 0, result.stdout + result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  # TensorFlow's own C++ log lines may precede ours; the application's error is the "error:" line.
  error_lines = [line for line in result.stderr.splitlines() if re.match(r"^(\S+: )?error: ", line)]
  assert len(error_lines) == 1, result.stderr
  for fragment in fragments:
    assert fragment in error_lines[0], error_lines[0]
