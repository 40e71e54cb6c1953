"""Neuron-Inverter input pipeline: cellSpike HDF5 -> sharded, shuffled, streamed tf.data batches.

Sharding follows the reference: every replica (of every process) owns one contiguous, equal block of a
split, a whole number of local batches long; the tail that does not fill a batch on every shard is
left out. Within its block a replica's samples are shuffled every epoch from a seed that depends only
on (seed, shard, epoch), so a resumed run sees the same order as an uninterrupted one.

Streaming mode reads each block in contiguous chunks (`read_chunk` rows) visited in a shuffled order,
and shuffles rows inside a window of `shuffle_buffer` rows, so host memory is bounded by the window, not
by the file (the real files are 15-144 GB). In-memory mode loads each block once, as the reference does,
and shuffles the whole block every epoch.
"""

import os

import h5py
import numpy as np
import tensorflow as tf
from absl import logging

from data import cellspike_file
from data.splits import BatchLayout, Split, Splits, count_steps, eval_layout
from errors import UserError
from run_config import RunConfig

# 65,536 training samples: with 16,384 the 3M-parameter ontra4 over-fits from epoch ~9 and recovers
# only 6 of the 15 conductances (r >= 0.7); with 65,536 it recovers 9, among them every parameter that
# the simulation makes identifiable (docs/GENERATOR.md). float16, as the production cellSpike files.
DEFAULT_SAMPLES = {"train": 65536, "val": 2048, "test": 2048}
DEFAULT_CELL = "synth"
DEFAULT_DATA_VERSION = "v2"  # bump whenever the built-in dataset changes (simulation, size, dtype)


