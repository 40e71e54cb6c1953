"""A contiguous copy of the rows a process reads, for HDF5 datasets that cannot be memory-mapped.

Chunked, compressed, virtual or externally stored datasets have no single byte offset, so
`data/hdf5_native.py` cannot gather from them. Such a split is copied once, at start-up, into a small
contiguous HDF5 file of this process's own rows (only its shard blocks), read with h5py window by
window so memory stays bounded; the pipeline then maps that file. The copy lives in `stage_dir` (a
node-local disk on a cluster; the system's temporary folder by default) and is removed at exit.
"""

import atexit
import os
import shutil
import tempfile

import h5py
import numpy as np
from absl import logging

from errors import UserError

_COPY_BYTES = 64 * 2**20   # bytes copied per h5py read


def _free_bytes(folder: str) -> int:
  return shutil.disk_usage(folder).free


def stage_rows(path: str, keys: tuple, start: int, stop: int, stage_dir: str = None) -> str:
  """Copies rows [start, stop) of datasets `keys` of `path` into a new contiguous HDF5 file.

  The staged file holds the same keys, row `start` of the source becoming row 0. Returns its path.
  """
  folder = stage_dir or tempfile.gettempdir()
  try:
    os.makedirs(folder, exist_ok=True)
    staged_dir = tempfile.mkdtemp(prefix="cellspike-stage-", dir=folder)
  except OSError as error:
    raise UserError("cannot stage data into %s (%s)" % (folder, error.strerror)) from None
  atexit.register(shutil.rmtree, staged_dir, ignore_errors=True)
  staged = os.path.join(staged_dir, os.path.basename(path))
  with h5py.File(path, "r") as source:
    needed = sum((stop - start) * source[key].dtype.itemsize * int(np.prod(source[key].shape[1:]))
                 for key in keys)
    if needed > _free_bytes(staged_dir):
      raise UserError("%s: staging %s (%.1f GB) needs more free space than %s has; convert the file to "
                      "contiguous datasets (h5repack -l CONTI) or pass --stage_dir=<a larger disk>"
                      % (path, ", ".join(keys), needed / 1e9, folder))
    logging.info("%s: %s not contiguous; staging rows %d-%d (%.1f MB) into %s", path, "/".join(keys),
                 start, stop, needed / 1e6, staged_dir)
    try:
      with h5py.File(staged, "w") as target:
        for key in keys:
          _copy_rows(source[key], target, key, start, stop)
    except (OSError, RuntimeError, ValueError) as error:  # damaged chunks, a full disk
      raise UserError("%s: staging %s into %s failed (%s)" % (path, "/".join(keys), staged_dir,
                                                             " ".join(str(error).split()))) from None
  return staged


def _copy_rows(dataset: h5py.Dataset, target: h5py.File, key: str, start: int, stop: int) -> None:
  out = target.create_dataset(key, shape=(stop - start,) + dataset.shape[1:], dtype=dataset.dtype)
  row_bytes = max(1, dataset.dtype.itemsize * int(np.prod(dataset.shape[1:])))
  step = max(1, _COPY_BYTES // row_bytes)
  for first in range(start, stop, step):
    last = min(first + step, stop)
    out[first - start:last - start] = dataset[first:last]
