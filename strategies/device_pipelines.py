"""tf.distribute's per-device input pipelines, without tf.data autotuning: no stall when one ends.

`strategy.experimental_distribute_dataset` (what Keras' fit, evaluate and predict call under every
tf.distribute strategy, one device included) feeds the replicas through a MultiDeviceIterator. For
each device it builds a small dataset that carries default `tf.data.Options`, so it is autotuned: its
iterator starts a model thread (`RootDataset::Iterator::EnsureModelThreadStarted`,
tensorflow/core/data/root_dataset.cc). When the iterator is destroyed (at the end of each fit, evaluate
or predict, and at a graceful stop), its destructor waits for that thread, which sleeps in
`Model::OptimizeLoop` for up to its optimization period (up to a minute) before it sees the
cancellation. gdb showed the main thread there, idle, for 0.2-110 s per fit on both TensorFlow stacks.

Those datasets only hand over elements that the input pipeline, with its own fixed parallelism,
has already produced; there is nothing in them to tune. `apply()` turns autotuning off for them,
through a private function of TensorFlow's (`tf_workarounds.wrap_device_datasets`). If a future
TensorFlow renames it, one log line: input then works as before, with the stall.
"""

from absl import logging

from data.splits import without_autotune
import tf_workarounds


def apply() -> bool:
  """Turns autotuning off in tf.distribute's per-device datasets, once per process; whether it is in effect."""
  if tf_workarounds.wrap_device_datasets(without_autotune):
    return True
  logging.warning("This TensorFlow has no multi_device_iterator_ops._create_device_dataset; "
                  "tf.distribute's per-device input stays autotuned (strategies/device_pipelines.py)")
  return False
