"""Neuron-Inverter input pipeline: cellSpike HDF5 -> sharded, shuffled tf.data batches, no Python per batch.

Sharding follows the reference: every replica (of every process) owns one contiguous, equal block of a
split, a whole number of local batches long; the tail that does not fill a batch on every shard is
left out. Evaluation splits, where the backend allows a short last batch (`BatchLayout.keeps_tail`),
are read whole instead: equal blocks of any length, each ending with a short batch, so at most
(shards - 1) samples are left out. Each epoch's order within a block is computed by TensorFlow's
stateless RNG from (seed, shard, epoch) only, so a resumed run sees the same order as an
uninterrupted one, on any machine.

Streaming mode visits the block in chunks of `read_chunk` rows (rounded to whole batches) in a shuffled
order and shuffles rows within each window of `shuffle_buffer` rows of that order; the batches are
gathered straight from the memory-mapped file (`data/hdf5_native.py`), in parallel, in tf.data's own
threads, so host memory holds a few batches per replica whatever the file's size (the real files are
15-144 GB). In-memory mode copies each block into host memory once, as the reference does, and
shuffles the whole block every epoch. Files whose datasets are chunked or compressed are staged into a
contiguous copy first (`data/staging.py`). Batches keep the file's dtype (float16 frames cross to the
device at half the bytes); the model casts them.
"""

import dataclasses
import os

import h5py
import numpy as np
import tensorflow as tf
from absl import logging

from data import cellspike_file, hdf5_native, pinned_files, staging, synthetic
from data import splits as splits_lib
from data.splits import BatchLayout, Split, Splits, count_steps, eval_layout
from errors import UserError
from host import atomic_files
from host.cpuinfo import usable_cores
from run_config import RunConfig, cache_hint

# 65,536 training samples: with 16,384 the 3M-parameter ontra4 over-fits from epoch ~9 and recovers
# only 6 of the 15 conductances (r >= 0.7); with 65,536 it recovers 9, among them every parameter that
# the simulation makes identifiable (docs/data.md, "The built-in simulated dataset"). float16, as the
# production cellSpike files.
DEFAULT_SAMPLES = {"train": 65536, "val": 2048, "test": 2048}
DEFAULT_CELL = "synth"
DEFAULT_DATA_VERSION = "v3"  # bump whenever the built-in dataset changes (simulation, size, dtype)


def shard_blocks(num_samples: int, num_shards: int, batch_size: int, split: str,
                 whole_batches: bool = True, path: str = "") -> list:
  """Contiguous, equal, disjoint [start, stop) blocks, each a whole number of local batches unless
  `whole_batches` is False (`path`: the file, for the error)."""
  per_shard = num_samples // num_shards
  if whole_batches:
    per_shard = per_shard // batch_size * batch_size
  if per_shard == 0:
    least, lower = (("one batch of %d" % batch_size, "--batch_size, --gradient_accumulation or --replicas")
                    if whole_batches else ("one sample", "--replicas (one shard each)"))
    raise UserError("%sthe %s split has %d samples: too few for %d shard%s of at least %s (lower %s)"
                    % (path + ": " if path else "", split, num_samples, num_shards,
                       "" if num_shards == 1 else "s", least, lower))
  return [(i * per_shard, (i + 1) * per_shard) for i in range(num_shards)]


# Batches gathered in parallel per replica, and batches queued per replica ahead of the consumer. Fixed,
# not AUTOTUNE: see `data.splits.without_autotune`.
_PARALLEL_GATHERS = max(2, min(8, usable_cores()))
_QUEUED_BATCHES = 2


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """How one replica walks its block: every epoch's order is a function of (seed, shard, epoch).

  Streaming visits the block's chunks of `chunk_rows` in a shuffled order and shuffles rows within each
  window of `window_chunks` consecutive chunks of that order; in-memory mode (and the reference)
  shuffles the whole block. Evaluation splits are read in order.
  """
  block: tuple          # [start, stop) rows of the split (file numbering)
  batch_rows: int
  batches: int          # batches per epoch (the first ones of the epoch's order)
  chunk_rows: int
  window_chunks: int
  shuffle: bool
  seed: int
  shard: int
  whole_block: bool     # in-memory mode: one window holding the whole block
  keeps_tail: bool = False  # unshuffled: the last batch may be short (the rest of the block)


