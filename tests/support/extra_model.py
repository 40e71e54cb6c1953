"""A model added from one file, the way a user adds one: a small dense classifier of the MNIST digits
with a hyperparameter of its own, `--hidden_units`, declared beside it.

    python tests/support/extra_model.py --model=dense_mnist --hidden_units=32 [main.py's flags]

registers the model (one `MODELS` entry) and runs main.py's command line; nothing else in the
application names it. tests/test_extra_model.py trains it so.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import model  # noqa: E402  pylint: disable=wrong-import-position
from model.options import Option  # noqa: E402  pylint: disable=wrong-import-position

NAME = "dense_mnist"
OPTIONS = {"hidden_units": Option(64, "Units of the hidden layer.", lower_bound=1, upper_bound=4096)}


def build(config, input_shape=(28, 28, 1), num_outputs=10):
  """Flatten -> Dense(hidden_units, relu) -> Dense(num_outputs, softmax); uncompiled."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (registering needs no TensorFlow)
  layers = tf.keras.layers
  inputs = layers.Input(shape=input_shape, name="image")
  x = layers.Flatten(name="flatten")(inputs)
  x = layers.Dense(model.option_values(config)["hidden_units"], activation="relu", name="hidden")(x)
  outputs = layers.Dense(num_outputs, activation="softmax", dtype="float32", name="digit")(x)
  return tf.keras.Model(inputs, outputs, name=NAME)


def loss():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.keras.losses.SparseCategoricalCrossentropy()


def metrics():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return [tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


model.MODELS.setdefault(NAME, model.ModelInfo(
    module="tests.support.extra_model", dataset="mnist", task="classification", title="Dense MNIST",
    description="A dense classifier of the MNIST digits, registered from one file",
    defaults=dict(model.MODELS["mnist"].defaults, dropout=0.0),
    source_defaults=model.MODELS["mnist"].source_defaults, options=OPTIONS))

if __name__ == "__main__":
  import main  # pylint: disable=import-outside-toplevel  (after the entry: main's flags list the model)
  main.run_command_line()
