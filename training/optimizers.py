"""Optimizer registry: `--optimizer` names to Keras 2 optimizer constructors."""

import tensorflow as tf

from errors import UserError

OPTIMIZERS = {
    "sgd": tf.keras.optimizers.SGD,
    "adam": tf.keras.optimizers.Adam,
}


def make_optimizer(name: str, learning_rate: float) -> tf.keras.optimizers.Optimizer:
  if name not in OPTIMIZERS:
    raise UserError("unknown optimizer %r; valid optimizers: %s" % (name, ", ".join(sorted(OPTIMIZERS))))
  return OPTIMIZERS[name](learning_rate=learning_rate)
