"""Optimizer registry: `--optimizer` names to Keras 2 optimizers.

Keras 2 has two optimizer families with different checkpoint layouts: the legacy `OptimizerV2` (the
only one before TF 2.11; slots stored beside each weight, fused update kernels) and the `Optimizer`
of TF >= 2.11 (state under `optimizer/_variables`). `FORMATS` names them; a resumed run must build the
family its checkpoint was written with, or the optimizer state would silently start from zero.
"""

import tensorflow as tf

from errors import UserError


def _adamw(learning_rate, **kwargs):
  if not hasattr(tf.keras.optimizers, "AdamW"):  # Keras gained AdamW in TensorFlow 2.11.
    raise UserError("--optimizer=adamw needs TensorFlow >= 2.11; this is TensorFlow %s: use "
                    "--optimizer=adam" % tf.__version__)
  # PyTorch's AdamW default decay, as in the reference's poptorch.optim.AdamW.
  return tf.keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=0.01, **kwargs)


LEGACY, KERAS_2_11 = "optimizer_v2", "optimizer_2.11"
FORMATS = (LEGACY, KERAS_2_11)


def optimizer_format(optimizer) -> str:
  """Which family `optimizer` belongs to (see the module docstring)."""
  return LEGACY if hasattr(optimizer, "get_slot_names") else KERAS_2_11


def _adam(learning_rate, checkpoint_format=None, **kwargs):
  # Keras' optimizer of TF >= 2.11 updates each variable with about ten element-wise ops (fused only
  # under XLA, which it uses on GPUs alone); the legacy class runs one fused ResourceApplyAdam kernel
  # per variable, the same update rule. On TF < 2.11, tf.keras.optimizers.Adam is that class.
  legacy = getattr(tf.keras.optimizers, "legacy", None)
  if checkpoint_format == KERAS_2_11:  # a run started before the switch resumes with its own class
    return tf.keras.optimizers.Adam(learning_rate=learning_rate, **kwargs)
  factory = legacy.Adam if legacy is not None else tf.keras.optimizers.Adam
  return factory(learning_rate=learning_rate, **kwargs)


OPTIMIZERS = {
    "sgd": tf.keras.optimizers.SGD,
    "adam": _adam,
    "adamw": _adamw,
}


def make_optimizer(name: str, learning_rate: float, factories=None, checkpoint_format=None,
                   **backend_kwargs) -> tf.keras.optimizers.Optimizer:
  """The optimizer `name`. The backend may supply replacement `factories` (IPU-specific optimizers)
  and `backend_kwargs` (e.g. the IPU's gradient averaging over replicas). `checkpoint_format` is the
  family of the checkpoint a resumed run continues from (None for a new run)."""
  if name not in OPTIMIZERS:
    raise UserError("unknown optimizer %r; valid optimizers: %s" % (name, ", ".join(sorted(OPTIMIZERS))))
  if name == "adam" and name not in (factories or {}):
    return _adam(learning_rate, checkpoint_format, **backend_kwargs)
  factory = (factories or {}).get(name, OPTIMIZERS[name])
  return factory(learning_rate=learning_rate, **backend_kwargs)


def create_slots(optimizer, variables) -> None:
  """Creates the optimizer's state (slots, step counter) now, inside the caller's strategy scope.

  Left to Keras, the first traced training step creates it, and a tf.function whose first trace
  creates variables is traced a second time: about half a second of start-up for ontra4, which no
  executable cache can save. Both Keras 2 families (and the loss-scale wrappers) have the hook.
  """
  if hasattr(optimizer, "_create_all_weights"):  # legacy OptimizerV2 family (TF 2.4+)
    optimizer._create_all_weights(variables)  # pylint: disable=protected-access
  elif hasattr(optimizer, "build"):  # the TF >= 2.11 family
    optimizer.build(variables)
