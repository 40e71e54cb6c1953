"""tf.distribute's per-device input pipelines, without tf.data autotuning: no stall when one ends.

`strategy.experimental_distribute_dataset` (what Keras' fit, evaluate and predict call under every
tf.distribute strategy, one device included) feeds the replicas through a MultiDeviceIterator. For
each device it builds a small dataset (`_create_device_dataset` in
tensorflow/python/data/ops/multi_device_iterator_ops.py, TF 2.6 to 2.21) that carries default
`tf.data.Options`, so it is autotuned: its iterator starts a model thread
(`RootDataset::Iterator::EnsureModelThreadStarted`, tensorflow/core/data/root_dataset.cc). When the
iterator is destroyed (at the end of each fit, evaluate or predict, and at a graceful stop), its
destructor waits for that thread, which sleeps in `Model::OptimizeLoop` for up to its optimization
period (up to a minute) before it sees the cancellation. gdb showed the main thread there, idle,
for 0.2-110 s per fit on both TensorFlow stacks.

Those datasets only hand over elements that the input pipeline, with its own fixed parallelism,
has already produced; there is nothing in them to tune. `apply()` turns autotuning off for them.
If a future TensorFlow renames the function, the wrapper is skipped with one log line: input then
works as before, with the stall.
"""

from absl import logging

from data.splits import without_autotune

_PATCHED = "_without_autotune_wrapped"


def apply() -> bool:
  """Wraps tf.distribute's per-device dataset factory once per process; whether it is in effect."""
  from tensorflow.python.data.ops import multi_device_iterator_ops  # pylint: disable=g-import-not-at-top
  create = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
  if create is None:
    logging.warning("This TensorFlow has no multi_device_iterator_ops._create_device_dataset; "
                    "tf.distribute's per-device input stays autotuned (strategies/device_pipelines.py)")
    return False
  if not getattr(create, _PATCHED, False):
    def create_without_autotune(*args, **kwargs):
      return without_autotune(create(*args, **kwargs))
    setattr(create_without_autotune, _PATCHED, True)
    multi_device_iterator_ops._create_device_dataset = create_without_autotune  # pylint: disable=protected-access
  return True
