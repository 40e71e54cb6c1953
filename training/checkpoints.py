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
4. only then are the checkpoints the index no longer lists (and leftovers of killed saves) deleted:
   `last` keeps its newest two, `best` the `keep_best` epochs of lowest validation loss
   (`--keep_checkpoints`), its index naming the lowest as the current one.

TensorFlow's CheckpointManager (used before) renames its index atomically but fsyncs nothing, and
re-saving an existing checkpoint number overwrites the files of the checkpoint the index points to,
which happens when a resumed run saves an epoch again. A failed save (disk full, folder made
unwritable) raises `CheckpointSaveError`: a one-line UserError naming the folder, the cause and the
checkpoint that is still intact.

The run's own state (epoch, step within the epoch for interrupted runs, learning-rate schedule, best
validation loss, per-epoch history, which model wrote it) is a JSON string variable inside the same
checkpoint, so it can never disagree with the weights and optimizer state saved beside it.

`load_initial_weights` (`--init_from`) starts a new run from the network weights alone of another
run's checkpoint, after checking that it holds the same network.
"""

import errno
import hashlib
import json
import math
import os
import re
import shutil
import tempfile

import numpy as np
import tensorflow as tf
from absl import logging

import model
from errors import UserError
from training import optimizers
from training.checkpoint_names import BEST, INDEX_FILE, LAST

KEEP_LAST = 2
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

  def __init__(self, logdir: str, model: tf.keras.Model, identity: dict, restore_logdir: str = None,
               keep_best: int = 1):
    self.directory = os.path.join(logdir, "checkpoints")
    self.keep_best = keep_best                    # `best` keeps the epochs of the lowest validation losses
    self._val_losses = {}                         # name in `best` -> its epoch's validation loss
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
      kept = self._kept(which, folder, listed, name, state)
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

  def _kept(self, which: str, folder: str, listed: list, name: str, state: dict) -> list:
    """What the index lists after saving `name`, the current checkpoint last. `last`: its newest two.
    `best`: `name` and the others of lowest validation loss, `keep_best` in all, from the highest loss
    to the lowest (ties: the older first), so that the current one is the best."""
    if which != BEST:
      return (listed + [name])[-KEEP_LAST:]
    self._val_losses[name] = own_val_loss(state)
    order = listed + [name]
    others = sorted(listed, key=lambda other: self._val_loss(folder, other))[:self.keep_best - 1] \
        if self.keep_best > 1 else []
    return sorted(others + [name], key=lambda kept: (-self._val_losses[kept], order.index(kept)))

  def _val_loss(self, folder: str, name: str) -> float:
    """The validation loss of checkpoint `name` in `folder` (written by this process, else read from its
    state: an earlier process's); an unreadable one ranks last."""
    if name not in self._val_losses:
      try:
        self._val_losses[name] = own_val_loss(_read_state(os.path.join(folder, name)))
      except Exception:  # pylint: disable=broad-except  # damaged or gone: the first to let go
        self._val_losses[name] = math.inf
    return self._val_losses[name]

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
    done = state["epoch"]  # epochs finished; a mid-epoch checkpoint is within the next, 1-based done + 1
    logging.info("Restored %s (%s)", path, "after step %d of epoch %d" % (state["step"], done + 1)
                 if state.get("step") else "after epoch %d" % done)
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
  """Saves `best` when the validation loss is among the `keep_best` lowest so far (a new lowest, with
  the default of one), then `last`, every epoch.

  `best` goes first: a job killed between the two saves resumes from the previous `last`, whose
  state still names the older best, and `--resume` reconciles the two (see `restore_into`).
  """

  def __init__(self, checkpoints: RunCheckpoints, schedule, best_val_loss=math.inf, best_epoch=None,
               batch_layout=None):
    super().__init__()
    self.checkpoints, self.schedule = checkpoints, schedule
    self.batch_layout = batch_layout  # what a mid-epoch step means: {"global_batch": ..., "replicas": ...}
    self.best_val_loss, self.best_epoch = best_val_loss, best_epoch
    # The validation losses of the checkpoints in `best`, lowest first: every process of a run decides
    # alike whether an epoch goes there (saving is collective), also those whose folder is scratch.
    self.best_losses = [] if math.isinf(best_val_loss) else [best_val_loss]
    self.epoch_logs = []     # one dict per epoch of the run (across resumes), saved with the state
    self.last_saved = None   # path of the newest good checkpoint written by this run
    self.init_from = None    # what the run's first weights were (load_initial_weights), kept across resumes

  def restore_into(self, state: dict) -> None:
    """Takes over the best validation loss and the per-epoch logs of a resumed run."""
    self.best_val_loss = float(state.get("best_val_loss", math.inf))
    self.best_epoch = state.get("best_epoch")
    self.epoch_logs = [dict(entry) for entry in state.get("epoch_logs", [])]
    self.init_from = state.get("init_from")
    self.best_losses = [] if math.isinf(self.best_val_loss) else [self.best_val_loss]
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
    self.best_losses = self._listed_best_losses(os.path.dirname(best))

  def _listed_best_losses(self, folder: str) -> list:
    """The validation losses of the checkpoints listed in `best`, lowest first, at most keep_best, with
    the run's own record of its lowest where no listed checkpoint holds it (it was deleted)."""
    losses = []
    for name in read_index(folder):
      try:
        losses.append(own_val_loss(_read_state(os.path.join(folder, name))))
      except Exception:  # pylint: disable=broad-except  # damaged or gone: saves drop it first
        pass
    losses = [loss for loss in losses if math.isfinite(loss)]
    if math.isfinite(self.best_val_loss) and (not losses or self.best_val_loss < min(losses)):
      losses.append(self.best_val_loss)
    return sorted(losses)[:self.checkpoints.keep_best]

  def _ranks_among_best(self, val_loss: float) -> bool:
    """Whether an epoch of validation loss `val_loss` goes into `best` (and records it there)."""
    keep = self.checkpoints.keep_best
    if len(self.best_losses) >= keep and val_loss >= self.best_losses[keep - 1]:
      return False
    self.best_losses = sorted(self.best_losses + [val_loss])[:keep]
    return True

  def _state(self, epoch: int, **extra) -> dict:
    state = {"epoch": epoch, "schedule": self.schedule.plateau.to_dict(), "best_val_loss": self.best_val_loss,
             "best_epoch": self.best_epoch, "epoch_logs": self.epoch_logs}
    if self.init_from:
      state["init_from"] = self.init_from
    return dict(state, **extra)

  def on_epoch_end(self, epoch, logs=None):
    logs = logs or {}
    if not all(math.isfinite(float(logs.get(key, 0.0))) for key in ("loss", "val_loss")):
      logging.warning("Epoch %d ended with a NaN/Inf loss: its weights are not checkpointed", epoch + 1)
      return
    val_loss = logs.get("val_loss")
    if val_loss is not None and val_loss < self.best_val_loss:
      self.best_val_loss, self.best_epoch = float(val_loss), epoch + 1
    among_best = val_loss is not None and self._ranks_among_best(float(val_loss))
    entry = {"epoch": epoch + 1}
    for key, value in logs.items():
      try:
        entry[key] = float(value)
      except (TypeError, ValueError):
        pass
    self.epoch_logs.append(entry)
    state = self._state(epoch + 1)
    best = self.checkpoints.save(BEST, state) if among_best else None
    # The same weights and state: `last` links best's files instead of writing them again (a third
    # less disk per run, and one write of the weights per improving epoch instead of two).
    self.last_saved = self.checkpoints.save(LAST, state, same_as=best)

  def save_interrupted(self, epoch: int, step: int, partial_logs: dict) -> str:
    """Saves `last` after `step` steps of epoch `epoch` (0-based): `--resume` continues from that step."""
    self.last_saved = self.checkpoints.save(
        LAST, self._state(epoch, step=step, partial_logs=partial_logs, batch_layout=self.batch_layout))
    return self.last_saved


def _saved_identity(state: dict, keys, model_name) -> dict:
  """The values of `keys` that checkpoint `state` of model `model_name` was written with; a model option
  its run did not record yet has the value such runs used (model.options `Option.before_recorded`)."""
  before = model.before_recorded(model_name)
  return {key: state.get(key, before.get(key)) for key in keys}


def check_identity(path: str, state: dict, identity: dict) -> None:
  saved_identity = _saved_identity(state, identity, identity.get("model"))
  for key, value in identity.items():
    saved = saved_identity[key]
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


def best_checkpoints(logdir: str) -> list:
  """The checkpoints in `logdir`'s checkpoints/best, the lowest validation loss first (the one evaluated):
  [{"checkpoint": path, "epoch": ..., "val_loss": ...}]; unreadable ones left out."""
  folder = os.path.join(logdir, "checkpoints", BEST)
  listed = []
  for name in reversed(read_index(folder)):  # the index lists them from the highest loss to the lowest
    try:
      state = _read_state(os.path.join(folder, name))
    except Exception:  # pylint: disable=broad-except  # damaged or gone since the index was read
      continue
    listed.append({"checkpoint": os.path.join(folder, name), "epoch": state.get("epoch"),
                   "val_loss": own_val_loss(state)})
  return listed


def written_optimizer_format(path: str):
  """The optimizer family (training.optimizers.FORMATS) whose state checkpoint `path` holds, or None."""
  names = [name for name, _ in tf.train.list_variables(path)]
  if any(name.startswith(("optimizer/_iterations/", "optimizer/_variables/")) for name in names):
    return optimizers.KERAS_2_11
  if any(name.startswith("optimizer/iter/") for name in names):
    return optimizers.LEGACY
  return None


def _read_state(path: str) -> dict:
  """The run state of checkpoint `path`, its other tensors unread."""
  raw = tf.train.load_checkpoint(path).get_tensor(STATE_KEY)
  return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def own_val_loss(state: dict) -> float:
  """The validation loss of the epoch whose end wrote run state `state`: its per-epoch logs' last, else
  its best validation loss (a best checkpoint's own when it was the only one kept), else inf."""
  logs = state.get("epoch_logs") or []
  if logs and logs[-1].get("epoch") == state.get("epoch") and logs[-1].get("val_loss") is not None:
    return float(logs[-1]["val_loss"])
  return float(state.get("best_val_loss", math.inf))  # a best checkpoint's own, where no logs say more


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


# --- --init_from: a new run from another run's network weights -------------------------------------------

# Identity keys that are the training's, not the network's: a run started from another's weights has its own.
_TRAINING_KEYS = ("optimizer", "learning_rate")
# A network weight in a checkpoint of RunCheckpoints: Keras names each layer with weights by its position
# among them (`layer_with_weights-<i>`); optimizer slots hang below the weight they belong to.
_LAYER_WEIGHT = re.compile(r"^model/layer_with_weights-(\d+)/(.+)/\.ATTRIBUTES/VARIABLE_VALUE$")
_CHECKPOINT_FILE = re.compile(r"\.(index|data-\d+-of-\d+)$")


def load_initial_weights(net: tf.keras.Model, path: str, identity: dict) -> dict:
  """--init_from: loads into `net` (built and compiled, also in a distribution strategy's scope) the
  network weights of `path`: a run folder (its best checkpoint, else its last), a checkpoint folder or a
  checkpoint. The optimizer state, schedule and epoch count stay this run's own.

  A checkpoint of another network than this run's `identity` (training.loop._identity) builds (its
  model, design or batch normalisation; another number of outputs or input shape, by the weights'
  shapes), or one that cannot be read, is a one-line UserError naming both.
  Returns what the run records: {"checkpoint", "run" (its run folder, or None), "epoch", "step" (within
  the next epoch, for a checkpoint of an interrupted run), "val_loss" (of its epoch, or None),
  "weights_sha256" (of the weights loaded: that run's summary.yaml `weights_sha256` where it tested
  this checkpoint's weights)}.
  """
  checkpoint, run = resolve_init_from(path)
  state = peek_state(checkpoint, purpose="--init_from")
  stored, dtypes = _stored_layers(checkpoint)
  _check_same_network(checkpoint, state, stored, net, identity)
  _check_same_dtypes(checkpoint, dtypes, net)
  _read_network(net, checkpoint)
  val_loss = own_val_loss(state)
  return {"checkpoint": checkpoint, "run": run, "epoch": state["epoch"], "step": state.get("step", 0),
          "val_loss": val_loss if math.isfinite(val_loss) else None, "weights_sha256": weights_digest(net)}


def weights_digest(net: tf.keras.Model) -> str:
  """SHA-256 of all of `net`'s weights, in its order: equal digests mean identical networks."""
  digest = hashlib.sha256()
  for weight in net.get_weights():
    digest.update(np.ascontiguousarray(weight).tobytes())
  return digest.hexdigest()


def resolve_init_from(path: str):
  """(checkpoint prefix, run folder or None) for --init_from=`path`: a run folder, one of its checkpoint
  folders (best or last), a checkpoint prefix or one of its files; a one-line UserError if none."""
  path = os.path.abspath(path)
  if _CHECKPOINT_FILE.search(path) and not tf.io.gfile.isdir(path):
    path = _CHECKPOINT_FILE.sub("", path)
  if tf.io.gfile.exists(path + ".index"):
    return path, _run_of(os.path.dirname(path))
  if tf.io.gfile.exists(os.path.join(path, INDEX_FILE)):  # checkpoints/best or checkpoints/last
    checkpoint, problem = _newest(path)
    if problem:
      raise UserError("--init_from: " + problem)
    return checkpoint, _run_of(path)
  if tf.io.gfile.isdir(os.path.join(path, "checkpoints")):
    try:
      return best_or_last(path), path
    except UserError as error:
      raise UserError("--init_from: %s" % error) from None
  raise UserError("--init_from: %s is neither a run folder (with checkpoints/) nor a checkpoint (no %s.index)"
                  % (path, os.path.basename(path)))


def _run_of(folder: str):
  """The run folder that checkpoint folder `folder` (<run>/checkpoints/best or last) is in, or None."""
  parent = os.path.dirname(folder)
  if os.path.basename(folder) in (BEST, LAST) and os.path.basename(parent) == "checkpoints":
    return os.path.dirname(parent)
  return None


def _stored_layers(path: str) -> tuple:
  """The network weights of checkpoint `path`: {position among the layers with weights: {weight: shape}},
  and {dtype name: how many of them}."""
  reader = tf.train.load_checkpoint(path)
  dtype_of = reader.get_variable_to_dtype_map()
  layers, dtypes = {}, {}
  for name, shape in reader.get_variable_to_shape_map().items():
    match = _LAYER_WEIGHT.match(name)
    if match and ".OPTIMIZER_SLOT" not in name:
      layers.setdefault(int(match.group(1)), {})[match.group(2)] = tuple(shape)
      dtypes[dtype_of[name].name] = dtypes.get(dtype_of[name].name, 0) + 1
  return layers, dtypes


def _layers_with_weights(net: tf.keras.Model) -> list:
  """`net`'s layers in the order Keras numbers them in checkpoints (`layer_with_weights-<i>`)."""
  return [layer for layer in net.layers if layer.weights]


def _stored_outputs(stored: dict):
  """The number of outputs of the network in a checkpoint: the width of its last layer's kernel."""
  last = stored.get(max(stored)) if stored else {}
  kernel = last.get("kernel")
  return kernel[-1] if kernel else None


def _built_outputs(net: tf.keras.Model):
  try:
    return int(net.output_shape[-1])
  except (AttributeError, TypeError, ValueError, IndexError):
    return None


def _network_named(model_name, options: dict, outputs) -> str:
  """E.g. `neuron_inverter (design=dev, batch_norm_statistics=moving, 15 outputs)`."""
  details = ["%s=%s" % (key, value) for key, value in options.items() if value is not None]
  details += ["%d outputs" % outputs] if outputs is not None else []
  return str(model_name) + (" (%s)" % ", ".join(details) if details else "")


def _check_same_network(path: str, state: dict, stored: dict, net: tf.keras.Model, identity: dict) -> None:
  """A UserError naming both networks unless checkpoint `path` holds one like `net` (its `identity`)."""
  network_keys = [key for key in identity if key not in _TRAINING_KEYS + ("model",)]
  there_keys = network_keys
  if state.get("model") != identity.get("model"):
    differ = ["model"]  # its options follow from it; the checkpoint's are its own model's
    there_keys = model.identity_option_names(state.get("model")) or network_keys
  else:
    saved = _saved_identity(state, network_keys, identity.get("model"))
    differ = [key for key in network_keys if saved[key] != identity[key]]
  there = _network_named(state.get("model"), _saved_identity(state, there_keys, state.get("model")),
                         _stored_outputs(stored))
  here = _network_named(identity.get("model"), {key: identity[key] for key in network_keys}, _built_outputs(net))
  prefix = "--init_from: %s holds the weights of %s; this run builds %s" % (path, there, here)
  if differ:
    raise UserError("%s: start from a run with the same %s" % (prefix, " and ".join("--" + key for key in differ)))
  layers = _layers_with_weights(net)
  if len(layers) != len(stored):
    raise UserError("%s: its network has %d layers with weights, this run's %d" % (prefix, len(stored), len(layers)))
  for index, layer in enumerate(layers):
    built = sorted(tuple(weight.shape.as_list()) for weight in layer.weights)
    saved_shapes = sorted(stored.get(index, {}).values())
    if saved_shapes != built:
      raise UserError("%s: the weights of its layer %s are %s there, %s here (data of another input shape "
                      "or number of outputs)" % (prefix, layer.name, _shapes(saved_shapes), _shapes(built)))


def _check_same_dtypes(path: str, dtypes: dict, net: tf.keras.Model) -> None:
  """Checkpoints restore a weight into a variable of its own dtype only: 16-bit weights (--precision=16.16)
  and 32-bit ones (32.32, or 16.32, whose weights stay 32-bit) do not mix."""
  built = {}
  for weight in (weight for layer in _layers_with_weights(net) for weight in layer.weights):
    dtype = getattr(weight, "true_dtype", weight.dtype).base_dtype.name  # mixed precision: the stored dtype
    built[dtype] = built.get(dtype, 0) + 1
  if built != dtypes:
    sixteen = any(dtype in dtypes for dtype in ("float16", "bfloat16"))
    raise UserError("--init_from: %s holds %s weights, this run's network has %s ones: start it with "
                    "--precision=%s" % (path, " and ".join(sorted(dtypes)), " and ".join(sorted(built)),
                                        "16.16" if sixteen else "32.32 or 16.32 (whose weights are float32)"))


def _shapes(shapes) -> str:
  """E.g. `3x2 and 2` (the largest first)."""
  ordered = sorted(shapes, key=lambda shape: (-len(shape), shape))
  return " and ".join("x".join(str(size) for size in shape) or "a scalar" for shape in ordered)


def _read_network(net: tf.keras.Model, path: str) -> None:
  """Restores the weights of `net`'s layers alone from checkpoint `path`. A checkpoint object of `net`
  itself would restore its optimizer state too (Keras tracks the optimizer as the model's), which the
  new run starts afresh; this one holds the layers by the names Keras gives them in checkpoints."""
  layers = tf.Module()
  for index, layer in enumerate(_layers_with_weights(net)):
    setattr(layers, "layer_with_weights-%d" % index, layer)
  try:
    status = tf.train.Checkpoint(model=layers).read(path)
    status.assert_existing_objects_matched()
  except (AssertionError, ValueError, tf.errors.OpError) as error:
    raise UserError("--init_from: the network weights of %s do not load into this run's network (%s)"
                    % (path, " ".join(str(error).split())[:300])) from None
  status.expect_partial()
