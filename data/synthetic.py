"""`--synthetic_data`: batches made once from random numbers and repeated, with no file reads.

As in Graphcore's applications, a run on synthetic data measures the device and the step alone: if it
trains much faster than on the real input, the run is host-bound (input pipeline, file system). The
batches have the real data's shapes and dtypes, and as many steps per epoch as the real data would
give, so the two runs' figures compare directly. On IPUs `strategies/environment.py` also sets
Poplar's `--use_synthetic_data`, which generates the data on the device and skips the host transfer.
"""

from typing import Callable

import tensorflow as tf

from data.splits import BatchLayout, Split, count_steps, unconverted, without_autotune

SOURCE = "synthetic (random batches made once, no file reads)"


def _repeated(make_element: Callable, rows: int) -> tf.data.Dataset:
  """One element of `rows` rows, made inside the pipeline (not embedded in the graph), cached once
  per iterator and repeated. `rows` enters the map as a Python number, so the element's shape is
  static: IPU infeeds refuse an unknown batch dimension (IPUDataHandler._validate_dataset)."""
  element = tf.data.Dataset.from_tensors(0).map(unconverted(lambda _: make_element(rows)))
  return without_autotune(element.cache().repeat())


def synthetic_split(make_element: Callable, layout: BatchLayout, num_samples: int, max_steps: int,
               name: str) -> Split:
  """A Split repeating one element made by `make_element(rows)`, with the real split's step count
  (and, where the layout keeps the tail, its short last batch)."""
  per_shard = num_samples // layout.total_shards
  steps = count_steps(per_shard * layout.replicas, layout.step_rows, max_steps, name,
                      layout.steps_multiple, layout.keeps_tail)
  element = _repeated(make_element, layout.element_rows)
  per_step, elements = layout.elements_per_step, steps * layout.elements_per_step
  short = per_shard - (steps - 1) * layout.replica_rows  # each replica's rows in the last step
  tail = layout.keeps_tail and short < layout.replica_rows
  if tail:
    tail_element = _repeated(make_element, short if layout.element_per_replica else short * layout.replicas)
    one_pass = element.take(elements - per_step).concatenate(tail_element.take(per_step))
  else:
    one_pass = element.take(elements)
  one_pass = one_pass.apply(tf.data.experimental.assert_cardinality(elements))
  # Training streams the one element; an evaluation that ends with a short batch repeats its passes.
  endless = one_pass.repeat() if tail else element
  return Split(dataset=one_pass, steps=steps,
               samples=per_shard * layout.replicas if tail else steps * layout.step_rows,
               stream=lambda epoch: endless)


def regression_element(input_shape: tuple, num_outputs: int, dtype: tf.DType, seed: int) -> Callable:
  """Normal frames and uniform targets in [-1, 1] (the unitStar range) of `dtype`."""
  def make(rows):
    x = tf.random.stateless_normal(tf.concat([[rows], input_shape], 0), seed=[seed, 1])
    y = tf.random.stateless_uniform([rows, num_outputs], seed=[seed, 2], minval=-1.0, maxval=1.0)
    return tf.cast(x, dtype), tf.cast(y, dtype)
  return make


def classification_element(input_shape: tuple, num_classes: int, seed: int) -> Callable:
  """Uniform float32 images in [0, 1] and integer labels."""
  def make(rows):
    x = tf.random.stateless_uniform(tf.concat([[rows], input_shape], 0), seed=[seed, 1])
    y = tf.random.stateless_uniform([rows], seed=[seed, 2], maxval=num_classes, dtype=tf.int32)
    return x, y
  return make
