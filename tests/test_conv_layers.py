"""The fast Neuron-Inverter conv blocks compute the same function, gradients and weights as the standard
Keras layers, with every combination of the convolution options (which cpu_forms.py chooses from:
tests/test_cpu_forms.py)."""

import inspect
import itertools

import numpy as np
import pytest
import tensorflow as tf

import model
from model.neuron_inverter import conv_layers
from model.neuron_inverter.designs import CONV_OPTION_DEFAULTS
from run_config import RunConfig
from strategies import cpu
from training.loop import set_seeds

OPTIONS = [{"channel_multiple": multiple, "input_grad_by_forward_conv": by_forward}
           for multiple, by_forward in itertools.product((1, 8, 32), (False, True))] + [
               {"pooling": "maximum", "phases_max_in_channels": 8},  # the float32 choice
               {"pooling": "maximum", "channel_multiple": 32, "input_grad_by_forward_conv": True},
               {"pooling": "maximum", "phases_max_in_channels": 8, "kernel_grad_by_matmul": True},
               {"channel_multiple": 32, "input_grad_by_forward_conv": True, "kernel_grad_by_matmul": True},
               {"phases_max_in_channels": 1000}]  # every block by phases


def _option_id(options):
  return "-".join("%s=%s" % item for item in sorted(options.items()))


def _builder():
  return model.get_model_module("neuron_inverter").build


def _pair(design, **options):
  """The standard-layer network and the fast one with the same weights: seeded, because with some
  draws of the weights two conv outputs of a pool window come within rounding of each other, and the
  forms, which round differently, then route that window's gradient to different positions (both are
  valid gradients of the max; a draw that does this fails the comparison, seen once in a CI run)."""
  config = RunConfig(model="neuron_inverter", model_options={"design": design})
  set_seeds(0)
  standard = _builder()(config, standard_layers=True)
  fast = _builder()(config, **options)
  fast.set_weights(standard.get_weights())
  return standard, fast


def _batch(seed=0, samples=6):
  rng = np.random.default_rng(seed)
  return (tf.constant(rng.standard_normal((samples, 1600, 4)), tf.float32),
          tf.constant(rng.standard_normal((samples, 15)), tf.float32))


def _loss_and_gradients(net, x, y):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(net(x, training=False) - y))
  return float(loss), [g.numpy() for g in tape.gradient(loss, net.trainable_variables)]


@pytest.mark.parametrize("design", ["ontra4", "dev"])
@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
def test_fast_blocks_match_the_standard_layers_in_float32(design, options):
  standard, fast = _pair(design, **options)
  assert [(w.name, w.shape) for w in fast.weights] == [(w.name, w.shape) for w in standard.weights]
  x, y = _batch()
  loss, grads = _loss_and_gradients(standard, x, y)
  fast_loss, fast_grads = _loss_and_gradients(fast, x, y)
  assert fast_loss == pytest.approx(loss, rel=1e-6)
  for expected, got in zip(grads, fast_grads):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())


@pytest.mark.skipif(not cpu.bfloat16_kernels_available(), reason="this TensorFlow has no CPU bfloat16 kernels")
def test_fast_blocks_in_bfloat16_are_as_close_to_float32_as_the_standard_layers():
  """bfloat16 rounds each step differently in the two forms; neither may stray further from float32."""
  x, y = _batch(seed=1, samples=16)
  tf.random.set_seed(1)
  reference, _ = _pair("ontra4")
  _, exact = _loss_and_gradients(reference, x, y)
  tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
  standard, fast = _pair("ontra4", channel_multiple=32, input_grad_by_forward_conv=True)
  standard.set_weights(reference.get_weights())
  fast.set_weights(reference.get_weights())
  standard_loss, standard_grads = _loss_and_gradients(standard, x, y)
  fast_loss, fast_grads = _loss_and_gradients(fast, x, y)
  # Forward: adding the bias after the max (and padding with zeros) changes no rounding here.
  assert fast_loss == pytest.approx(standard_loss, rel=1e-3)
  def error(grads, truth):
    return np.linalg.norm(grads - truth) / np.linalg.norm(truth)

  flat = [np.concatenate([g.ravel() for g in grads]) for grads in (exact, standard_grads, fast_grads)]
  assert error(flat[2], flat[0]) <= 1.1 * error(flat[1], flat[0]) + 1e-3  # about 0.1 for both
  # Per weight the rounding noise is larger; a wrong conv gradient would be off by order one.
  for truth, old, new in zip(exact, standard_grads, fast_grads):
    assert error(new, truth) <= 2 * error(old, truth) + 0.02


