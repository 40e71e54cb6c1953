"""Contiguous local copies of the rows a process reads: for HDF5 datasets that cannot be memory-mapped,
and for node-local staging (`--stage_dir`).

Two uses, one copy routine (h5py, window by window, so memory stays bounded):
- **Not memory-mappable.** Chunked, compressed, virtual or externally stored datasets have no single
  byte offset, so `data/hdf5_native.py` cannot gather from them. Without `--stage_dir`, such a split is
  copied at start-up into a temporary folder, removed at exit (`stage_rows`). A process killed with
  SIGKILL cannot remove it; the next run on the same host removes the folders of processes that no
  longer exist (their names carry host and PID).
- **Node-local staging** (`--stage_dir`, e.g. ALCF's `/local/$USER`, as MLPerf-HPC applications stage
  their share of the data before training). Every split is copied, whatever its layout, so the run
  never reads the shared file system after start-up (`stage_to`):
  - only this process's rows (its shard blocks), into a small cellSpike file of its own, named after
    the source, its path, the keys and the rows, so processes and runs never collide;
  - written to a fresh temporary name (created exclusively, never through a link), fsynced, then
    renamed: a killed copy leaves no file to mistake for a good one (the next run on the host removes
    it); a write that fails is one line naming the copy and the cause, with the copy removed and h5py
    closed without its crash (data/hdf5_writes.py); the free space and the file-size limit are
    checked first;
  - stamped with the source's identity (real path, size, modification time) and a BLAKE2b checksum of
    the copied rows. A later run reuses the copy when the stamp matches and the checksum still
    verifies. It copies again when the source changed, or when the copy is damaged;
  - the copy time and rate are logged. A full disk or an unwritable folder is one `error:` line that
    says what to do.

The source is read through the descriptor that the run's check opened (`source`, a PinnedFile of
data/pinned_files.py), so that the rows copied are those of the file checked; the caller holds the
copy open in turn for the run's reads.
"""

import atexit
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time

import h5py
import numpy as np
import psutil
from absl import logging

from data import hdf5_writes
from errors import UserError
from host import atomic_files

_COPY_BYTES = 64 * 2**20   # bytes copied per h5py read
_STAMP = "staged_from"     # attribute of a staged file: the source identity and the checksum (JSON)


def _free_bytes(folder: str) -> int:
  return shutil.disk_usage(folder).free


def _row_bytes(dataset: h5py.Dataset) -> int:
  return max(1, dataset.dtype.itemsize * int(np.prod(dataset.shape[1:])))


def _needed_bytes(source: h5py.File, keys: tuple, start: int, stop: int) -> int:
  return sum((stop - start) * _row_bytes(source[key]) for key in keys)


