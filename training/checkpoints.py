"""Checkpoints of a run (`<logdir>/checkpoints/{last,best}`) and `--resume`.

Each folder holds TensorFlow checkpoints (`<name>.index` + `<name>.data-*`, readable by
`tf.train.latest_checkpoint` / `tf.train.load_checkpoint`) and a `checkpoint` index file naming the
newest one. A save never touches a checkpoint that the index names, so a job killed at any instant
(SIGKILL, node failure, full disk) keeps the previous checkpoint intact:

1. the checkpoint is written under a fresh name into a private staging folder (`.saving-*`); an
   epoch's `last` that is also its new `best` hard-links best's files there instead, where the folder
   allows links;
2. its files are fsynced, renamed into the folder (data files first, `.index` last) and the folder is
   fsynced;
3. the index is rewritten atomically (temporary file, fsync, rename, fsync of the folder);
4. only then are checkpoints beyond `max_to_keep` (and leftovers of killed saves) deleted.

TensorFlow's CheckpointManager (used before) renames its index atomically but fsyncs nothing, and
re-saving an existing checkpoint number overwrites the files of the checkpoint the index points to,
which happens when a resumed run saves an epoch again. A failed save (disk full, folder made
unwritable) raises `CheckpointSaveError`: a one-line UserError naming the folder, the cause and the
checkpoint that is still intact.

The run's own state (epoch, step within the epoch for interrupted runs, learning-rate schedule, best
validation loss, per-epoch history, which model wrote it) is a JSON string variable inside the same
checkpoint, so it can never disagree with the weights and optimizer state saved beside it.
"""

import errno
import json
import math
import os
import re
import shutil
import tempfile

import tensorflow as tf
from absl import logging

from errors import UserError
from training import optimizers
from training.checkpoint_names import BEST, INDEX_FILE, LAST

KEEP = {LAST: 2, BEST: 1}
STAGING_PREFIX = ".saving-"
STATE_KEY = "run_state/.ATTRIBUTES/VARIABLE_VALUE"


class CheckpointSaveError(UserError):
  """A checkpoint could not be written; the previous one is intact."""


def checkpoint_name(epoch: int, step: int = 0) -> str:
  """`ckpt-<epochs done>`, or `ckpt-<epochs done>-step<k>` for a run interrupted k steps into the next."""
  return "ckpt-%d" % epoch if not step else "ckpt-%d-step%d" % (epoch, step)


def in_run_folder(checkpoint, logdir: str):
  """`checkpoint` (a path or None) as it is in `logdir`: the chief's are there already. Another
  worker's are copies (saving is collective) in a scratch folder that it removes at its end, so a
  line naming them would point at nothing."""
  if not checkpoint:
    return checkpoint
  folder, name = os.path.split(checkpoint)
  return os.path.join(logdir, "checkpoints", os.path.basename(folder), name)


def _is_local(path: str) -> bool:
  return "://" not in path


def _fsync(path: str) -> None:
  """fsync a file or (on POSIX) a folder, so a rename that follows survives a crash of the node."""
  if not _is_local(path):
    return
  try:
    fd = os.open(path, os.O_RDONLY)
  except IsADirectoryError:  # pragma: no cover - folders cannot be opened on some platforms
    return
  try:
    os.fsync(fd)
  except OSError as error:
    if error.errno not in (errno.EINVAL, errno.EBADF):  # folders that cannot be fsynced
      raise
  finally:
    os.close(fd)


def read_index(folder: str) -> list:
  """Names of the checkpoints the index of `folder` lists, oldest first (newest = the current one)."""
  path = os.path.join(folder, INDEX_FILE)
  if not tf.io.gfile.exists(path):
    return []
  with tf.io.gfile.GFile(path, "r") as f:
    text = f.read()
  current = re.findall(r'^model_checkpoint_path:\s*"(.*)"\s*$', text, re.M)
  names = re.findall(r'^all_model_checkpoint_paths:\s*"(.*)"\s*$', text, re.M)
  names = [os.path.basename(n) for n in names]
  if current:
    current = os.path.basename(current[-1])
    names = [n for n in names if n != current] + [current]
  return names


