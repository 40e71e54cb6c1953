"""Optimizer registry: `--optimizer` names to Keras 2 optimizers."""

import tensorflow as tf

from errors import UserError


def _adamw(learning_rate):
  if not hasattr(tf.keras.optimizers, "AdamW"):  # Keras gained AdamW in TensorFlow 2.11.
    raise UserError("--optimizer=adamw needs TensorFlow >= 2.11; this is TensorFlow %s: use "
                    "--optimizer=adam" % tf.__version__)
  # PyTorch's AdamW default decay, as in the reference's poptorch.optim.AdamW.
  return tf.keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=0.01)


OPTIMIZERS = {
    "sgd": lambda learning_rate: tf.keras.optimizers.SGD(learning_rate=learning_rate),
    "adam": lambda learning_rate: tf.keras.optimizers.Adam(learning_rate=learning_rate),
    "adamw": _adamw,
}


def make_optimizer(name: str, learning_rate: float) -> tf.keras.optimizers.Optimizer:
  if name not in OPTIMIZERS:
    raise UserError("unknown optimizer %r; valid optimizers: %s" % (name, ", ".join(sorted(OPTIMIZERS))))
  return OPTIMIZERS[name](learning_rate)
