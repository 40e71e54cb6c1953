"""Helpers shared by tests: running main.py as a user does, and checking that errors name what they are about."""

import os
import re
import shutil
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# A shell starts a command with SIGINT at its default action, which Python turns into KeyboardInterrupt.
# Under pytest-xdist a job was once seen starting with SIGINT and SIGQUIT ignored (SigIgn 0x81001006 in
# /proc/PID/status), as a child forked while another thread of the worker is inside C's system() would
# (it ignores both for its duration); an ignored SIGINT stays ignored across exec, and Python keeps it
# so. Tests that send SIGINT therefore start their program through this launcher (`python -c
# WITH_DEFAULT_SIGINT program args...`), which restores the default first.
WITH_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
# SIGHUP's default action, as a terminal's login shell gives it (pytest's processes may ignore it).
WITH_DEFAULT_SIGHUP = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                       "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")

def work_in(folder, monkeypatch):
  """Changes the working folder to `folder` as a shell that is there and starts the process would:
  PWD too, by which the printed commands' paths are chosen (errors.shown_path)."""
  folder.mkdir(parents=True, exist_ok=True)
  monkeypatch.chdir(folder)
  monkeypatch.setenv("PWD", str(folder))


def run_main(*args, timeout=300, prefix=(), env=None, one_stream=False):
  """Runs `python main.py ARGS` as a user would (after a `prefix` command such as `unshare`, with `env`
  added to the environment; with `one_stream`, stderr into stdout as a terminal shows them); returns
  the CompletedProcess (text mode)."""
  environment = dict(os.environ, **(env or {}))
  for variable in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR"):  # set by importing TensorFlow in pytest:
    environment.pop(variable, None)                          # main.py must set them itself.
  return subprocess.run(list(prefix) + [sys.executable, os.path.join(REPO_ROOT, "main.py")] + list(args),
                        cwd=REPO_ROOT, env=environment, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT if one_stream else subprocess.PIPE, text=True,
                        timeout=timeout)


def train_in_process(config):
  """training.loop.run on `config` as main.py runs it: settled by its backend (strategies.select.settle) and
  its model (model.settle_options); returns the run's summary."""
  import model  # pylint: disable=import-outside-toplevel  (TensorFlow: only for the tests that train)
  from strategies import select  # pylint: disable=import-outside-toplevel
  from training import loop  # pylint: disable=import-outside-toplevel
  config, backend = select.settle(config)
  return loop.run(model.settle_options(config, backend.hardware), backend)


def can_mount_tmpfs(folder) -> bool:
  """Whether this process may mount a tmpfs on `folder` in a private mount namespace (`unshare -m`:
  root, as CI runs); the mount never shows outside the command run there."""
  if not shutil.which("unshare") or not sys.platform.startswith("linux"):
    return False
  probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs '%s'" % folder],
                         capture_output=True, timeout=30)
  return probe.returncode == 0


def hold_lock(logdir):
  """A separate process that takes `logdir`'s run lock (training/run_folder.py) and keeps it until
  killed, as a running job would; returns the Popen once the lock is held."""
  code = ("import sys, time; sys.path.insert(0, %r); from training import run_folder; run_folder.lock(%r); "
          "print('locked', flush=True); time.sleep(120)" % (REPO_ROOT, str(logdir)))
  holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "locked"
  return holder


def assert_names(message, *names):
  """`message` (text or an exception) names each of `names`: the flag, file, key or value it is about.
  Tests check these, not the wording around them, so a message can be reworded without editing tests."""
  text = str(message)
  for name in names:
    assert str(name) in text, "%r not named in: %s" % (str(name), text)


def line_naming(text, name):
  """The first line of `text` (a log or an output) that names `name`, for assert_names to check that the
  other names are on that same line."""
  lines = [line for line in text.splitlines() if name in line]
  assert lines, "no line names %r in: %s" % (name, text[-3000:])
  return lines[0]


def assert_one_line_error(result, *names):
  """A user error: non-zero exit, no traceback, one `error:` line on stderr naming each of `names`
  (assert_names); returns that line."""
  assert result.returncode != 0, result.stdout + result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  # TensorFlow's own C++ log lines may precede ours; the application's error is the "error:" line.
  error_lines = [line for line in result.stderr.splitlines() if re.match(r"^(\S+: )?error: ", line)]
  assert len(error_lines) == 1, result.stderr
  assert_names(error_lines[0], *names)
  return error_lines[0]


def other_process_report(log: str, rank: int = 1):
  """From a non-chief process's log: the scratch folder it wrote its events and checkpoints to (and
  removed at its end) and the sha256 of its trained weights (None if it did not finish)."""
  scratch = re.search(r"Process %d writes its events and checkpoints to (\S+), removed" % rank, log).group(1)
  done = re.search(r"Process %d done, its weights' sha256 (\w+)" % rank, log)
  return scratch, done.group(1) if done else None
