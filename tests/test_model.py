"""The model registry and the MNIST network."""

import numpy as np
import pytest
import tensorflow as tf

import model
import model.neuron_inverter.designs
from errors import UserError
from run_config import RunConfig
from tests.support.helpers import assert_names


def test_unknown_model_lists_valid_names():
  with pytest.raises(UserError) as caught:
    model.get_model_info("resnet")
  assert_names(caught.value, "'resnet'", "mnist", "neuron_inverter")


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
  net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", model_options={"design": design}))
  assert sum(int(np.prod(w.shape)) for w in net.trainable_weights) == trainable
  assert net.output_shape == (None, 15)


@pytest.mark.parametrize("statistics, layer_type, saved", [
    ("moving", "BatchNormalization", ["gamma", "beta", "moving_mean", "moving_variance"]),
    ("auto", "BatchNormalization", ["gamma", "beta", "moving_mean", "moving_variance"]),
    ("batch", "BatchStatisticsNormalization", ["gamma", "beta"])])
def test_neuron_inverter_batch_norm_keeps_moving_statistics_or_none(statistics, layer_type, saved):
  """The reference's GPU model keeps moving statistics; its IPU model (track_running_stats=False) none.
  The trainable weights are the same either way."""
  net = model.get_model_module("neuron_inverter").build(
      RunConfig(model="neuron_inverter", model_options={"batch_norm_statistics": statistics}))
  layer = net.get_layer("batch_norm")
  assert type(layer).__name__ == layer_type
  assert [w.name.split("/")[-1].split(":")[0] for w in layer.weights] == saved
  assert sum(int(np.prod(w.shape)) for w in net.trainable_weights) == 2988843


def test_batch_statistics_normalise_evaluation_as_training_and_as_keras_training_does():
  from model.normalization import BatchStatisticsNormalization  # pylint: disable=import-outside-toplevel
  x = tf.constant(np.random.default_rng(0).normal(3.0, 2.0, (48, 7)), tf.float32)
  ours, keras = BatchStatisticsNormalization(epsilon=1e-5), tf.keras.layers.BatchNormalization(epsilon=1e-5)
  ours.build(x.shape)
  keras.build(x.shape)
  for layer in (ours, keras):
    layer.gamma.assign(tf.linspace(0.5, 2.0, 7))
    layer.beta.assign(tf.linspace(-1.0, 1.0, 7))
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(x)
    expected = keras(x, training=True)
    trained, evaluated = ours(x, training=True), ours(x, training=False)
  np.testing.assert_allclose(trained, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(evaluated, trained)               # no moving statistics to switch to
  assert not np.allclose(keras(x, training=False), expected, atol=0.1)  # Keras' would
  for ours_grad, keras_grad in zip(tape.gradient(trained, [x, ours.gamma, ours.beta]),
                                   tape.gradient(expected, [x, keras.gamma, keras.beta])):
    np.testing.assert_allclose(ours_grad, keras_grad, rtol=1e-4, atol=1e-4)


def test_batch_statistics_are_float32_under_mixed_precision():
  from model.normalization import BatchStatisticsNormalization  # pylint: disable=import-outside-toplevel
  tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    layer = BatchStatisticsNormalization()
    x = tf.cast(tf.constant(np.random.default_rng(1).normal(1e3, 1e2, (32, 5)), tf.bfloat16), tf.float32)
    y = layer(x)
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")
  assert y.dtype == tf.bfloat16 and {w.dtype for w in layer.weights} == {tf.float32}
  # Sums of 32 values near 1e3 in bfloat16 (8 bits of mantissa) would be off by whole steps of 128.
  mean, variance = tf.nn.moments(x, axes=[0])
  np.testing.assert_allclose(tf.cast(y, tf.float32), (x - mean) / tf.sqrt(variance + 1e-5), atol=0.02)


@pytest.mark.parametrize("name, rate", [("neuron_inverter", 0.05), ("mnist", 0.3)])
def test_dropout_layers_take_the_configured_rate(name, rate):
  net = model.get_model_module(name).build(RunConfig(model=name, model_options={"design": "dev"}, dropout=rate))
  rates = [layer.rate for layer in net.layers if isinstance(layer, tf.keras.layers.Dropout)]
  assert rates and set(rates) == {rate}


def test_neuron_inverter_input_is_reshaped_not_transposed():
  """Conv "channel" c at position j must be the flat element c*1600 + j of the (1600, 4) sample."""
  net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", model_options={"design": "dev"}))
  to_conv = tf.keras.Model(net.input, net.get_layer("channels_last").output)
  sample = np.arange(1600 * 4, dtype=np.float32).reshape(1, 1600, 4)
  seen = to_conv(sample).numpy()[0]          # (positions 1600, channels 4), channels last
  for channel in range(4):
    np.testing.assert_array_equal(seen[:, channel], np.arange(channel * 1600, (channel + 1) * 1600))


@pytest.mark.parametrize("design", ["ontra4", "dev"])
def test_neuron_inverter_refuses_frames_too_short_for_its_conv_blocks(design):
  module = model.get_model_module("neuron_inverter")
  config = RunConfig(model="neuron_inverter", model_options={"design": design})
  shortest = module.min_time_bins(model.neuron_inverter.designs.DESIGNS[design])
  assert module.build(config, (shortest, 4)).get_layer("flatten").output_shape[1] > 0
  with pytest.raises(UserError) as caught:
    module.build(config, (shortest - 1, 4))
  assert_names(caught.value, "--design=%s" % design, "at least %d time bins" % shortest, "has %d" % (shortest - 1))


@pytest.mark.parametrize("standard_layers", [False, True])
def test_neuron_inverter_starts_from_pytorchs_default_initialisation(standard_layers):
  """Every kernel and bias is U(+-1/sqrt(fan_in)), as the reference's PyTorch layers start."""
  tf.random.set_seed(3)
  net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", model_options={"design": "ontra4"}),
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


def test_summary_note_explains_padded_conv_widths_and_only_those():
  module = model.get_model_module("neuron_inverter")
  config = RunConfig(model="neuron_inverter")
  note = module.summary_note(module.build(config, channel_multiple=32))
  assert note.startswith("conv1, conv2, conv3: ")
  assert_names(note, "32 / 96 / 192 channels", "30 / 90 / 180 filters", "multiples of 32")
  assert module.summary_note(module.build(config)) is None
  assert module.summary_note(module.build(config, standard_layers=True)) is None
