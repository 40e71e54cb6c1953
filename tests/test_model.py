"""The model registry and the MNIST network."""

import numpy as np
import pytest
import tensorflow as tf

import model
import model.designs
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


@pytest.mark.parametrize("design, trainable", [("ontra4", 2988843), ("dev", 431683)])
def test_neuron_inverter_parameter_counts_match_the_reference(design, trainable):
  net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", design=design))
  assert sum(int(np.prod(w.shape)) for w in net.trainable_weights) == trainable
  assert net.output_shape == (None, 15)


@pytest.mark.parametrize("name, rate", [("neuron_inverter", 0.05), ("mnist", 0.3)])
def test_dropout_layers_take_the_configured_rate(name, rate):
  net = model.get_model_module(name).build(RunConfig(model=name, design="dev", dropout=rate))
  rates = [layer.rate for layer in net.layers if isinstance(layer, tf.keras.layers.Dropout)]
  assert rates and set(rates) == {rate}


def test_neuron_inverter_input_is_reshaped_not_transposed():
  """Conv "channel" c at position j must be the flat element c*1600 + j of the (1600, 4) sample."""
  net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", design="dev"))
  to_conv = tf.keras.Model(net.input, net.get_layer("channels_last").output)
  sample = np.arange(1600 * 4, dtype=np.float32).reshape(1, 1600, 4)
  seen = to_conv(sample).numpy()[0]          # (positions 1600, channels 4), channels last
  for channel in range(4):
    np.testing.assert_array_equal(seen[:, channel], np.arange(channel * 1600, (channel + 1) * 1600))


@pytest.mark.parametrize("design", ["ontra4", "dev"])
def test_neuron_inverter_refuses_frames_too_short_for_its_conv_blocks(design):
  module = model.get_model_module("neuron_inverter")
  config = RunConfig(model="neuron_inverter", design=design)
  shortest = module.min_time_bins(model.designs.DESIGNS[design])
  assert module.build(config, (shortest, 4)).get_layer("flatten").output_shape[1] > 0
  with pytest.raises(UserError, match="--design=%s needs frames of at least %d time bins; the data has %d"
                     % (design, shortest, shortest - 1)):
    module.build(config, (shortest - 1, 4))


@pytest.mark.parametrize("standard_layers", [False, True])
def test_neuron_inverter_starts_from_pytorchs_default_initialisation(standard_layers):
  """Every kernel and bias is U(+-1/sqrt(fan_in)), as the reference's PyTorch layers start (issue 22)."""
  tf.random.set_seed(3)
  net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", design="ontra4"),
                                                      standard_layers=standard_layers)
  checked = 0
  for layer in net.layers:
    if not hasattr(layer, "kernel") or not hasattr(layer, "bias"):
      continue
    kernel, bias = layer.kernel.numpy(), layer.bias.numpy()
    bound = 1.0 / np.sqrt(np.prod(kernel.shape[:-1]))   # fan_in: kernel x input channels, or width
    for values in (kernel, bias):
      assert np.abs(values).max() <= bound * (1 + 1e-6)   # float32 rounding of the bound
      # uniform over [-bound, bound]: standard deviation bound / sqrt(3), not Glorot's, not zero
      assert abs(values.std() / (bound / np.sqrt(3)) - 1) < (0.1 if values.size > 1000 else 0.4), layer.name
    checked += 1
  assert checked == 9   # 3 conv blocks, 5 hidden dense layers, the output layer
