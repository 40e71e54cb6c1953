"""Evaluation with the moving statistics that the checkpoints hold, not each replica's own.

Under tf.distribute's mirrored strategies (MirroredStrategy over GPU replicas, or CPU replicas with
gradient accumulation; MultiWorkerMirroredStrategy), Keras' BatchNormalization keeps one copy of its
moving mean and variance per replica: a SyncOnRead variable with MEAN aggregation, each copy updated
from its own replica's batches. Inside a replica (an evaluation step) a read returns that replica's
copy; outside (a checkpoint, get_weights(), tools/predict.py's restored model) it returns the copies'
mean. So a 4-replica run evaluated each quarter of its validation and test samples with other
statistics than the model it saved: on the main job's test split 0.1649 against 0.1646 for the saved
weights.

Setting every copy to the mean before each evaluation makes the reported losses those of the saved
model. Training is unchanged: the training step normalises with each batch's own statistics, and the
moving averages are linear in them, so the copies' mean evolves as before (up to float32 rounding).
CPU replicas without accumulation (CentralStorageStrategy) keep a single copy: nothing to share there.
IPU replicas keep a copy each in plain variables, of which the host reads replica 0's alone, so it
cannot average them: there every update is averaged over the replicas inside the training step
instead (strategies/ipu.py `share_moving_statistics`).
"""

import tensorflow as tf


def _per_replica_means(model: tf.keras.Model) -> list:
  # Distributed variables only: a plain variable (one replica, the default strategy) holds one value,
  # and rewriting it would only cost an op on its device; an IPU's replicas already agree.
  return [v for v in model.non_trainable_weights
          if isinstance(v, tf.distribute.DistributedValues)
          and v.synchronization == tf.VariableSynchronization.ON_READ
          and v.aggregation == tf.VariableAggregation.MEAN]


def share(model: tf.keras.Model) -> None:
  """Sets each replica's copy of `model`'s MEAN-aggregated SyncOnRead variables to the copies' mean
  (in cross-replica context: a read is the mean, an assignment reaches every copy). Every process of a
  multi-worker run must call it together: the read is a collective."""
  for variable in _per_replica_means(model):
    variable.assign(variable.read_value())


class ShareBeforeEvaluation(tf.keras.callbacks.Callback):
  """`share()` before every evaluation of a fit (its validation)."""

  def on_test_begin(self, logs=None):
    share(self.model)
