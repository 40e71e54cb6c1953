"""Rows of contiguous HDF5 datasets gathered by TensorFlow ops from a memory map: no Python per batch.

An HDF5 dataset stored contiguously and uncompressed (h5py's default layout, and that of the
reference's cellSpike files) is one run of bytes in its file: row i starts at `offset + i * row_bytes`
(h5py: `dataset.id.get_offset()`). TensorFlow's `ImmutableConst` op memory-maps a whole file as one
read-only tensor without reading it; a `tf.gather` of the wanted rows out of that tensor is then the
only copy a batch costs (the page cache -> the batch), the same single copy as an h5py read.

Why not h5py behind `tf.data.Dataset.from_generator`: one Python generator caps the
host at one Python thread, and an iterator destroyed while the generator thread waits for the GIL
blocks the thread that destroys it (a hang at a graceful stop, minutes of idling between epochs).
Everything here runs in tf.data's C++ threads. Why not `tf.data.FixedLengthRecordDataset` with
`header_bytes`: it skips the header by reading it, so a read at offset X costs X bytes.

Gathering works on "units" of `g = gcd(offset, row_bytes)` bytes: the file's first bytes, up to a
64-byte-aligned end past the dataset (`RowLayout.viewed_bytes`), are viewed as a byte matrix of g
columns, and row i is units (offset + i * row_bytes) / g ... + row_bytes / g.
The bytes are then bitcast to the stored dtype (byte-swapped first for a big-endian file). Nothing is
converted: float16 stays float16 until the model casts it on the device.

Datasets stored any other way (chunked, compressed, external, virtual) have no single offset; the
caller stages their rows into a contiguous file first (`data/staging.py`).

The file is mapped through the descriptor the run opened when it checked the file
(`RowLayout.pin`, data/pinned_files.py): every stream, started at any time, maps that same file, even
after its name was renamed over or deleted; a file that changes in place stops the run in one line.

The mapping op is kept out of TensorFlow's constant folding (`tf_workarounds.keep_out_of_constant_folding`),
which would copy the whole file at every iterator start.
"""

import dataclasses
import math
import os
from typing import Optional

import h5py
import numpy as np
import tensorflow as tf

import tf_workarounds

# TensorFlow's Slice shares a 1-D input's buffer only when both ends of the slice are multiples of
# EIGEN_MAX_ALIGN_BYTES (at most 64; slice_op.cc, IsDim0SliceAligned); otherwise it copies the whole
# mapped file, at every batch (a 895 MB file streamed 4,839 samples/s instead of 353,210).
_SLICE_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """Where the rows of one contiguous dataset are in its file, and how to decode them."""
  path: str
  offset: int            # byte offset of row 0
  row_shape: tuple       # one row, e.g. (1600, 4)
  dtype: np.dtype        # with its byte order, as stored
  file_size: int
  rows: int              # rows in the dataset
  # The file held open (data/pinned_files.py) whose bytes are mapped; None: `path` is mapped by name.
  pin: object = dataclasses.field(default=None, compare=False, repr=False)

  @property
  def region(self) -> str:
    """The name ImmutableConst maps: the held file's, whatever became of `path` since."""
    return self.pin.region if self.pin is not None else self.path

  @property
  def row_bytes(self) -> int:
    return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

  @property
  def unit(self) -> int:
    """Bytes per gathered unit: the largest size that divides both the offset and the row."""
    return math.gcd(self.offset, self.row_bytes)

  @property
  def viewed_bytes(self) -> int:
    """The file's first bytes that the gather views as units: past the dataset's end, a multiple of
    the unit, and also of _SLICE_ALIGN wherever the file is long enough, so that the view is no copy."""
    step = self.unit * _SLICE_ALIGN // math.gcd(self.unit, _SLICE_ALIGN)
    end = -(-(self.offset + self.rows * self.row_bytes) // step) * step
    return end if end <= self.file_size else self.file_size // self.unit * self.unit

  @property
  def tf_dtype(self) -> tf.DType:
    return tf.as_dtype(self.dtype.newbyteorder("="))


def not_contiguous_reason(dataset: h5py.Dataset, path: str) -> Optional[str]:
  """Why `dataset`, opened from the file `path`, cannot be memory-mapped there (None if it can)."""
  if not os.path.samefile(dataset.file.filename, path):
    return "in another file (%s), by an external link" % dataset.file.filename
  if dataset.is_virtual:
    return "a virtual dataset"
  if dataset.chunks is not None:
    return "chunked%s" % (" and compressed (%s)" % dataset.compression if dataset.compression else "")
  if dataset.external:
    return "stored in external files"
  if dataset.id.get_offset() is None:
    return "not allocated in the file"
  return None


def row_layout(path: str, dataset: h5py.Dataset, pin=None) -> RowLayout:
  """The layout of a contiguous dataset (check `not_contiguous_reason` first); read through `pin`, the
  file held open, when given (its size as checked)."""
  return RowLayout(path=os.path.abspath(path), offset=int(dataset.id.get_offset()),
                   row_shape=tuple(int(d) for d in dataset.shape[1:]), dtype=np.dtype(dataset.dtype),
                   file_size=pin.size if pin is not None else os.path.getsize(path),
                   rows=int(dataset.shape[0]), pin=pin)


def mapped_file(path: str, file_size: int) -> tf.data.Dataset:
  """An endless dataset repeating one tensor: the whole file, memory-mapped as uint8 bytes (`path`: a
  name that opens it, as `RowLayout.region`).

  The map runs inside the pipeline (nothing is embedded in the graph) and `cache()` keeps the one
  mapping for the iterator's life, so each page of the file is faulted in once, not once per batch.
  Frames and targets of a file share the mapping.
  """
  @tf.autograph.experimental.do_not_convert  # no Python control flow: conversion is start-up time
  def map_file(_):
    mapped = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[file_size], memory_region_name=path)
    tf_workarounds.keep_out_of_constant_folding(mapped.op)
    return mapped
  return tf.data.Dataset.from_tensors(tf.constant(0)).map(map_file).cache().repeat()


def gather_rows(layout: RowLayout, file_bytes: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
  """Rows `rows` (int64 indices into the dataset) as a (len(rows),) + row_shape tensor of its dtype."""
  unit = layout.unit
  # A slice from byte 0 to an aligned end and a reshape share the mapped buffer: no copy before the gather.
  units = tf.reshape(file_bytes[:layout.viewed_bytes], (-1, unit))
  per_row = layout.row_bytes // unit
  first = (layout.offset + rows * layout.row_bytes) // unit
  index = first[:, None] + tf.range(per_row, dtype=tf.int64)[None, :]
  raw = tf.reshape(tf.gather(units, index), (-1, layout.row_bytes // layout.dtype.itemsize,
                                             layout.dtype.itemsize))
  if layout.dtype.byteorder == ">":
    raw = tf.reverse(raw, axis=[-1])
  return tf.reshape(tf.bitcast(raw, layout.tf_dtype), (-1,) + layout.row_shape)