def _draw_seed(plan: ShardPlan, epoch, draw: int) -> tf.Tensor:
  """A stateless RNG seed unique to (seed, shard, epoch, draw), the same on every machine."""
  epoch = tf.cast(epoch, tf.int64)
  return tf.stack([tf.constant(plan.seed % 2**62, tf.int64),
                   (tf.constant(plan.shard, tf.int64) * 2**24 + epoch) * 4 + draw])


def epoch_rows(plan: ShardPlan, epoch) -> tf.Tensor:
  """(batches, batch_rows) int64 rows of the block, relative to its start, for one epoch."""
  n = plan.block[1] - plan.block[0]
  rows = tf.range(n, dtype=tf.int64)
  if plan.shuffle:
    if plan.whole_block:
      window = tf.zeros_like(rows)
    else:
      chunks = -(-n // plan.chunk_rows)
      chunk_order = tf.argsort(tf.random.stateless_uniform([chunks], _draw_seed(plan, epoch, 0),
                                                           maxval=2**31 - 1, dtype=tf.int64))
      visit = tf.cast(tf.math.invert_permutation(chunk_order), tf.int64)  # visit rank of each chunk
      window = tf.gather(visit, rows // plan.chunk_rows) // plan.window_chunks
    noise = tf.random.stateless_uniform([n], _draw_seed(plan, epoch, 1), maxval=2**31 - 1,
                                        dtype=tf.int64)
    rows = tf.cast(tf.argsort(window * 2**31 + noise), tf.int64)  # windows in visit order, shuffled within
  return tf.reshape(rows[:plan.batches * plan.batch_rows], (plan.batches, plan.batch_rows))


@dataclasses.dataclass(frozen=True)
class ShardSource:
  """The two datasets of a split as the pipeline reads them; `first_row` is the file row of row 0."""
  frames: hdf5_native.RowLayout
  targets: hdf5_native.RowLayout
  first_row: int = 0


def _epoch_batches(plan: ShardPlan, epoch) -> tf.data.Dataset:
  """One epoch's batches of rows (int64, relative to the block's start)."""
  if plan.shuffle or not plan.keeps_tail:
    return tf.data.Dataset.from_tensor_slices(epoch_rows(plan, epoch))
  block_rows = plan.block[1] - plan.block[0]
  return tf.data.Dataset.range(block_rows).batch(plan.batch_rows).take(plan.batches)


def _shard_stream(source: ShardSource, plan: ShardPlan, first_epoch: int) -> tf.data.Dataset:
  """Endless (frames, targets) batches of one replica, epoch `first_epoch` onwards, in the stored dtype."""
  block_start = plan.block[0] - source.first_row
  unconverted = splits_lib.unconverted  # 36 AutoGraph conversions less in a short main.py run
  indices = tf.data.Dataset.range(first_epoch, 2**62).flat_map(
      unconverted(lambda epoch: _epoch_batches(plan, epoch)))
  mapped = hdf5_native.mapped_file(source.frames.region, source.frames.file_size)
  if plan.whole_block:  # gathered once into host memory; every batch is then gathered from there
    block = tf.range(block_start, block_start + plan.block[1] - plan.block[0], dtype=tf.int64)
    held = mapped.take(1).map(unconverted(
        lambda data: (hdf5_native.gather_rows(source.frames, data, block),
                      hdf5_native.gather_rows(source.targets, data, block))))
    batches = tf.data.Dataset.zip((indices, held.cache().repeat())).map(
        unconverted(lambda rows, xy: (tf.gather(xy[0], rows), tf.gather(xy[1], rows))),
        num_parallel_calls=_PARALLEL_GATHERS, deterministic=True)
  else:
    batches = tf.data.Dataset.zip((indices, mapped)).map(
        unconverted(lambda rows, data: (hdf5_native.gather_rows(source.frames, data, rows + block_start),
                                        hdf5_native.gather_rows(source.targets, data, rows + block_start))),
        num_parallel_calls=_PARALLEL_GATHERS, deterministic=True)
  return batches.prefetch(_QUEUED_BATCHES)


def _contiguous_source(info, split: str, rows: tuple, stage_dir) -> ShardSource:
  """The split's datasets, memory-mappable: the file itself, or a staged copy of rows [start, stop)
  (always in `stage_dir` when one is given: node-local staging; see data/staging.py). Either is read
  through a descriptor held open from its check (data/pinned_files.py), and watched for changes."""
  keys = (cellspike_file.FRAMES_KEY % split, cellspike_file.TARGETS_KEY % split)
  pinned_files.guard_bus_errors()  # a mapped file that shrinks: one line, not "Bus error"
  source = pinned_files.held(info.path, info.pin)
  if stage_dir:
    staged = staging.stage_to(info.path, keys, rows[0], rows[1], stage_dir, source=source)
  else:
    with source.opened() as f:
      if not any(hdf5_native.not_contiguous_reason(f[key], info.path) for key in keys):
        pinned_files.watch(source)
        return ShardSource(*(hdf5_native.row_layout(info.path, f[key], source) for key in keys))
    staged = staging.stage_rows(info.path, keys, rows[0], rows[1], source=source)
  copy = pinned_files.PinnedFile.open(staged)
  pinned_files.watch(copy)
  with copy.opened() as f:
    return ShardSource(*(hdf5_native.row_layout(staged, f[key], copy) for key in keys), first_row=rows[0])


def chunk_rows_for(read_chunk: int, batch_rows: int) -> int:
  """Streaming chunks are whole batches long (at least one), as close to `read_chunk` as that allows."""
  return max(1, read_chunk // batch_rows) * batch_rows


def split_from_file(info, split: str, config, layout: BatchLayout, *, first_epoch: int, shuffle: bool,
                    max_steps: int, max_rows: int = 0) -> Split:
  """The tf.data pipeline of one split, one contiguous block per replica; of its first `max_rows`
  rows only, if given."""
  num = info.splits[split].num_samples
  if max_rows:
    num = min(num, max_rows)
  keeps_tail = layout.keeps_tail and not shuffle
  blocks = shard_blocks(num, layout.total_shards, layout.replica_rows, split, whole_batches=not keeps_tail,
                        path=info.path)
  mine = [blocks[shard] for shard in layout.shards]
  block_rows = blocks[0][1] - blocks[0][0]
  steps = count_steps(block_rows * layout.replicas, layout.step_rows, max_steps, split,
                      layout.steps_multiple, keeps_tail)
  source = _contiguous_source(info, split, (mine[0][0], mine[-1][1]), config.stage_dir)
  chunk_rows = chunk_rows_for(config.read_chunk, layout.replica_rows)
  plans = [ShardPlan(block=blocks[shard], batch_rows=layout.replica_rows, batches=steps,
                     chunk_rows=chunk_rows, window_chunks=max(1, config.shuffle_buffer // chunk_rows),
                     shuffle=shuffle, seed=config.seed, shard=shard, whole_block=config.in_memory,
                     keeps_tail=keeps_tail)
           for shard in layout.shards]

  def stream(epoch: int) -> tf.data.Dataset:
    combined = splits_lib.combine_replicas([_shard_stream(source, plan, epoch) for plan in plans],
                                           layout.element_per_replica, _PARALLEL_GATHERS)
    return splits_lib.without_autotune(combined.prefetch(_QUEUED_BATCHES * layout.elements_per_step))

  elements = steps * layout.elements_per_step
  one_pass = stream(first_epoch).take(elements).apply(tf.data.experimental.assert_cardinality(elements))
  samples = min(block_rows, steps * layout.replica_rows) * layout.replicas
  _log_split(info, split, layout, source, plans, steps, samples, config.in_memory)
  return Split(dataset=one_pass, steps=steps, samples=samples, blocks=tuple(mine), stream=stream)


def _log_split(info, split, layout, source, plans, steps, samples, in_memory) -> None:
  row_bytes = source.frames.row_bytes + source.targets.row_bytes
  if in_memory:
    held = sum(p.block[1] - p.block[0] for p in plans) * row_bytes
  else:  # queued + being gathered, per replica; the file itself is only mapped (page cache)
    held = len(plans) * (2 * _QUEUED_BATCHES + _PARALLEL_GATHERS) * plans[0].batch_rows * row_bytes
  short = samples - (steps - 1) * layout.step_rows
  last = ", the last of %d" % short if short != layout.step_rows else ""
  logging.info("%s split: %d samples, %d per %s in %d steps of %d%s (shards %d-%d of %d, %d rows each); "
               "%s, about %.0f MB of host memory; %d bytes per sample to the device (%s frames, %s targets)",
               split, info.splits[split].num_samples, samples, "epoch" if plans[0].shuffle else "pass",
               steps, layout.step_rows, last, layout.shards[0], layout.shards[-1], layout.total_shards,
               plans[0].block[1] - plans[0].block[0],
               "in-memory mode" if in_memory else "streaming", held / 1e6, row_bytes,
               source.frames.dtype.name, source.targets.dtype.name)


def _opened(data):
  """h5py's view of `data`: a CellSpikeFile (read through the file it holds open) or a path."""
  pin = getattr(data, "pin", None)
  return pin.opened() if pin is not None else h5py.File(getattr(data, "path", data), "r")


def training_mean(data):
  """The mean target vector of the train split (float64) of `data` (a CellSpikeFile, or a file's
  path), or None if the file has none."""
  with _opened(data) as f:
    key = cellspike_file.TARGETS_KEY % "train"
    return np.asarray(f[key][:], np.float64).mean(axis=0) if key in f else None


def mean_predictor_losses(data, rows: dict) -> dict:
  """MSE of always predicting the training-set mean on the [start, stop) row ranges `rows[split]` of
  each split of `data` (a CellSpikeFile, or a file's path): the baselines a model must beat (the train
  split read once for all of them)."""
  mean = training_mean(data)
  with _opened(data) as f:
    targets = {split: np.concatenate([np.asarray(f[cellspike_file.TARGETS_KEY % split][start:stop], np.float64)
                                      for start, stop in ranges])
               for split, ranges in rows.items()}
  return {split: float(np.mean((values - mean) ** 2)) for split, values in targets.items()}


def evaluated_rows(split: Split, total_shards: int) -> list:
  """The [start, stop) rows an evaluation split reads in all processes together: shard k's block
  starts at k block lengths (`shard_blocks`) and is read from its start, as far as --eval_steps (or
  whole batches) allow. The baseline over these rows is the one the split's loss compares with."""
  start, stop = split.blocks[0]
  read = split.samples // len(split.blocks)
  return [(shard * (stop - start), shard * (stop - start) + read) for shard in range(total_shards)]


def default_data_path(config: RunConfig) -> str:
  """The built-in dataset: generated once by the neuron simulation into a cache folder, then reused.
  Processes that start together (two jobs, a multi-worker run's workers) generate it once: the others
  wait for the first and then read its file."""
  from data import cellspike_generate  # pylint: disable=import-outside-toplevel
  folder = os.path.join(config.data_cache, "cellspike-%s-seed0" % DEFAULT_DATA_VERSION)
  path = os.path.join(folder, cellspike_generate.h5_name(DEFAULT_CELL))
  if not os.path.isfile(path):
    _check_cache_folder(config.data_cache, folder)
    def on_wait():
      logging.info("Another process is generating the built-in dataset into %s; waiting for it", folder)
    with atomic_files.one_writer_at_a_time(path, on_wait):
      if not os.path.isfile(path):  # else written by the process this one waited for
        logging.info("Generating the built-in dataset into %s (once; later runs reuse it)", folder)
        return cellspike_generate.generate_dataset(
            folder, cell_name=DEFAULT_CELL, num_train=DEFAULT_SAMPLES["train"],
            num_val=DEFAULT_SAMPLES["val"], num_test=DEFAULT_SAMPLES["test"], seed=0, fp16=True,
            workers=usable_cores(), label="--data_cache=%s" % config.data_cache)
  logging.info("Using the built-in generated dataset %s", path)
  return path


def _check_cache_folder(data_cache: str, folder: str) -> None:
  """Creates the dataset's folder, or says in one line why it cannot hold the dataset."""
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as error:
    raise UserError("--data_cache=%s: cannot create %s for the built-in dataset (%s%s)"
                    % (data_cache, folder, error.strerror, cache_hint(folder))) from None
  if not os.access(folder, os.W_OK | os.X_OK):
    raise UserError("--data_cache=%s: cannot write the built-in dataset into %s (permission denied)"
                    % (data_cache, folder))


def open_configured(config: RunConfig):
  """Resolves `--data_path` (or the built-in dataset) and opens the file with full validation."""
  if config.data_path:
    return cellspike_file.open_named(config.data_path, config.cell_name, config.probe_type)
  path = default_data_path(config)
  return cellspike_file.open_cellspike(path, cellspike_file.resolve(path, None, config.probe_type)[1])


def _synthetic_splits(config: RunConfig, layout: BatchLayout) -> Splits:
  """--synthetic_data: the configured file's shapes, dtype and sizes (the built-in one's without a
  --data_path, which is then not generated), with random batches and no reads."""
  if config.data_path:
    info = open_configured(config)
    shape, params = info.input_shape, info.num_params
    dtype = tf.as_dtype(info.splits["train"].dtype.newbyteorder("="))
    sizes = {split: s.num_samples for split, s in info.splits.items()}
  else:
    shape, params, dtype, sizes = (1600, 4), 15, tf.float16, DEFAULT_SAMPLES
  element = synthetic.regression_element(shape, params, dtype, config.seed)
  def split(name, split_layout, max_steps):
    return synthetic.synthetic_split(element, split_layout, sizes[name], max_steps, name)
  return Splits(train=split("train", layout, config.steps_per_epoch),
                validation=split("val", eval_layout(layout), config.eval_steps),
                test=split("test", eval_layout(layout), config.eval_steps),
                source=synthetic.SOURCE, input_shape=tuple(shape), num_outputs=params,
                summary_extras={"par_names": ["par%d" % i for i in range(params)]})


def load(config: RunConfig, layout: BatchLayout, first_epoch: int = 0) -> Splits:
  """Train (shuffled), val and test splits of the configured cellSpike file."""
  if config.synthetic_data:
    return _synthetic_splits(config, layout)
  info = open_configured(config)
  logging.info("cellSpike file %s: %s; frames %s, %d parameters", info.path,
               ", ".join("%s %d (%s)" % (d, s.num_samples, s.dtype) for d, s in info.splits.items()),
               info.input_shape, info.num_params)
  train = split_from_file(info, "train", config, layout, first_epoch=first_epoch, shuffle=True,
                          max_steps=config.steps_per_epoch)

  def evaluation(split: str) -> Split:
    return split_from_file(info, split, config, eval_layout(layout, info.splits[split].num_samples),
                           first_epoch=0, shuffle=False, max_steps=config.eval_steps)

  validation, test = evaluation("val"), evaluation("test")
  baselines = mean_predictor_losses(info, {"val": evaluated_rows(validation, layout.total_shards),
                                                "test": evaluated_rows(test, layout.total_shards)})
  return Splits(
      train=train,
      validation=validation,
      test=test,
      source="cellSpike: " + info.path,
      input_shape=info.input_shape,
      num_outputs=info.num_params,
      summary_extras={
          "mean_predictor_val_loss": baselines["val"],
          "mean_predictor_test_loss": baselines["test"],
          "par_names": list(info.par_names),
          "train_blocks": [list(block) for block in train.blocks],
          "input_meta": info.meta,
      },
  )
