"""What a run may do with its `--logdir`: one writer at a time, and never over another run.

- **A lock.** The process that writes the run's files (the chief; under multi-worker or poprun the
  others write scratch folders) holds `fcntl.flock` on `<logdir>/.lock` for its whole life. The kernel
  drops the lock when the process dies, however it dies, so a killed job never leaves it stuck. A
  second job into the same folder gets one line naming the holder's pid and host. flock is reliable
  on local file systems; on NFS it depends on the server's lock support. A run that ends (finished,
  failed or stopped) removes `.lock`; only a killed one leaves it, unlocked.
- **A refused command changes nothing.** The lock is taken before the run's checks (the flags against
  the checkpoint, the data), but what `.lock` held before is put back, and the log file is written
  only once the checks pass (`accepted`, training/logs.py): the error is on the terminal only.
- **No links.** A link (or a FIFO, a folder...) at a name the run writes (`refuse_links`) is one
  error naming it, before anything is written; the files themselves are opened with O_NOFOLLOW or
  written under fresh names and renamed (host/atomic_files.py).
- **Before TensorFlow.** Nothing here imports it: main.py claims the folder of a run of one process
  before TensorFlow starts (a run of several, once the backend says which process is the chief), so
  the folder is named, and a finished one refused, within a second of the command.
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
from host import atomic_files
from training import checkpoint_names
from training.logs import LOG_FILE

LOCK_FILE = ".lock"
HISTORY_FILE = "history.csv"  # a row per epoch, as Keras' CSVLogger writes it (training/callbacks.py)
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
  return any(os.path.exists(os.path.join(logdir, "checkpoints", which, checkpoint_names.INDEX_FILE))
             for which in (checkpoint_names.LAST, checkpoint_names.BEST))


def started_without_saving(logdir: str) -> bool:
  """Whether `logdir` holds the start of a run that stopped before saving anything."""
  return not holds_run(logdir) and any(os.path.exists(os.path.join(logdir, name)) for name in RUN_MARKERS)


class _Held:
  """A lock this process holds: its open file, what the file held before (None: this process made it),
  and whether the run was accepted (`accepted`)."""

  def __init__(self, handle, previous):
    self.handle, self.previous, self.accepted = handle, previous, False


def _open_lock(path: str):
  """(the lock file `path`, opened for reading and writing without following a link; whether it existed
  before; whether this process now holds its lock, false if another process does). A file that a
  finishing run removed after this process opened it is opened again: locking the removed file would
  lock nothing that a newcomer sees."""
  for _ in range(10):
    existed = os.path.lexists(path)
    handle = os.fdopen(atomic_files.open_lock_file(path), "r+")
    try:
      fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      return handle, existed, False
    try:
      current = os.lstat(path)
    except FileNotFoundError:
      current = None
    opened = os.fstat(handle.fileno())
    if current is not None and (current.st_ino, current.st_dev) == (opened.st_ino, opened.st_dev):
      return handle, existed, True
    handle.close()
  raise UserError("%s keeps being replaced while this run tries to lock it: is another program "
                  "removing it?" % path)


def lock(logdir: str) -> None:
  """Takes the folder's lock for this process, and writes its pid and host into `.lock` (for another
  job's message); a UserError naming the holder if another has it, or naming a link planted at
  `.lock` (which is never written through). What `.lock` held before (a killed run's pid) is kept
  until the run is `accepted`: a refused command puts it back (`release`)."""
  path = os.path.abspath(logdir)
  if path in _held:
    return
  lock_path = os.path.join(path, LOCK_FILE)
  handle, existed, locked = _open_lock(lock_path)
  if not locked:
    handle.seek(0)
    holder = handle.read().strip() or "another process"
    handle.close()
    raise UserError("--logdir=%s is in use by %s; wait for that run to end or choose another --logdir"
                    % (logdir, holder)) from None
  handle.seek(0)
  previous = handle.read() if existed else None
  try:
    _rewrite(handle, "pid %d on %s\n" % (os.getpid(), socket.gethostname()))
  except OSError as error:
    handle.close()
    raise atomic_files.write_error(lock_path, error) from None
  _held[path] = _Held(handle, previous)


def _rewrite(handle, text: str) -> None:
  handle.seek(0)
  handle.truncate()
  handle.write(text)
  handle.flush()


def accepted(logdir: str) -> None:
  """The run in `logdir` passed its checks and writes its outputs: `.lock` is removed at its end
  (`release`), whatever it held before."""
  held = _held.get(os.path.abspath(logdir))
  if held is not None:
    held.accepted = True


def release(logdir: str) -> None:
  """Gives the lock up (at the end of a run; tests that run several jobs in one process). A run that
  was accepted removes `.lock`: a finished or stopped run leaves none behind (a killed one does, which
  holds no lock). A refused one leaves the folder as it was: `.lock` removed if it made it, else given
  back what it held."""
  path = os.path.abspath(logdir)
  held = _held.pop(path, None)
  if held is None:
    return
  try:
    if held.accepted or held.previous is None:
      os.remove(os.path.join(path, LOCK_FILE))  # while locked: no newcomer can hold the removed file
    else:
      _rewrite(held.handle, held.previous)
  except OSError as error:
    logging.warning("Could not tidy %s (%s)", os.path.join(path, LOCK_FILE), error.strerror)
  finally:
    held.handle.close()


# The names a run writes in its folder (files, and folders it writes into), besides TensorFlow's event
# files, which TensorFlow names afresh: a link at any of them is refused before anything is written.
# summary.yaml.tmp is no name the run writes (its temporaries are fresh), so a link there was planted.
FIXED_FILES = (LOCK_FILE, LOG_FILE, HISTORY_FILE, "summary.yaml", "summary.yaml.tmp", "run_config.yaml")
FIXED_FOLDERS = ("checkpoints", os.path.join("checkpoints", checkpoint_names.LAST),
                 os.path.join("checkpoints", checkpoint_names.BEST), "train", "validation", "test", "predict")


def refuse_links(logdir: str) -> None:
  """A UserError naming the first link (or other non-file) found where the run writes a file, or a
  folder it writes into: whoever can create names in a shared run folder could otherwise make this
  run overwrite the link's target, a file of the user's elsewhere. The folder itself may be a link
  (the user's own choice of where it lies)."""
  for name in FIXED_FILES:
    atomic_files.refuse_link(os.path.join(logdir, name))
  for name in FIXED_FOLDERS:
    atomic_files.refuse_link(os.path.join(logdir, name), folder=True)
  index_files = [os.path.join(logdir, "checkpoints", which, checkpoint_names.INDEX_FILE)
                 for which in (checkpoint_names.LAST, checkpoint_names.BEST)]
  for path in index_files:
    atomic_files.refuse_link(path)


def claim(logdir: str, resume: bool) -> None:
  """Locks `logdir` for this run and refuses to start a new run over an earlier one, or to resume a
  run that saved nothing, or a folder with a link where the run writes (`refuse_links`). A refused
  claim leaves the folder as it was. A folder this process holds already is claimed (open_for_run)."""
  if os.path.abspath(logdir) in _held:
    return
  refuse_links(logdir)  # before the lock file, itself one of the names
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


def prepare(logdir: str) -> None:
  """Makes `logdir` where it does not exist yet (`is_new` then still says it is new) and checks that a
  file can be created in it; a UserError if not."""
  path = os.path.abspath(logdir)
  made = not os.path.isdir(logdir)
  try:
    os.makedirs(logdir, exist_ok=True)
    if made:
      _made.add(path)
    atomic_files.check_writable_folder(logdir)  # a probe of a fresh name: no link to follow
  except OSError as error:
    raise UserError("--logdir=%s is not a writable folder (%s)" % (logdir, error.strerror)) from None


def open_for_run(logdir: str, resume: bool, dated: bool = False) -> str:
  """Makes the run's folder (`dated`: the dated default, `make_new`) and claims it for this process;
  returns its name. A refusal leaves no folder that this call made, and a folder that was there as it
  was. The run releases the folder (training/loop.py run), or `abandon` does if it fails before."""
  if dated:
    logdir = make_new(logdir)
  else:
    prepare(logdir)
  try:
    claim(logdir, resume)
  except BaseException:
    abandon(logdir)
    raise
  return logdir


def abandon(logdir: str) -> None:
  """Gives up `logdir` after a failure before the run began: its lock released, and the folder removed
  if this process made it and nothing but the lock and log is in it (`remove_if_unused`)."""
  if is_new(logdir):
    remove_if_unused(logdir)
  else:
    release(logdir)


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
