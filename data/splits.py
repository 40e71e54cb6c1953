"""Shared tf.data plumbing: in-memory arrays to batched, static-shape, prefetched pipelines."""

import collections
import dataclasses
from typing import Callable, Optional

import tensorflow as tf
from absl import logging

from errors import UserError

Arrays = collections.namedtuple("Arrays", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How the backend consumes batches, decided in strategies/ and obeyed by every loader.

  tf.distribute strategies split one global batch into per-replica slices in order; an IPU replica
  takes whole dataset elements in turn. `replica_rows` is what one replica takes per optimizer step:
  the micro-batch times the gradient-accumulation count on CPU/GPU, where one step walks through them.
  """
  replicas: int = 1                   # replicas fed by this process
  replica_rows: int = 1
  element_per_replica: bool = False   # True: each element feeds one replica (IPU infeeds)
  eval_replica_rows: int = None       # rows per replica for evaluation (no accumulation); None: same
  steps_multiple: int = 1             # training steps are trimmed to a multiple (whole optimizer steps)
  eval_steps_multiple: int = 1        # evaluation steps too (e.g. an IPU inference pipeline's depth)
  eval_keeps_tail: bool = False       # evaluation may end with a short batch (see `keeps_tail`)
  eval_divides_shards: bool = False   # static evaluation batches sized to divide each shard (eval_layout)
  keeps_tail: bool = False            # a pass ends with a short batch instead of leaving its tail out
  first_shard: int = 0                # this process's first replica among all processes' replicas
  num_shards: int = 0                 # replicas of all processes (0: just this process's)

  @property
  def shards(self) -> range:
    """Global indices of the replicas (data shards) this process feeds."""
    return range(self.first_shard, self.first_shard + self.replicas)

  @property
  def total_shards(self) -> int:
    return self.num_shards or self.replicas

  @property
  def element_rows(self) -> int:
    return self.replica_rows if self.element_per_replica else self.replica_rows * self.replicas

  @property
  def elements_per_step(self) -> int:
    return self.replicas if self.element_per_replica else 1

  @property
  def step_rows(self) -> int:
    return self.replica_rows * self.replicas


def eval_layout(layout: BatchLayout, split_rows: int = 0) -> BatchLayout:
  """Evaluation has no accumulation: each replica takes one micro-batch per step. Where the backend
  allows it (tf.distribute splits a short global batch between the replicas), every sample is
  evaluated: the pass ends with a short batch. IPUs need every batch at its static shape; there, for
  a split of `split_rows` samples, each replica's batch is the largest one, down to half the
  micro-batch, that divides its shard: the built-in data's 512 rows per replica of 4 in batches of 32
  instead of 48, all 2,048 samples instead of 1,920. Training always takes whole batches."""
  rows = layout.replica_rows if layout.eval_replica_rows is None else layout.eval_replica_rows
  if layout.eval_divides_shards and split_rows:
    rows = dividing_batch(rows, split_rows // layout.total_shards, layout.eval_steps_multiple)
  return dataclasses.replace(layout, replica_rows=rows, eval_replica_rows=None,
                             steps_multiple=layout.eval_steps_multiple,
                             keeps_tail=layout.eval_keeps_tail, eval_keeps_tail=False,
                             eval_divides_shards=False)


def dividing_batch(batch: int, shard_rows: int, steps_multiple: int = 1) -> int:
  """The largest batch from `batch` down to half of it that splits `shard_rows` into a whole number
  of steps, that number a multiple of `steps_multiple`; `batch` itself if none does (the tail is then
  left out, as before). Not below half: smaller batches run the device at a lower rate."""
  for rows in range(batch, (batch + 1) // 2 - 1, -1):
    if rows and shard_rows % rows == 0 and (shard_rows // rows) % steps_multiple == 0:
      return rows
  return batch


@dataclasses.dataclass(frozen=True)
class Split:
  """One batched pipeline and its size in global batches.

  `dataset` is one pass. Training consumes `epochs_from(epoch)` instead: one endless stream of the
  passes of that epoch and the following ones, which Keras reads through a single iterator for the
  whole fit (given `steps_per_epoch`), so nothing is torn down and refilled between epochs.
  """
  dataset: tf.data.Dataset
  steps: int                 # steps per pass (each step: one element per replica, or one global batch)
  samples: int               # samples per pass
  blocks: tuple = ()         # [start, stop) rows of the file read by this process, per shard
  stream: Optional[Callable[[int], tf.data.Dataset]] = None   # epoch -> endless passes from it

  @property
  def elements_per_step(self) -> int:
    elements = int(self.dataset.cardinality())
    return elements // self.steps if elements > 0 and self.steps else 1

  def epochs_from(self, epoch: int, skip_steps: int = 0) -> tf.data.Dataset:
    """The passes of `epoch` onwards, endless, without the first `skip_steps` steps of `epoch`."""
    dataset = self.stream(epoch) if self.stream is not None else self.dataset.repeat()
    return dataset.skip(skip_steps * self.elements_per_step) if skip_steps else dataset


@dataclasses.dataclass(frozen=True)
class Splits:
  train: Split
  validation: Optional[Split]
  test: Optional[Split]
  source: str                # where the data came from, for the log and summary.yaml
  input_shape: tuple         # one sample, without the batch dimension
  num_outputs: int           # classes or regression targets
  summary_extras: dict = dataclasses.field(default_factory=dict)  # dataset entries for summary.yaml

  @property
  def evaluation_steps(self) -> list:
    """The steps of the validation and test splits there are (what a compiled step count must fit)."""
    return [split.steps for split in (self.validation, self.test) if split]


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` with tf.data's autotuning off: our pipelines set their parallelism themselves.

  An autotuned iterator keeps a model thread that sleeps up to a minute between rounds, and
  destroying the iterator (the end of every fit, a graceful stop) waits for it (gdb: the main thread
  in ~LogicalThreadWrapper under ~RootDataset::Iterator). tf.distribute's own per-device datasets
  get the same option in `strategies/device_pipelines.py`.
  """
  options = tf.data.Options()
  if hasattr(options, "autotune"):          # TF >= 2.7; TF 2.6 has the experimental spelling
    options.autotune.enabled = False
  else:
    options.experimental_optimization.autotune = False
  return dataset.with_options(options)


def count_steps(num_samples: int, step_rows: int, max_steps: int, name: str, multiple: int = 1,
                keeps_tail: bool = False) -> int:
  """Whole steps in a split, and the short last one if `keeps_tail` (optionally capped, and trimmed
  to a multiple); a UserError if none."""
  steps = -(-num_samples // step_rows) if keeps_tail else num_samples // step_rows
  if max_steps > steps:
    # A limit above the split is not an error (a limit), but the user asked for more steps than run.
    logging.info("--%s=%d is more than the %s split's %d step%s of %d samples: %s pass over it",
                 "steps_per_epoch" if name == "train" else "eval_steps", max_steps, name, steps,
                 "" if steps == 1 else "s", num_samples, "each epoch is one" if name == "train" else "one")
  if max_steps:
    steps = min(steps, max_steps)
  steps = steps // multiple * multiple
  if steps == 0:
    raise UserError("the %s split has %d samples, fewer than one global batch of %d "
                    "(lower --batch_size, --gradient_accumulation or --replicas)"
                    % (name, num_samples, step_rows * multiple))
  return steps


# The pipelines' functions branch only on Python values, never on tensors: AutoGraph's conversion of each
# (it parses the function's source again) would only add start-up, about 0.4 s of a short main.py run.
unconverted = tf.autograph.experimental.do_not_convert


def split_from_arrays(arrays: Arrays, layout: BatchLayout, transform: Callable, shuffle: bool, seed: int,
               max_steps: int, name: str) -> Split:
  """Builds source -> shuffle -> batch -> transform -> take -> prefetch.

  Batching before the transform lets the per-sample work (cast, scale) run once per batch as one
  vectorised op. Unless the layout keeps the tail, the remainder is dropped: every batch then has the
  same static shape, which IPUs require and which keeps XLA from compiling a second program for a
  short last batch. A shuffled split orders each pass by a permutation drawn from (seed, pass) alone,
  so that a run resumed in epoch E reads exactly the batches an uninterrupted run reads there
  (`Split.epochs_from`). `transform` is traced without AutoGraph (`unconverted`): plain TensorFlow ops.
  """
  if layout.total_shards > layout.replicas:  # several processes: this one's contiguous part only
    per_shard = len(arrays.x) // layout.total_shards
    rows = slice(layout.first_shard * per_shard, (layout.first_shard + layout.replicas) * per_shard)
    arrays = Arrays(arrays.x[rows], arrays.y[rows])
  parts = _replica_parts(arrays, layout)
  rows = sum(len(part.x) for part in parts)
  steps = count_steps(rows, layout.step_rows, max_steps, name, layout.steps_multiple, layout.keeps_tail)
  batch_rows = layout.element_rows if len(parts) == 1 else layout.replica_rows
  tensors = [(tf.constant(part.x), tf.constant(part.y)) for part in parts] if shuffle else []

  def one_pass(epoch):
    if shuffle:
      batched = [_shuffled_batches(x, y, batch_rows, not layout.keeps_tail, (seed, index), epoch)
                 for index, (x, y) in enumerate(tensors)]
    else:
      batched = [tf.data.Dataset.from_tensor_slices((part.x, part.y)).batch(
          batch_rows, drop_remainder=not layout.keeps_tail) for part in parts]
    dataset = combine_replicas(batched, layout.element_per_replica).map(unconverted(transform),
                                                                        num_parallel_calls=2)
    return dataset.take(steps * layout.elements_per_step)

  def stream(first_epoch: int) -> tf.data.Dataset:
    passes = tf.data.Dataset.range(first_epoch, 2**62).flat_map(unconverted(one_pass))
    return without_autotune(passes.prefetch(2))

  return Split(dataset=without_autotune(one_pass(0).prefetch(2)), steps=steps,
               samples=min(rows, steps * layout.step_rows), stream=stream if shuffle else None)


def _shuffled_batches(x, y, batch_rows: int, drop_remainder: bool, seed: tuple, epoch) -> tf.data.Dataset:
  """The batches of one pass over (x, y) in the order of pass `epoch`: a permutation drawn from (seed,
  epoch) alone (a stateless draw), not from how many passes this process has read before."""
  key = tf.stack([tf.constant(seed[0], tf.int64) * 1000003 + seed[1], tf.cast(epoch, tf.int64)])
  order = tf.argsort(tf.random.stateless_uniform([int(x.shape[0])], seed=key))
  batches = tf.data.Dataset.from_tensor_slices(order).batch(batch_rows, drop_remainder=drop_remainder)
  return batches.map(unconverted(lambda rows: (tf.gather(x, rows), tf.gather(y, rows))),
                     num_parallel_calls=2)


def combine_replicas(streams: list, element_per_replica: bool, parallel_calls: int = 2) -> tf.data.Dataset:
  """One element per step from the replicas' streams, laid out as the backend consumes them."""
  if len(streams) == 1:
    return streams[0]
  if element_per_replica:  # IPU infeeds (and multi-worker input): replica r takes every r-th element
    return tf.data.experimental.choose_from_datasets(
        streams, tf.data.Dataset.range(len(streams)).repeat())
  # tf.distribute splits a global batch in order: replica r gets slice r.
  return tf.data.Dataset.zip(tuple(streams)).map(
      unconverted(lambda *parts: (tf.concat([p[0] for p in parts], 0),
                                  tf.concat([p[1] for p in parts], 0))),
      num_parallel_calls=parallel_calls, deterministic=True)


def _replica_parts(arrays: Arrays, layout: BatchLayout) -> list:
  """The arrays as batches are cut from them: where replicas take elements in turn and a pass ends
  with a short batch, one equal part per replica (each replica then gets a short batch in the same
  step); otherwise the whole arrays."""
  if not (layout.keeps_tail and layout.element_per_replica and layout.replicas > 1):
    return [arrays]
  rows = len(arrays.x) // layout.replicas
  return [Arrays(arrays.x[r * rows:(r + 1) * rows], arrays.y[r * rows:(r + 1) * rows])
          for r in range(layout.replicas)]