def _write_index(folder: str, names: list) -> None:
  """Rewrites the index atomically (tf.train.CheckpointState text format, paths relative to folder)."""
  lines = ['model_checkpoint_path: "%s"' % names[-1]]
  lines += ['all_model_checkpoint_paths: "%s"' % name for name in names]
  path = os.path.join(folder, INDEX_FILE)
  # Unguessable: GFile opens with fopen, which would write through a link planted at a predictable name.
  temporary = path + ".tmp%d.%s" % (os.getpid(), os.urandom(4).hex())
  with tf.io.gfile.GFile(temporary, "w") as f:
    f.write("\n".join(lines) + "\n")
  _fsync(temporary)
  tf.io.gfile.rename(temporary, path, overwrite=True)
  _fsync(folder)


def _files_of(folder: str, name: str) -> list:
  return [f for f in tf.io.gfile.listdir(folder) if f == name + ".index" or f.startswith(name + ".data-")]


_CAUSES = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM,
                                                 errno.EROFS, errno.EIO, errno.ENOENT))


def _reason(error: Exception) -> str:
  """A short cause: the OS error's text (TensorFlow's messages bury it after the op's name)."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  text = str(getattr(error, "message", "") or error)
  for cause in _CAUSES:
    if cause in text:
      return cause
  text = re.sub(r"\{\{[^}]*\}\}", "", text).strip().splitlines()
  return text[0][:200] if text else type(error).__name__


class RunCheckpoints:
  """Saves and restores model + optimizer + run state."""

  def __init__(self, logdir: str, model: tf.keras.Model, identity: dict, restore_logdir: str = None):
    self.directory = os.path.join(logdir, "checkpoints")
    # Non-chief workers write to a temporary folder but resume from the chief's checkpoints.
    self.restore_directory = os.path.join(restore_logdir or logdir, "checkpoints")
    self.identity = identity                      # e.g. {"model": ..., "design": ...}
    self._state = tf.Variable("{}", dtype=tf.string, trainable=False, name="run_state")
    self._optimizer = model.optimizer
    self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, run_state=self._state)

  def folder(self, which: str) -> str:
    return os.path.join(self.directory, which)

  def latest(self, which: str = LAST, restoring: bool = False):
    """Path (prefix) of the newest checkpoint in `which` (of the run resumed from), or None."""
    folder = os.path.join(self.restore_directory, which) if restoring else self.folder(which)
    names = read_index(folder)
    return os.path.join(folder, names[-1]) if names else None

  def save(self, which: str, state: dict, name: str = None, same_as: str = None) -> str:
    """Writes a checkpoint atomically (see the module docstring); returns its path (prefix).

    `same_as`: a checkpoint just saved with the same state (the epoch's `best`): its files are
    hard-linked instead of written again, where the folder allows it.
    Raises CheckpointSaveError if it cannot be written; the previous checkpoint is then untouched.
    """
    folder = self.folder(which)
    name = name or checkpoint_name(state["epoch"], state.get("step", 0))
    staging = None
    try:
      tf.io.gfile.makedirs(folder)
      listed = read_index(folder)
      name = _fresh_name(name, listed)
      self._state.assign(json.dumps(dict(state, **self.identity)))
      staging = tempfile.mkdtemp(prefix=STAGING_PREFIX + name + ".", dir=folder) if _is_local(folder) \
          else os.path.join(folder, STAGING_PREFIX + name + ".%d" % os.getpid())
      if not (same_as and _linked(same_as, os.path.join(staging, name))):
        self._checkpoint.write(os.path.join(staging, name))
      files = sorted(_files_of(staging, name), key=lambda f: f.endswith(".index"))  # .index last
      if not files or not files[-1].endswith(".index"):
        raise OSError(errno.EIO, "TensorFlow wrote no checkpoint files")
      for file_name in files:
        _fsync(os.path.join(staging, file_name))
      for file_name in files:
        tf.io.gfile.rename(os.path.join(staging, file_name), os.path.join(folder, file_name),
                           overwrite=True)
      _fsync(folder)
      tf.io.gfile.rmtree(staging)
      staging = None
      kept = (listed + [name])[-KEEP[which]:]
      _write_index(folder, kept)
    except (OSError, tf.errors.OpError) as error:
      if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
      previous = self.latest(which) if os.path.isdir(folder) else None
      raise CheckpointSaveError(
          "could not save checkpoint %s (%s); the previous checkpoint %s is intact; free space or fix the "
          "folder, then continue with --resume" % (os.path.join(folder, name), _reason(error),
                                                    previous or "(none)")) from None
    _sweep(folder, kept)
    return os.path.join(folder, name)

  def restore_last(self) -> dict:
    """Restores the last checkpoint; returns its run state. A UserError if there is none or it mismatches."""
    return self._restore(LAST)

  def restore_best_weights(self) -> dict:
    """Loads the weights of the best-validation checkpoint (for the final test); returns its state."""
    return self._restore(BEST)

  def _restore(self, which: str) -> dict:
    folder = resume_folder(self.restore_directory) if which == LAST else os.path.join(self.restore_directory, which)
    path = latest_for_restore(folder)
    try:
      self._checkpoint.restore(path).expect_partial()
      state = json.loads(self._state.numpy().decode())
    except Exception as error:  # pylint: disable=broad-except  # any reader failure: a damaged file
      raise UserError("--resume: checkpoint %s is unreadable (%s)" % (path, _first_line(error))) from None
    check_identity(path, state, self.identity)
    if which == LAST:
      written, built = written_optimizer_format(path), optimizers.optimizer_format(self._optimizer)
      if written not in (None, built):
        raise UserError("--resume: checkpoint %s holds %s optimizer state, but this run built a %s "
                        "optimizer (which would start from zero)" % (path, written, built))
    logging.info("Restored %s (epoch %d%s)", path, state["epoch"],
                 ", step %d of the next" % state["step"] if state.get("step") else "")
    return state


def _linked(source: str, prefix: str) -> bool:
  """Hard-links the files of checkpoint `source` as checkpoint `prefix` (a checkpoint's files hold no
  name: its reader finds the data files by prefix). False, leaving nothing behind, where links are
  not possible (a remote or another file system, one without links), and the caller writes instead."""
  if not (_is_local(source) and _is_local(prefix)):
    return False
  folder, name = os.path.split(source)
  made = []
  try:
    for file_name in _files_of(folder, name):
      target = prefix + file_name[len(name):]
      os.link(os.path.join(folder, file_name), target)
      made.append(target)
  except OSError:
    for target in made:
      os.remove(target)
    return False
  return bool(made)


def _fresh_name(name: str, listed: list) -> str:
  """`name`, or `name-<n>` if the index lists `name` (its files must not be overwritten in place)."""
  candidate, n = name, 0
  while candidate in listed:
    n += 1
    candidate = "%s-%d" % (name, n)
  return candidate


def _sweep(folder: str, kept: list) -> None:
  """Deletes checkpoints the index no longer lists and leftovers of killed saves (best effort)."""
  try:
    entries = tf.io.gfile.listdir(folder)
  except tf.errors.OpError:
    return
  for entry in entries:
    entry = entry.rstrip("/")
    path = os.path.join(folder, entry)
    stem = re.sub(r"\.(index|data-\d+-of-\d+)$", "", entry)
    stale_checkpoint = entry.startswith("ckpt-") and stem != entry and stem not in kept
    stale_staging = entry.startswith(STAGING_PREFIX) or entry.startswith(INDEX_FILE + ".tmp")
    if not (stale_checkpoint or stale_staging):
      continue
    try:
      if _is_local(path):
        # Never through a link (saves make none: one was planted): TensorFlow's rmtree follows links to
        # folders, and would empty the folder a `.saving-x` link points at. Here a link itself is
        # removed, and shutil's rmtree removes links inside a folder without following them.
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path)
        else:
          os.remove(path)
      elif tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
      else:
        tf.io.gfile.remove(path)
    except (OSError, tf.errors.OpError) as error:
      logging.warning("Could not delete the old checkpoint file %s (%s)", path, _reason(error))


class CheckpointCallback(tf.keras.callbacks.Callback):
  """Saves `best` when the validation loss improves, then `last`, every epoch.

  `best` goes first: a job killed between the two saves resumes from the previous `last`, whose
  state still names the older best, and `--resume` reconciles the two (see `restore_into`).
  """

  def __init__(self, checkpoints: RunCheckpoints, schedule, best_val_loss=math.inf, best_epoch=None,
               batch_layout=None):
    super().__init__()
    self.checkpoints, self.schedule = checkpoints, schedule
    self.batch_layout = batch_layout  # what a mid-epoch step means: {"global_batch": ..., "replicas": ...}
    self.best_val_loss, self.best_epoch = best_val_loss, best_epoch
    self.epoch_logs = []     # one dict per epoch of the run (across resumes), saved with the state
    self.last_saved = None   # path of the newest good checkpoint written by this run

  def restore_into(self, state: dict) -> None:
    """Takes over the best validation loss and the per-epoch logs of a resumed run."""
    self.best_val_loss = float(state.get("best_val_loss", math.inf))
    self.best_epoch = state.get("best_epoch")
    self.epoch_logs = [dict(entry) for entry in state.get("epoch_logs", [])]
    best = self.checkpoints.latest(BEST, restoring=True)
    if best is None:
      return
    try:  # `best` saved by a job that was killed before it saved `last`: a better model than `last` knows
      best_state = peek_state(best)
    except UserError as error:
      logging.warning("Ignoring the best-validation checkpoint: %s", error)
      return
    if float(best_state.get("best_val_loss", math.inf)) < self.best_val_loss:
      self.best_val_loss, self.best_epoch = float(best_state["best_val_loss"]), best_state["best_epoch"]

  def _state(self, epoch: int, **extra) -> dict:
    return dict({"epoch": epoch, "schedule": self.schedule.plateau.to_dict(),
                 "best_val_loss": self.best_val_loss, "best_epoch": self.best_epoch,
                 "epoch_logs": self.epoch_logs}, **extra)

  def on_epoch_end(self, epoch, logs=None):
    logs = logs or {}
    if not all(math.isfinite(float(logs.get(key, 0.0))) for key in ("loss", "val_loss")):
      logging.warning("Epoch %d ended with a NaN/Inf loss: its weights are not checkpointed", epoch + 1)
      return
    val_loss = logs.get("val_loss")
    improved = val_loss is not None and val_loss < self.best_val_loss
    if improved:
      self.best_val_loss, self.best_epoch = float(val_loss), epoch + 1
    entry = {"epoch": epoch + 1}
    for key, value in logs.items():
      try:
        entry[key] = float(value)
      except (TypeError, ValueError):
        pass
    self.epoch_logs.append(entry)
    state = self._state(epoch + 1)
    best = self.checkpoints.save(BEST, state) if improved else None
    # The same weights and state: `last` links best's files instead of writing them again (a third
    # less disk per run, and one write of the weights per improving epoch instead of two).
    self.last_saved = self.checkpoints.save(LAST, state, same_as=best)

  def save_interrupted(self, epoch: int, step: int, partial_logs: dict) -> str:
    """Saves `last` after `step` steps of epoch `epoch` (0-based): `--resume` continues from that step."""
    self.last_saved = self.checkpoints.save(
        LAST, self._state(epoch, step=step, partial_logs=partial_logs, batch_layout=self.batch_layout))
    return self.last_saved


# What a checkpoint written before its identity held a key was made with.
_IDENTITY_BEFORE_RECORDED = {"batch_norm_statistics": "moving"}


def check_identity(path: str, state: dict, identity: dict) -> None:
  for key, value in identity.items():
    saved = state.get(key, _IDENTITY_BEFORE_RECORDED.get(key))
    if saved != value:
      raise UserError("--resume: %s was written with %s=%s, this run has %s=%s"
                      % (path, key, saved, key, value))


def _first_line(error: Exception) -> str:
  lines = str(error).strip().splitlines()
  return lines[0] if lines else type(error).__name__


def _newest(folder: str):
  """(path of the checkpoint the index of `folder` names, None) or (None, what is wrong)."""
  if not tf.io.gfile.exists(os.path.join(folder, INDEX_FILE)):
    return None, "no checkpoint in %s" % folder
  try:
    names = read_index(folder)
  except Exception as error:  # pylint: disable=broad-except
    return None, "the checkpoint index %s is unreadable (%s)" % (os.path.join(folder, INDEX_FILE),
                                                                _first_line(error))
  if not names:
    return None, "no checkpoint in %s (its index file %s is empty or damaged)" % (folder, INDEX_FILE)
  path = os.path.join(folder, names[-1])
  if not tf.io.gfile.exists(path + ".index"):
    return None, "checkpoint %s is missing (no %s.index in %s)" % (path, names[-1], folder)
  return path, None


def resume_folder(checkpoints: str) -> str:
  """The folder a resume restores from: `last`, or `best` while `last` holds no checkpoint yet. A job
  killed between the first epoch's two saves leaves that: `best` is written first, with the same state
  (the weights, optimizer and run state of that epoch's end), and `last` then links its files."""
  last, best = os.path.join(checkpoints, LAST), os.path.join(checkpoints, BEST)
  if not tf.io.gfile.exists(os.path.join(last, INDEX_FILE)) and tf.io.gfile.exists(os.path.join(best, INDEX_FILE)):
    logging.info("%s holds no checkpoint (the first epoch's saves were cut short): resuming from %s, "
                 "which holds the same state", last, best)
    return best
  return last


def latest_for_restore(folder: str) -> str:
  """The checkpoint the index of `folder` names; a one-line UserError if there is none or it is gone."""
  path, problem = _newest(folder)
  if problem:
    raise UserError("--resume: " + problem)
  return path


def best_or_last(logdir: str) -> str:
  """The checkpoint to evaluate a run with: the best-validation one, else the last one."""
  folders = [os.path.join(logdir, "checkpoints", which) for which in (BEST, LAST)]
  problems = []
  for folder in folders:
    path, problem = _newest(folder)
    if path:
      return path
    problems.append(problem)
  if not any(tf.io.gfile.exists(os.path.join(folder, INDEX_FILE)) for folder in folders):
    raise UserError("%s has no checkpoint (looked in checkpoints/best and checkpoints/last): has the run "
                    "finished an epoch?" % logdir)
  raise UserError("%s: no usable checkpoint: %s" % (logdir, "; ".join(problems)))


def written_optimizer_format(path: str):
  """The optimizer family (training.optimizers.FORMATS) whose state checkpoint `path` holds, or None."""
  names = [name for name, _ in tf.train.list_variables(path)]
  if any(name.startswith(("optimizer/_iterations/", "optimizer/_variables/")) for name in names):
    return optimizers.KERAS_2_11
  if any(name.startswith("optimizer/iter/") for name in names):
    return optimizers.LEGACY
  return None


def peek_state(path: str, purpose: str = "--resume") -> dict:
  """The run state stored in checkpoint `path`, read without building the model; every tensor is read,
  so a damaged file is a one-line UserError (starting with `purpose`) before any work is done."""
  try:
    reader = tf.train.load_checkpoint(path)
    # Reading every tensor checks every checksum now: TensorFlow restores optimizer slots lazily, so
    # damaged bytes would otherwise surface only inside the first training step.
    for name in reader.get_variable_to_shape_map():
      reader.get_tensor(name)
    raw = reader.get_tensor(STATE_KEY)
    state = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
  except Exception as error:  # pylint: disable=broad-except  # any reader failure: a damaged file
    raise UserError("%s: checkpoint %s is unreadable (%s)" % (purpose, path, _first_line(error))) from None
  if not isinstance(state, dict) or not isinstance(state.get("epoch"), int):
    raise UserError("%s: checkpoint %s is unreadable (its run state has no epoch)" % (purpose, path))
  return state


def peek_last_state(logdir: str, identity: dict) -> dict:
  """The run state of the last checkpoint, read without building the model (to position the data
  and build the optimizer family it was written with: state["optimizer_format"])."""
  path = latest_for_restore(resume_folder(os.path.join(logdir, "checkpoints")))
  state = peek_state(path)
  check_identity(path, state, identity)
  best_folder = os.path.join(logdir, "checkpoints", BEST)
  if tf.io.gfile.exists(os.path.join(best_folder, INDEX_FILE)):
    # The run tests with the best weights at its end: a damaged one must stop it now, not then.
    peek_state(latest_for_restore(best_folder))
  return dict(state, optimizer_format=written_optimizer_format(path))