def _windows(dataset: h5py.Dataset, start: int, stop: int):
  """Row ranges [first, last) of at most _COPY_BYTES each, covering [start, stop)."""
  step = max(1, _COPY_BYTES // _row_bytes(dataset))
  for first in range(start, stop, step):
    yield first, min(first + step, stop)


def _host_prefix() -> str:
  """Temporary copies are named cellspike-stage-<host>-<pid>-<random>."""
  return "cellspike-stage-%s-" % socket.gethostname()


def remove_orphans(folder: str) -> None:
  """Removes this host's temporary copies (`stage_rows`) whose process no longer exists."""
  pattern = re.compile(re.escape(_host_prefix()) + r"(\d+)-")
  for name in os.listdir(folder):
    match = pattern.match(name)
    if match and not psutil.pid_exists(int(match.group(1))):
      shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
      logging.info("removed %s, left by a process that was killed", os.path.join(folder, name))


def _opened(path: str, source=None):
  """h5py's view of the source: through `source`, the file held open since its check, when given."""
  return source.opened() if source is not None else h5py.File(path, "r")


def stage_rows(path: str, keys: tuple, start: int, stop: int, source=None) -> str:
  """Copies rows [start, stop) of datasets `keys` of `path` (read through `source`, the file held open,
  when given) into a contiguous file in a temporary folder.

  The staged file holds the same keys, row `start` of the source becoming row 0; it is removed at
  exit. Returns its path.
  """
  folder = tempfile.gettempdir()
  remove_orphans(folder)
  try:
    staged_dir = tempfile.mkdtemp(prefix="%s%d-" % (_host_prefix(), os.getpid()), dir=folder)
  except OSError as error:
    raise UserError("cannot stage data into %s (%s); pass --stage_dir=<a writable folder>"
                    % (folder, error.strerror)) from None
  atexit.register(shutil.rmtree, staged_dir, ignore_errors=True)
  staged = os.path.join(staged_dir, os.path.basename(path))
  with _opened(path, source) as f:
    needed = _needed_bytes(f, keys, start, stop)
    _check_space(path, keys, needed, staged_dir, "pass --stage_dir=<a larger disk> or convert the file "
                 "to contiguous datasets (h5repack -l CONTI)")
    logging.info("%s: %s not contiguous; staging rows %d-%d (%.1f MB) into %s", path, "/".join(keys),
                 start, stop, needed / 1e6, staged_dir)
    _copy(f, keys, start, stop, staged, path)
  return staged


def staged_name(path: str, keys: tuple, start: int, stop: int) -> str:
  """The staged file's name: the source's base name, a digest of its real path and keys, the rows."""
  digest = hashlib.blake2b(("%s|%s" % (os.path.realpath(path), ",".join(keys))).encode(),
                           digest_size=6).hexdigest()
  return "%s.%s.rows%d-%d.h5" % (os.path.splitext(os.path.basename(path))[0], digest, start, stop)


def source_identity(path: str, keys: tuple, start: int, stop: int, source=None) -> dict:
  """What a staged copy was made from: the file (`source`, held open, when given), and the files its
  keys' external links lead to (whose replacement leaves the outer file as it was)."""
  if source is not None:
    size, mtime_ns = source.size, source.mtime_ns
  else:
    status = os.stat(path)
    size, mtime_ns = status.st_size, status.st_mtime_ns
  identity = {"source": os.path.realpath(path), "size": size, "mtime_ns": mtime_ns,
              "keys": list(keys), "rows": [start, stop]}
  with _opened(path, source) as f:
    linked = sorted({os.path.realpath(f[key].file.filename) for key in keys} - {identity["source"]})
  if linked:  # only then: the copies staged from files without links keep their stamps
    identity["linked"] = [[name, os.stat(name).st_size, os.stat(name).st_mtime_ns] for name in linked]
  return identity


def stage_to(path: str, keys: tuple, start: int, stop: int, stage_dir: str, source=None) -> str:
  """The rows [start, stop) of `keys` of `path` in `stage_dir`: reused if still valid, else copied
  (from `source`, the file held open since its check, when given)."""
  try:
    os.makedirs(stage_dir, exist_ok=True)
  except OSError as error:
    raise _unwritable(stage_dir, error) from None
  staged = os.path.join(stage_dir, staged_name(path, keys, start, stop))
  identity = source_identity(path, keys, start, stop, source)
  if os.path.exists(staged):
    started = time.perf_counter()
    stale = _stale_reason(staged, identity)
    if stale is None:
      logging.info("%s: reusing the staged rows %d-%d of %s (checksum verified in %.1f s)", staged, start,
                   stop, "/".join(keys), time.perf_counter() - started)
      return staged
    logging.warning("%s: staging again: %s", staged, stale)
  for removed in atomic_files.remove_stale(staged):
    logging.info("removed %s, the partial copy of a process on this host that was killed", removed)
  with _opened(path, source) as f:
    needed = _needed_bytes(f, keys, start, stop)
    _check_space(path, keys, needed, stage_dir, "free space there or choose a larger --stage_dir")
    started = time.perf_counter()
    partial = atomic_files.temporary_name(staged)
    try:
      checksum = _copy(f, keys, start, stop, partial, path, stamp=identity, final_path=staged)
      _fsync(partial)
      os.replace(partial, staged)
    except OSError as error:  # the fsync's, the rename's
      raise _failed_write(staged, keys, path, error) from None
    finally:
      if os.path.lexists(partial):
        os.remove(partial)
  seconds = time.perf_counter() - started
  logging.info("%s: staged rows %d-%d of %s (%.1f MB) in %.1f s (%.0f MB/s), checksum %s", staged, start,
               stop, "/".join(keys), needed / 1e6, seconds, needed / 1e6 / max(seconds, 1e-9), checksum[:16])
  return staged


def _unwritable(folder: str, error: OSError) -> UserError:
  return UserError("--stage_dir=%s cannot be written (%s): pass a folder this process can write, e.g. "
                   "a node-local disk such as /local/$USER" % (folder, error.strerror or error))


def _size(count: int) -> str:
  return "%.2f GB" % (count / 1e9) if count >= 1e9 else "%.1f MB" % (count / 1e6)


def _check_space(path: str, keys: tuple, needed: int, folder: str, what_to_do: str) -> None:
  free = _free_bytes(folder)
  if needed > free:
    raise UserError("%s: staging %s needs %s but %s has %s free; %s"
                    % (path, "/".join(keys), _size(needed), folder, _size(free), what_to_do))
  what = "%s: staging %s into %s" % (path, "/".join(keys), folder)
  hdf5_writes.check_size_limit(hdf5_writes.with_headers(needed), what, "raise the limit")


def _failed_write(target_path: str, keys: tuple, path: str, error: BaseException) -> UserError:
  """The one line for a copy to `target_path` that could not be written (its partial file removed)."""
  folder = os.path.dirname(target_path)
  if atomic_files.disk_full(error):
    return UserError("%s ran out of space while staging %s from %s; free space there or choose a larger "
                     "--stage_dir" % (folder, "/".join(keys), path))
  if atomic_files.is_write_error(error) and "read failed" not in str(error):  # not the source's
    cause = atomic_files.write_error(target_path, hdf5_writes.plain_error(error))
    return UserError("%s: staging %s from %s failed: %s" % (folder, "/".join(keys), path, cause))
  return UserError("%s: staging %s into %s failed (%s)" % (path, "/".join(keys), folder,
                                                          " ".join(str(error).split())))


def _stale_reason(staged: str, identity: dict):
  """None if `staged` holds `identity`'s rows intact; else why it must be copied again."""
  try:
    with h5py.File(staged, "r") as copy:
      stamp = json.loads(copy.attrs.get(_STAMP, "{}"))
      if {k: v for k, v in stamp.items() if k != "checksum"} != identity:
        return "the source file changed (size, modification time or path) since it was staged"
      if _checksum(copy, identity["keys"]) != stamp.get("checksum"):
        return "the staged copy does not match its checksum (damaged)"
  except (OSError, ValueError, KeyError) as error:
    return "the staged copy is unreadable (%s)" % " ".join(str(error).split())[:120]
  return None


def _checksum(copy: h5py.File, keys: list) -> str:
  digest = hashlib.blake2b()
  for key in keys:
    dataset = copy[key]
    for first, last in _windows(dataset, 0, dataset.shape[0]):
      digest.update(np.ascontiguousarray(dataset[first:last]).data)
  return digest.hexdigest()


def _copy(source: h5py.File, keys: tuple, start: int, stop: int, target_path: str, path: str,
          stamp: dict = None, final_path: str = None) -> str:
  """Copies the rows into a new contiguous file `target_path` (to be renamed `final_path`, which an
  error names). With a `stamp` (node-local staging), the file is stamped with it and the rows'
  checksum, which is returned; a temporary copy is not hashed."""
  digest = hashlib.blake2b() if stamp is not None else None
  try:
    with hdf5_writes.created(target_path) as target:
      for key in keys:
        _copy_rows(source[key], target, key, start, stop, digest)
      if stamp is not None:
        target.attrs[_STAMP] = json.dumps(dict(stamp, checksum=digest.hexdigest()))
  except (OSError, RuntimeError, ValueError) as error:  # damaged chunks, a full disk, a file-size limit
    raise _failed_write(final_path or target_path, keys, path, error) from None
  return digest.hexdigest() if digest is not None else None


def _copy_rows(dataset: h5py.Dataset, target: h5py.File, key: str, start: int, stop: int, digest) -> None:
  out = target.create_dataset(key, shape=(stop - start,) + dataset.shape[1:], dtype=dataset.dtype)
  for first, last in _windows(dataset, start, stop):
    rows = np.ascontiguousarray(dataset[first:last])
    if digest is not None:
      digest.update(rows.data)
    out[first - start:last - start] = rows


def _fsync(path: str) -> None:
  with open(path, "rb") as handle:
    os.fsync(handle.fileno())
