"""The Keras MNIST check network (Graphcore's first-run example), 34,826 parameters.

Conv2D(32, 3x3) -> MaxPool -> Conv2D(64, 3x3) -> MaxPool -> Flatten -> Dropout(0.5) -> Dense(10).
The two convolution blocks and the classifier head are the natural pipeline stages; `STAGE_BOUNDARIES`
names the layer that starts each stage after the first, for backends that split the model.
"""

import tensorflow as tf

from run_config import RunConfig

NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
STAGE_BOUNDARIES = ("flatten",)


def build(config: RunConfig, input_shape=INPUT_SHAPE, num_outputs=NUM_CLASSES) -> tf.keras.Model:
  """Builds the (uncompiled) MNIST classifier."""
  layers = tf.keras.layers
  inputs = layers.Input(shape=input_shape, name="image")
  x = layers.Conv2D(32, kernel_size=(3, 3), activation="relu", name="conv1")(inputs)
  x = layers.MaxPooling2D(pool_size=(2, 2), name="pool1")(x)
  x = layers.Conv2D(64, kernel_size=(3, 3), activation="relu", name="conv2")(x)
  x = layers.MaxPooling2D(pool_size=(2, 2), name="pool2")(x)
  x = layers.Flatten(name="flatten")(x)
  x = layers.Dropout(config.dropout, name="dropout")(x)
  # float32 under mixed precision: softmax and cross-entropy at full precision.
  outputs = layers.Dense(num_outputs, activation="softmax", dtype="float32", name="digit")(x)
  return tf.keras.Model(inputs, outputs, name="mnist_cnn")


def loss():
  # Integer labels: the same cross-entropy as the reference's one-hot labels, without the one-hot copy.
  return tf.keras.losses.SparseCategoricalCrossentropy()


def metrics():
  return [tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
