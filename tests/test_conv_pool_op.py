"""The compiled first-block op (model/neuron_inverter/kernels/conv_pool1d.cc): built here with this TensorFlow, it
computes the standard block's outputs and weight gradients, with the same ties, for any thread count;
the model builder gives it to the first block only; a build that cannot happen is said and survived."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import model
from model.neuron_inverter import conv_layers, conv_pool_op, cpu_forms, kernel_build
from model.neuron_inverter.designs import CONV_OPTION_DEFAULTS
from run_config import KERNEL_CACHE, RunConfig
from strategies import precision as precision_lib
from strategies.backend import Hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def library():
  path = kernel_build.conv_pool_library(KERNEL_CACHE)  # where runs keep it: built once per TensorFlow
  assert path and os.path.exists(path)
  return path


def _blocks(library, filters=30, kernel=4, pool=4, in_channels=4, shape=(6, 1600, 4), weights=None):
  """The standard-form block and the op's, with the same weights."""
  standard = conv_layers.PooledConv1D(filters, kernel, pool, in_channels)
  fused = conv_layers.PooledConv1D(filters, kernel, pool, in_channels, library=library)
  for block in (standard, fused):
    block.build(shape)
  if weights is not None:
    standard.set_weights(weights)
  fused.set_weights(standard.get_weights())
  return standard, fused


def _outputs_and_gradients(block, x, upstream):
  with tf.GradientTape() as tape:
    out = block(x)
  return [out.numpy()] + [g.numpy() for g in tape.gradient(out, block.trainable_variables,
                                                           output_gradients=upstream)]


