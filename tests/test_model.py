"""The model registry and the MNIST network."""

import numpy as np
import pytest
import tensorflow as tf

import model
from errors import UserError
from run_config import RunConfig


def test_unknown_model_lists_valid_names():
  with pytest.raises(UserError, match="unknown model 'resnet'; valid models: .*mnist"):
    model.get_model_info("resnet")


@pytest.mark.parametrize("name", sorted(model.MODELS))
def test_every_registered_model_builds(name):
  module = model.get_model_module(name)
  net = module.build(RunConfig(model=name))
  assert isinstance(net, tf.keras.Model)
  for boundary in getattr(module, "STAGE_BOUNDARIES", ()):
    net.get_layer(boundary)  # Stage boundaries name real layers.


def test_mnist_network_matches_the_keras_check():
  net = model.get_model_module("mnist").build(RunConfig(model="mnist"))
  assert net.count_params() == 34826
  assert [type(layer).__name__ for layer in net.layers[1:]] == [
      "Conv2D", "MaxPooling2D", "Conv2D", "MaxPooling2D", "Flatten", "Dropout", "Dense"]
  probabilities = net(np.zeros((3, 28, 28, 1), np.float32)).numpy()
  np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