@pytest.mark.parametrize("by_forward_conv, by_matmul", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("width, in_channels, out_channels, length", [(1, 3, 5, 9), (2, 4, 7, 16),
                                                                       (4, 30, 90, 40), (4, 5, 2, 4)])
def test_gradients_in_other_forms_equal_autodiff(width, in_channels, out_channels, length,
                                                 by_forward_conv, by_matmul):
  rng = np.random.default_rng(width)
  x = tf.constant(rng.standard_normal((3, length, in_channels)), tf.float32)
  kernel = tf.constant(rng.standard_normal((width, in_channels, out_channels)), tf.float32)
  upstream = tf.constant(rng.standard_normal((3, length - width + 1, out_channels)), tf.float32)

  def grads(conv):
    with tf.GradientTape() as tape:
      tape.watch([x, kernel])
      y = conv(x, kernel)
    return [y] + tape.gradient(y, [x, kernel], output_gradients=upstream)

  autodiff = grads(lambda a, b: tf.nn.conv1d(a, b, 1, "VALID"))
  custom = grads(conv_layers._conv1d_with_gradients(by_forward_conv, by_matmul))  # pylint: disable=protected-access
  for expected, got in zip(autodiff, custom):
    # float32 round-off relative to the largest entry: the sums run in another order (and oneDNN picks
    # other kernels with one intra-op thread, as an earlier in-process run may leave it: 4.2e-5 off
    # entries up to 67 here); a wrong gradient is off by about the entries themselves.
    scale = float(np.abs(expected.numpy()).max())
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("in_channels, by_matmul", [(4, False), (8, True)])
def test_the_kernel_gradient_is_a_matmul_only_where_the_im2col_is_wide_enough(in_channels, by_matmul):
  """With kernel_grad_by_matmul, a block whose im2col would have fewer than MATMUL_MIN_COLUMNS columns
  (the 4-probe first block: 4 x 4) keeps oneDNN's backward-filter kernel."""
  layer = conv_layers.PooledConv1D(8, 4, 4, in_channels, kernel_grad_by_matmul=True)
  assert 4 * in_channels >= conv_layers.MATMUL_MIN_COLUMNS or not by_matmul

  @tf.function
  def kernel_gradient(x):
    with tf.GradientTape() as tape:
      y = layer(x)
    return tape.gradient(y, layer.kernel)

  graph = kernel_gradient.get_concrete_function(tf.TensorSpec([2, 64, in_channels])).graph
  kinds = {op.type for op in graph.get_operations()}
  assert ("Conv2DBackpropFilter" not in kinds) == by_matmul, sorted(kinds)
  assert ("MatMul" in kinds) == by_matmul, sorted(kinds)


def test_padded_channels_are_zero_and_dropped_before_the_head():
  config = RunConfig(model="neuron_inverter", model_options={"design": "ontra4"})
  net = _builder()(config, channel_multiple=32)
  x, _ = _batch()
  widths = [net.get_layer("conv%d" % i).output_shape[-1] for i in (1, 2, 3)]
  assert widths == [32, 96, 192]  # 30, 90, 180 filters padded to multiples of 32
  outputs = tf.keras.Model(net.input, [net.get_layer("conv%d" % i).output for i in (1, 2, 3)])(x)
  for block, filters in zip(outputs, (30, 90, 180)):
    assert not np.any(block.numpy()[..., filters:])
    assert np.any(block.numpy()[..., :filters])
  assert net.get_layer("conv_channels").output_shape == (None, 24, 180)
  assert net.get_layer("flatten").output_shape == (None, 24 * 180)


def test_padding_is_only_for_channel_counts_near_a_multiple():
  assert [conv_layers.padded_channels(n, 32) for n in (30, 90, 180, 4, 16, 32, 100)] == [
      32, 96, 192, 4, 16, 32, 100]
  assert conv_layers.padded_channels(30, 1) == 30
  net = _builder()(RunConfig(model="neuron_inverter", model_options={"design": "dev"}), channel_multiple=32)
  assert [net.get_layer("conv%d" % i).output_shape[-1] for i in (1, 2, 3)] == [4, 16, 32]


def test_checkpoint_of_the_standard_layers_restores_into_the_fast_blocks(tmp_path):
  standard, _ = _pair("dev")
  path = tf.train.Checkpoint(model=standard).write(str(tmp_path / "ckpt"))
  fast = _builder()(RunConfig(model="neuron_inverter", model_options={"design": "dev"}), channel_multiple=32)
  tf.train.Checkpoint(model=fast).read(path).assert_existing_objects_matched()
  for expected, got in zip(standard.get_weights(), fast.get_weights()):
    np.testing.assert_array_equal(got, expected)


def test_a_builder_receives_only_the_options_it_declares():
  options = dict(CONV_OPTION_DEFAULTS, channel_multiple=32, input_grad_by_forward_conv=True)
  assert model.accepted_options(_builder(), **options) == options
  assert model.accepted_options(model.get_model_module("mnist").build, **options) == {}


@pytest.mark.parametrize("pooling,phases", [("maximum", 0), ("max_pool", 1000), ("maximum", 1000)])
def test_pooling_forms_send_the_gradient_to_the_first_maximum_on_ties(pooling, phases):
  """Flat stretches of a trace make the conv values of a window equal: each form must route the
  window's gradient once, to its first position, as MaxPoolGrad does (not once per tied position).
  Small integers keep every sum exact, so the ties are exact in every form."""
  rng = np.random.default_rng(3)
  flat = np.repeat(rng.integers(-3, 4, (2, 1600 // 40, 4)), 40, axis=1)  # constant for 40 bins
  x = tf.constant(flat, tf.float32)
  block = conv_layers.PooledConv1D(6, 4, 4, 4, pooling="phases" if phases else pooling)
  reference = conv_layers.PooledConv1D(6, 4, 4, 4)
  block.build(x.shape)
  reference.build(x.shape)
  block.set_weights([rng.integers(-3, 4, w.shape).astype(np.float32) for w in block.get_weights()])
  reference.set_weights(block.get_weights())
  results = []
  for layer in (reference, block):
    with tf.GradientTape() as tape:
      tape.watch(x)
      out = layer(x)
      loss = tf.reduce_sum(out * tf.range(1.0, 1.0 + out.shape[-1]))
    results.append((out.numpy(), [g.numpy() for g in tape.gradient(loss, [x] + layer.trainable_variables)]))
  (expected_out, expected_grads), (out, grads) = results
  np.testing.assert_array_equal(out, expected_out)
  for expected, got in zip(expected_grads, grads):
    np.testing.assert_array_equal(got, expected)


def test_the_plain_list_of_convolution_options_is_what_the_builder_takes():
  # tools/benchmark_forms.py checks --variant against model.neuron_inverter.designs.CONV_OPTION_DEFAULTS before
  # TensorFlow starts, so the list must name every option with the builder's default and its type
  # (0 == False, but not for --variant; every form of cpu_forms.py keeps the types: tests/test_cpu_forms.py).
  builder = inspect.signature(model.get_model_module("neuron_inverter").build).parameters
  defaults = {name: builder[name].default for name in CONV_OPTION_DEFAULTS}
  assert defaults == CONV_OPTION_DEFAULTS
  assert {name: type(value) for name, value in defaults.items()} == {
      name: type(value) for name, value in CONV_OPTION_DEFAULTS.items()}
