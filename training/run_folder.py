"""What a run may do with its `--logdir`: one writer at a time, and never over another run.

- **A lock.** The process that writes the run's files (the chief; under multi-worker or poprun the
  others write scratch folders) holds `fcntl.flock` on `<logdir>/.lock` for its whole life. The kernel
  drops the lock when the process dies, however it dies, so a killed job never leaves it stuck. A
  second job into the same folder gets one line naming the holder's pid and host. flock is reliable
  on local file systems; on NFS it depends on the server's lock support.
- **No run over another.** A folder that already holds a run (its `summary.yaml` or checkpoints) is
  continued with `--resume` or left alone: a new run there would replace its checkpoints and summary.
  Start over in a fresh `--logdir`, or delete the old folder yourself. A run that stopped before its
  first checkpoint (killed in epoch 1, or failed there) left only its `run_config.yaml` and event files
  (perhaps the files of a save cut short, which no index names): nothing to continue and nothing to
  lose, so the same command starts it again there.
"""

import fcntl
import os
import socket

from absl import logging

from errors import UserError
from training import checkpoints
from training.logs import LOG_FILE

LOCK_FILE = ".lock"
RUN_MARKERS = ("run_config.yaml", "summary.yaml")  # what makes a folder a run's: predict reads it
SAVED_MARKERS = ("summary.yaml",)  # with the checkpoints, what a new run there would replace

_held = {}  # logdir -> open lock file, kept open (and so locked) until the process exits
_made = set()  # the folders make_new created in this process: new to its run, though they exist


def make_new(logdir: str) -> str:
  """Creates the folder `logdir` (the dated default), or `logdir-2`, `logdir-3`... where another process
  made it first (`os.mkdir` fails on a folder that exists, so two processes never get the same one);
  returns the name made."""
  name, count = logdir, 1
  try:
    os.makedirs(os.path.dirname(logdir) or ".", exist_ok=True)
    while True:
      try:
        os.mkdir(name)
      except FileExistsError:
        count += 1
        name = "%s-%d" % (logdir, count)
        continue
      _made.add(os.path.abspath(name))
      return name
  except OSError as error:
    raise UserError("cannot make the run folder %s, the default without --logdir (%s): pass "
                    "--logdir=<a writable folder>" % (logdir, error.strerror)) from None


def is_new(logdir: str) -> bool:
  """Whether `logdir` holds nothing of an earlier run: it does not exist yet, or make_new made it."""
  return not os.path.exists(logdir) or os.path.abspath(logdir) in _made


def holds_run(logdir: str) -> bool:
  """Whether `logdir` holds a run's results: its summary, or a checkpoint, which exists once a folder's
  index names it (training/checkpoints.py writes the index last; files it does not name yet are a
  save cut short)."""
  if any(os.path.exists(os.path.join(logdir, name)) for name in SAVED_MARKERS):
    return True
  return any(os.path.exists(os.path.join(logdir, "checkpoints", which, checkpoints.INDEX_FILE))
             for which in (checkpoints.LAST, checkpoints.BEST))


def started_without_saving(logdir: str) -> bool:
  """Whether `logdir` holds the start of a run that stopped before saving anything."""
  return not holds_run(logdir) and any(os.path.exists(os.path.join(logdir, name)) for name in RUN_MARKERS)


def lock(logdir: str) -> None:
  """Takes the folder's lock for this process; a UserError naming the holder if another has it."""
  path = os.path.abspath(logdir)
  if path in _held:
    return
  handle = open(os.path.join(path, LOCK_FILE), "a+")  # pylint: disable=consider-using-with
  try:
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    handle.seek(0)
    holder = handle.read().strip() or "another process"
    handle.close()
    raise UserError("--logdir=%s is in use by %s; wait for that run to end or choose another --logdir"
                    % (logdir, holder)) from None
  handle.seek(0)
  handle.truncate()
  handle.write("pid %d on %s\n" % (os.getpid(), socket.gethostname()))
  handle.flush()
  _held[path] = handle


def release(logdir: str) -> None:
  """Gives the lock up before the process ends (tests that run several jobs in one process)."""
  handle = _held.pop(os.path.abspath(logdir), None)
  if handle is not None:
    handle.close()


def claim(logdir: str, resume: bool) -> None:
  """Locks `logdir` for this run and refuses to start a new run over an earlier one, or to resume a
  run that saved nothing."""
  lock(logdir)
  if resume and not holds_run(logdir):
    release(logdir)
    if started_without_saving(logdir):
      raise UserError("--resume: the run in %s stopped before its first checkpoint, so there is nothing "
                      "to continue: start it again with the same command without --resume" % logdir)
    raise UserError("--resume: %s holds no run to continue (no checkpoint): start one there without "
                    "--resume" % logdir)
  if not resume and holds_run(logdir):
    release(logdir)
    raise UserError("--logdir=%s already holds a run (its checkpoints and summary would be replaced): "
                    "continue it with --resume, or choose a fresh --logdir" % logdir)
  if not resume and started_without_saving(logdir):
    logging.info("%s holds the start of a run that stopped before its first checkpoint: starting it "
                 "again there (its event files stay beside this run's)", logdir)


def remove_if_unused(logdir: str) -> None:
  """Removes `logdir`, which this run created, if the run failed before writing anything into it but
  its lock and its log: a bad command must not leave a timestamped folder behind for every try (its
  error is on stderr)."""
  release(logdir)
  try:
    if set(os.listdir(logdir)) <= {LOCK_FILE, LOG_FILE}:
      for name in (LOCK_FILE, LOG_FILE):
        if os.path.exists(os.path.join(logdir, name)):
          os.remove(os.path.join(logdir, name))
      os.rmdir(logdir)
  except OSError:
    pass  # another process wrote into it meanwhile, or it is gone: nothing of ours to clean