@pytest.mark.parametrize("filters, kernel, pool, in_channels", [(30, 4, 4, 4), (7, 2, 3, 4), (64, 8, 2, 1)])
def test_the_op_matches_the_standard_block(library, filters, kernel, pool, in_channels):
  rng = np.random.default_rng(filters)
  x = tf.constant(rng.standard_normal((5, 203, in_channels)), tf.float32)
  standard, fused = _blocks(library, filters, kernel, pool, in_channels, x.shape)
  upstream = tf.constant(rng.standard_normal(standard(x).shape), tf.float32)
  expected = _outputs_and_gradients(standard, x, upstream)
  got = _outputs_and_gradients(fused, x, upstream)
  assert got[0].shape == expected[0].shape
  assert (got[0] > 0).mean() > 0.3  # the ReLU passes part of the gradient, and stops the rest
  for want, have in zip(expected, got):
    # float32 round-off: the 16 multiply-adds of a conv value and the batch sums run in another order.
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_ties_send_the_gradient_to_the_first_maximum(library):
  """Flat stretches of a trace make a window's conv values equal; small integers keep every sum exact,
  so the op must agree with MaxPoolGrad bit for bit."""
  rng = np.random.default_rng(3)
  x = tf.constant(np.repeat(rng.integers(-3, 4, (2, 1600 // 40, 4)), 40, axis=1), tf.float32)
  weights = [rng.integers(-3, 4, (4, 4, 30)).astype(np.float32), rng.integers(-3, 4, 30).astype(np.float32)]
  standard, fused = _blocks(library, shape=x.shape, weights=weights)
  upstream = tf.range(1.0, 31.0) * tf.ones(standard(x).shape)
  for want, have in zip(_outputs_and_gradients(standard, x, upstream), _outputs_and_gradients(fused, x, upstream)):
    np.testing.assert_array_equal(have, want)


_OTHER_THREADS = """
import sys
import numpy as np
import tensorflow as tf
from model.neuron_inverter import conv_pool_op
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[4]))
data = np.load(sys.argv[2])
with tf.GradientTape() as tape:
  kernel, bias = tf.constant(data["kernel"]), tf.constant(data["bias"])
  tape.watch([kernel, bias])
  out = conv_pool_op.conv_pool1d(tf.constant(data["x"]), kernel, bias, 4, sys.argv[1])
grads = tape.gradient(out, [kernel, bias], output_gradients=tf.constant(data["upstream"]))
np.savez(sys.argv[3], out=out.numpy(), kernel=grads[0].numpy(), bias=grads[1].numpy())
"""


def test_results_do_not_depend_on_the_thread_count(library, tmp_path):
  """The batch sums run in fixed work units, added in order: one thread and two give the same bits
  (weights_sha256 stays a function of the seed)."""
  rng = np.random.default_rng(5)
  data = {"x": rng.standard_normal((48, 1600, 4)).astype(np.float32),
          "kernel": rng.standard_normal((4, 4, 30)).astype(np.float32),
          "bias": rng.standard_normal(30).astype(np.float32),
          "upstream": rng.standard_normal((48, 399, 30)).astype(np.float32)}
  np.savez(tmp_path / "in.npz", **data)
  # A thread count other than this process's (an earlier test may have left it at one).
  threads = 2 if tf.config.threading.get_intra_op_parallelism_threads() == 1 else 1
  subprocess.run([sys.executable, "-c", _OTHER_THREADS, library, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"),
                  str(threads)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  kernel, bias = tf.constant(data["kernel"]), tf.constant(data["bias"])
  with tf.GradientTape() as tape:
    tape.watch([kernel, bias])
    out = conv_pool_op.conv_pool1d(tf.constant(data["x"]), kernel, bias, 4, library)
  grads = tape.gradient(out, [kernel, bias], output_gradients=tf.constant(data["upstream"]))
  alone = np.load(tmp_path / "out.npz")
  for name, here in zip(("out", "kernel", "bias"), [out] + grads):
    np.testing.assert_array_equal(here.numpy(), alone[name], err_msg=name)


def test_the_model_builder_gives_the_op_to_the_first_block_only(library):
  build = model.get_model_module("neuron_inverter").build
  config = RunConfig(model="neuron_inverter", model_options={"design": "ontra4"})
  standard = build(config, standard_layers=True)
  fused = build(config, first_block_library=library, pooling="maximum", phases_max_in_channels=8)
  fused.set_weights(standard.get_weights())
  blocks = [layer for layer in fused.layers if isinstance(layer, conv_layers.PooledConv1D)]
  assert [bool(block.library) for block in blocks] == [True, False, False]
  rng = np.random.default_rng(0)
  x = tf.constant(rng.standard_normal((4, 1600, 4)), tf.float32)
  y = tf.constant(rng.standard_normal((4, 15)), tf.float32)
  results = []
  for net in (standard, fused):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(net(x, training=False) - y))
    results.append((float(loss), tape.gradient(loss, net.trainable_variables)))
  (loss, grads), (fused_loss, fused_grads) = results
  assert fused_loss == pytest.approx(loss, rel=1e-6)
  for expected, got in zip(grads, fused_grads):
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=1e-6 * np.abs(expected.numpy()).max())


def test_blocks_of_other_sizes_keep_tensorflows_ops(library):
  # A gradient window of 12 values (width 3 x 4 probes) is not a whole number of the op's vectors.
  for sizes, expected in (((4, 4, 30, 4), True), ((3, 4, 30, 4), False), ((4, 4, 65, 4), False)):
    width, in_channels, filters, pool = sizes
    block = conv_layers.PooledConv1D(filters, width, pool, in_channels, library=library)
    block.build((2, 64, in_channels))
    assert block._by_library == expected, sizes  # pylint: disable=protected-access
    assert block(tf.ones((2, 64, in_channels))).shape == (2, (64 - width + 1) // pool, filters)


def test_the_op_refuses_shapes_it_does_not_compute(library):
  ops = conv_pool_op.load(library)
  with pytest.raises(tf.errors.InvalidArgumentError, match="64 output channels"):
    ops.conv_pool1d(tf.zeros((1, 40, 4)), tf.zeros((4, 4, 65)), tf.zeros(65), pool=4)
  with pytest.raises(tf.errors.InvalidArgumentError, match="one pool window"):
    ops.conv_pool1d(tf.zeros((1, 5, 4)), tf.zeros((4, 4, 8)), tf.zeros(8), pool=4)


def _cpu(precision, features):
  return Hardware("cpu", precision_lib.parse(precision), frozenset(features), ("AuthenticAMD", 25))


def test_the_model_asks_for_the_op_in_float32_with_avx2_and_fma_only():
  assert cpu_forms.fuses_first_block(_cpu("32.32", {"avx2", "fma", "sse4_2"}))
  assert not cpu_forms.fuses_first_block(_cpu("16.32", {"avx2", "fma", "amx_bf16"}))
  assert not cpu_forms.fuses_first_block(_cpu("32.32", {"sse4_2", "avx"}))


def test_only_a_model_that_takes_the_op_has_it_compiled(library, monkeypatch):
  built = []
  monkeypatch.setattr(kernel_build, "conv_pool_library", lambda cache: built.append(cache) or library)
  hardware = _cpu("32.32", {"avx", "avx2", "fma"})
  assert model.layer_forms(model.get_model_module("mnist"), hardware) == ({},) and not built
  forms = model.layer_forms(model.get_model_module("neuron_inverter"), hardware)
  assert forms[0]["first_block_library"] == library and built == [KERNEL_CACHE]
  # Off CPUs the builder's defaults, without the op.
  assert model.layer_forms(model.get_model_module("neuron_inverter"),
                           Hardware("gpu", precision_lib.FLOAT32)) == (CONV_OPTION_DEFAULTS,)
  assert built == [KERNEL_CACHE]


def test_without_a_compiler_the_run_says_so_and_uses_tensorflows_ops(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv("PATH", str(tmp_path))
  monkeypatch.delenv("CXX", raising=False)
  assert kernel_build.conv_pool_library(str(tmp_path / "kernels")) == ""
  assert "No C++ compiler" in caplog.text and "TensorFlow's ops" in caplog.text


def test_a_failed_build_is_reported_with_the_compilers_error(monkeypatch, tmp_path, caplog):
  broken = tmp_path / "broken.cc"
  broken.write_text("int main() { return undefined_name; }\n")
  monkeypatch.setattr(kernel_build, "SOURCE", str(broken))
  assert kernel_build.conv_pool_library(str(tmp_path / "kernels")) == ""
  assert "Could not build or load" in caplog.text and "undefined_name" in caplog.text
  assert not [name for _, _, names in os.walk(tmp_path / "kernels") for name in names if name.endswith(".so")]
