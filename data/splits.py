"""Shared tf.data plumbing: in-memory arrays to batched, static-shape, prefetched pipelines."""

import collections
import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from errors import UserError

Arrays = collections.namedtuple("Arrays", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Split:
  """One batched pipeline and its size in global batches."""
  dataset: tf.data.Dataset
  steps: int                 # global batches per pass
  samples: int               # samples per pass (steps x global batch)


@dataclasses.dataclass(frozen=True)
class Splits:
  train: Split
  validation: Optional[Split]
  test: Optional[Split]
  source: str                # where the data came from, for the log and summary.yaml
  input_shape: tuple         # one sample, without the batch dimension
  num_outputs: int           # classes or regression targets
  summary_extras: dict = dataclasses.field(default_factory=dict)  # dataset entries for summary.yaml


def count_steps(num_samples: int, global_batch_size: int, max_steps: int, name: str) -> int:
  """Whole global batches in a split (optionally capped); a UserError if there is not even one."""
  steps = num_samples // global_batch_size
  if steps == 0:
    raise UserError("the %s split has %d samples, fewer than one global batch of %d "
                    "(lower --batch_size or --replicas)" % (name, num_samples, global_batch_size))
  return min(steps, max_steps) if max_steps else steps


def make_split(arrays: Arrays, global_batch_size: int, transform: Callable, shuffle: bool, seed: int,
               max_steps: int, name: str) -> Split:
  """Builds source -> shuffle -> batch(drop_remainder) -> transform -> take -> prefetch.

  Batching before the transform lets the per-sample work (cast, scale) run once per batch as one
  vectorised op. `drop_remainder=True` keeps every batch the same static shape, which IPUs require and
  which keeps XLA from compiling a second program for a short last batch.
  """
  steps = count_steps(len(arrays.x), global_batch_size, max_steps, name)
  dataset = tf.data.Dataset.from_tensor_slices((arrays.x, arrays.y))
  if shuffle:
    # A full-size buffer is a true shuffle; it reshuffles every epoch from the seeded start.
    dataset = dataset.shuffle(len(arrays.x), seed=seed, reshuffle_each_iteration=True)
  dataset = dataset.batch(global_batch_size, drop_remainder=True)
  dataset = dataset.map(transform, num_parallel_calls=tf.data.experimental.AUTOTUNE)
  dataset = dataset.take(steps).prefetch(tf.data.experimental.AUTOTUNE)
  return Split(dataset=dataset, steps=steps, samples=steps * global_batch_size)