def shard_blocks(num_samples: int, num_shards: int, batch_size: int, split: str) -> list:
  """Contiguous, equal, disjoint [start, stop) blocks, each a whole number of local batches."""
  per_shard = num_samples // num_shards // batch_size * batch_size
  if per_shard == 0:
    raise UserError("the %s split has %d samples: too few for %d shard(s) of at least one batch of %d "
                    "(lower --batch_size, --gradient_accumulation or --replicas)"
                    % (split, num_samples, num_shards, batch_size))
  return [(i * per_shard, (i + 1) * per_shard) for i in range(num_shards)]


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
  """An uninitialised array whose data start on an `alignment`-byte boundary.

  TensorFlow takes over a numpy buffer without copying only if it is aligned for Eigen (64 bytes);
  numpy's own allocations are 16-byte aligned, so every batch would otherwise be copied once more.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  offset = -raw.ctypes.data % alignment
  return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class BlockReader:
  """Yields local batches of one contiguous block of one split, epoch after epoch."""

  def __init__(self, path, split, block, batch_size, read_chunk, shuffle_buffer, seed, shard, shuffle,
               in_memory):
    self.path, self.split, (self.start, self.stop) = path, split, block
    self.batch_size, self.read_chunk = batch_size, read_chunk
    self.chunks_per_window = max(1, shuffle_buffer // read_chunk)
    self.seed, self.shard, self.shuffle, self.in_memory = seed, shard, shuffle, in_memory
    self._cache = None
    self._buffers = None

  def _rng(self, epoch):
    return np.random.RandomState([self.seed % 2**32, self.shard, epoch])

  def _datasets(self, f):
    return f[cellspike_file.FRAMES_KEY % self.split], f[cellspike_file.TARGETS_KEY % self.split]

  def _window_buffers(self, frames, targets, rows):
    """One reusable pair of arrays per reader: windows are read into them, never concatenated."""
    if self._buffers is None or len(self._buffers[0]) < rows:
      self._buffers = (np.empty((rows,) + frames.shape[1:], frames.dtype),
                       np.empty((rows,) + targets.shape[1:], targets.dtype))
    return self._buffers

  def _windows(self, f, rng):
    """Yields (frames, targets) windows: several chunks, each read contiguously (chunk order shuffled)."""
    frames, targets = self._datasets(f)
    if self.in_memory:
      if self._cache is None:
        self._cache = frames[self.start:self.stop], targets[self.start:self.stop]
      yield self._cache
      return
    chunks = list(range(self.start, self.stop, self.read_chunk))
    if self.shuffle:
      chunks = [chunks[i] for i in rng.permutation(len(chunks))]
    window_x, window_y = self._window_buffers(frames, targets, self.chunks_per_window * self.read_chunk)
    for i in range(0, len(chunks), self.chunks_per_window):
      filled = 0
      for start in chunks[i:i + self.chunks_per_window]:
        stop = min(start + self.read_chunk, self.stop)
        frames.read_direct(window_x, np.s_[start:stop], np.s_[filled:filled + stop - start])
        targets.read_direct(window_y, np.s_[start:stop], np.s_[filled:filled + stop - start])
        filled += stop - start
      yield window_x[:filled], window_y[:filled]

  def batches(self, epoch):
    """One epoch of local batches; rows that do not fill a batch carry over into the next window."""
    rng = self._rng(epoch)
    carry = None  # (frames, targets) left over from the previous window: fewer rows than a batch
    with h5py.File(self.path, "r") as f:
      for x, y in self._windows(f, rng):
        order = rng.permutation(len(x)) if self.shuffle else np.arange(len(x))
        used = 0
        while True:
          needed = self.batch_size - (0 if carry is None else len(carry[0]))
          if len(order) - used < needed:
            break
          yield self._gather(x, y, order[used:used + needed], carry)
          used, carry = used + needed, None
        rest = (np.take(x, order[used:], axis=0), np.take(y, order[used:], axis=0))
        carry = rest if carry is None else (np.concatenate([carry[0], rest[0]]),
                                            np.concatenate([carry[1], rest[1]]))

  def _gather(self, x, y, rows, lead):
    """One batch: the `lead` rows (if any), then rows `rows` of the window, in a new aligned array.

    A new array per batch is safe to hand over (tf.data may hold it while the next one is filled), and
    batch-sized blocks are recycled by malloc without page faults. Being 64-byte aligned, TensorFlow
    wraps it as a tensor without copying it again.
    """
    out_x = aligned_empty((self.batch_size,) + x.shape[1:], x.dtype)
    out_y = aligned_empty((self.batch_size,) + y.shape[1:], y.dtype)
    start = 0
    if lead is not None:
      start = len(lead[0])
      out_x[:start], out_y[:start] = lead
    np.take(x, rows, axis=0, out=out_x[start:], mode="clip")  # "raise" would copy twice
    np.take(y, rows, axis=0, out=out_y[start:], mode="clip")
    return out_x, out_y

  @property
  def memory_rows(self):
    """Rows this reader holds at most: its block in memory mode, one window (+ carry) when streaming."""
    if self.in_memory:
      return self.stop - self.start
    return self.chunks_per_window * self.read_chunk + self.batch_size


def _step_elements(readers, first_epoch, element_per_replica):
  """A generator factory: every call (a new pass of tf.data) yields one epoch of dataset elements."""
  state = {"epoch": first_epoch}

  def generate():
    epoch = state["epoch"]
    state["epoch"] += 1
    for parts in zip(*(reader.batches(epoch) for reader in readers)):
      if element_per_replica:  # IPU infeeds: replica r takes the r-th element of each step
        for part in parts:
          yield part
      else:  # tf.distribute splits a global batch in order: replica r gets slice r
        yield np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

  return generate


def make_split(info, split, config, layout: BatchLayout, first_epoch, shuffle, max_steps) -> Split:
  """The tf.data pipeline of one split, one contiguous block per replica."""
  num = info.splits[split].num_samples
  blocks = shard_blocks(num, layout.total_shards, layout.replica_rows, split)
  # Each process reads only the blocks of the replicas it feeds (its own disjoint part of the file).
  readers = [BlockReader(info.path, split, blocks[shard], layout.replica_rows, config.read_chunk,
                         config.shuffle_buffer, config.seed, shard, shuffle, config.in_memory)
             for shard in layout.shards]
  block_rows = blocks[0][1] - blocks[0][0]
  steps = count_steps(block_rows * layout.replicas, layout.step_rows, max_steps, split,
                      layout.steps_multiple)
  elements = steps * layout.elements_per_step
  dtype = tf.as_dtype(info.splits[split].dtype)
  dataset = tf.data.Dataset.from_generator(
      _step_elements(readers, first_epoch, layout.element_per_replica),
      output_signature=(tf.TensorSpec((layout.element_rows,) + info.input_shape, dtype),
                        tf.TensorSpec((layout.element_rows, info.num_params), dtype)))
  # fp16 files feed float32 to the model; the cast runs once per batch.
  dataset = dataset.map(lambda x, y: (tf.cast(x, tf.float32), tf.cast(y, tf.float32)))
  dataset = dataset.take(elements).apply(tf.data.experimental.assert_cardinality(elements))
  dataset = dataset.prefetch(2 * layout.elements_per_step)
  bytes_per_row = (np.prod(info.input_shape) + info.num_params) * info.splits[split].dtype.itemsize
  held = sum(r.memory_rows for r in readers) * bytes_per_row
  logging.info("%s split: %d samples, shards %d-%d of %d, %d rows each, %d steps of %d; %s holds %.1f MB "
               "of host memory", split, num, layout.shards[0], layout.shards[-1], layout.total_shards,
               block_rows, steps, layout.step_rows,
               "in-memory mode" if config.in_memory else "streaming", held / 1e6)
  return Split(dataset=dataset, steps=steps, samples=steps * layout.step_rows,
               blocks=tuple(blocks[shard] for shard in layout.shards))


def mean_predictor_loss(path: str, split: str = "val") -> float:
  """MSE on `split` of always predicting the training-set mean: the baseline a model must beat."""
  with h5py.File(path, "r") as f:
    mean = np.asarray(f[cellspike_file.TARGETS_KEY % "train"][:], np.float64).mean(axis=0)
    targets = np.asarray(f[cellspike_file.TARGETS_KEY % split][:], np.float64)
  return float(np.mean((targets - mean) ** 2))


def default_data_path(config: RunConfig) -> str:
  """The built-in dataset: generated once by the neuron simulation into a cache folder, then reused."""
  from data import cellspike_generate  # pylint: disable=import-outside-toplevel
  folder = os.path.join(config.data_cache, "cellspike-%s-seed0" % DEFAULT_DATA_VERSION)
  path = os.path.join(folder, cellspike_generate.h5_name(DEFAULT_CELL))
  if os.path.isfile(path):
    logging.info("Using the built-in generated dataset %s", path)
    return path
  logging.info("Generating the built-in dataset into %s (once; later runs reuse it)", folder)
  return cellspike_generate.generate_dataset(
      folder, cell_name=DEFAULT_CELL, num_train=DEFAULT_SAMPLES["train"],
      num_val=DEFAULT_SAMPLES["val"], num_test=DEFAULT_SAMPLES["test"], seed=0, fp16=True,
      workers=os.cpu_count() or 1)


def open_configured(config: RunConfig):
  """Resolves `--data_path` (or the built-in dataset) and opens the file with full validation."""
  if config.data_path:
    path, yaml_info = cellspike_file.resolve(config.data_path, config.cell_name, config.probe_type)
  else:
    path, yaml_info = default_data_path(config), None
    yaml_info = cellspike_file.resolve(path, None, config.probe_type)[1]
  return cellspike_file.open_cellspike(path, yaml_info)


def load(config: RunConfig, layout: BatchLayout, first_epoch: int = 0) -> Splits:
  """Train (shuffled), val and test splits of the configured cellSpike file."""
  info = open_configured(config)
  logging.info("cellSpike file %s: %s; frames %s, %d parameters", info.path,
               ", ".join("%s %d (%s)" % (d, s.num_samples, s.dtype) for d, s in info.splits.items()),
               info.input_shape, info.num_params)
  train = make_split(info, "train", config, layout, first_epoch, True, config.steps_per_epoch)
  return Splits(
      train=train,
      validation=make_split(info, "val", config, eval_layout(layout), 0, False, config.eval_steps),
      test=make_split(info, "test", config, eval_layout(layout), 0, False, config.eval_steps),
      source="cellSpike: " + info.path,
      input_shape=info.input_shape,
      num_outputs=info.num_params,
      summary_extras={
          "mean_predictor_val_loss": mean_predictor_loss(info.path),
          "par_names": list(info.par_names),
          "train_blocks": [list(block) for block in train.blocks],
          "input_meta": info.meta,
      },
  )
