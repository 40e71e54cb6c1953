"""Optimizer registry: `--optimizer` names to Keras 2 optimizers."""

import tensorflow as tf

from errors import UserError


def _adamw(learning_rate, **kwargs):
  if not hasattr(tf.keras.optimizers, "AdamW"):  # Keras gained AdamW in TensorFlow 2.11.
    raise UserError("--optimizer=adamw needs TensorFlow >= 2.11; this is TensorFlow %s: use "
                    "--optimizer=adam" % tf.__version__)
  # PyTorch's AdamW default decay, as in the reference's poptorch.optim.AdamW.
  return tf.keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=0.01, **kwargs)


OPTIMIZERS = {
    "sgd": tf.keras.optimizers.SGD,
    "adam": tf.keras.optimizers.Adam,
    "adamw": _adamw,
}


def make_optimizer(name: str, learning_rate: float, factories=None,
                   **backend_kwargs) -> tf.keras.optimizers.Optimizer:
  """The optimizer `name`. The backend may supply replacement `factories` (IPU-specific optimizers)
  and `backend_kwargs` (e.g. the IPU's gradient averaging over replicas)."""
  if name not in OPTIMIZERS:
    raise UserError("unknown optimizer %r; valid optimizers: %s" % (name, ", ".join(sorted(OPTIMIZERS))))
  factory = (factories or {}).get(name, OPTIMIZERS[name])
  return factory(learning_rate=learning_rate, **backend_kwargs)
