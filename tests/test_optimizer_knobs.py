"""--weight_decay and --clip_norm on real Keras optimizers (training/optimizers.py): PyTorch's decoupled weight
decay before each update, and the global gradient norm clipped after the replicas' sum, on CPU replicas, under
mixed precision and on the IPU backend's optimizers; and a short training run with both."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf
import yaml
from absl import flags as absl_flags
from absl.testing import flagsaver

import flags
from errors import UserError
from run_config import RunConfig
from strategies import cpu
from strategies import ipu as ipu_backend
from tests.support import fake_ipu
from tests.support.cellspike_files import write_contiguous_folder
from tests.support.helpers import REPO_ROOT, run_main
from training import optimizers

# The rate of each step: 0.1 for the first two, then 0.02 (a schedule of the update count).
RATES = tf.keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.02])
NEW_FAMILY = hasattr(tf.keras.optimizers, "legacy")  # TensorFlow >= 2.11


def _weights_and_gradients(steps=3):
  rng = np.random.default_rng(0)
  start = rng.normal(size=6).astype(np.float32)
  return start, [rng.normal(size=6).astype(np.float32) for _ in range(steps)]


def _stepped(optimizer, start, gradients, before_step=lambda step, weight: None):
  """The weight after each of the steps of `optimizer` with `gradients`, from `start`."""
  weight, out = tf.Variable(start), []
  for step, gradient in enumerate(gradients):
    before_step(step, weight)
    optimizer.apply_gradients([(tf.constant(gradient), weight)])
    out.append(weight.numpy().copy())
  return out


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_each_step_decays_the_weights_by_the_steps_rate_then_makes_the_optimizers_update(name):
  """p <- p * (1 - lr_t * weight_decay), lr_t the schedule's rate at that step, then the optimizer's own
  update: the bits of the plain optimizer stepping from the decayed weights."""
  start, gradients = _weights_and_gradients()
  decay = 0.3
  decayed = _stepped(optimizers.make_optimizer(name, RATES, weight_decay=decay), start, gradients)

  def decay_first(step, weight):  # in float32, as PyTorch's param.mul_(1 - lr * weight_decay)
    factor = np.float32(1) - np.float32(RATES(step).numpy()) * np.float32(decay)
    weight.assign(weight.numpy() * factor)

  def plain():
    return optimizers.make_optimizer(name, RATES, checkpoint_format=optimizers.LEGACY)

  for got, expected in zip(decayed, _stepped(plain(), start, gradients, decay_first)):
    np.testing.assert_array_equal(got, expected)
  assert not np.array_equal(decayed[-1], _stepped(plain(), start, gradients)[-1])


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_without_decay_or_clip_each_name_builds_the_optimizer_it_built_before(name):
  """Bit for bit: Keras' SGD (the TF >= 2.11 family there), and the legacy Adam with PyTorch's epsilon."""
  built = optimizers.make_optimizer(name, 0.05, weight_decay=0.0, clip_norm=0.0)
  if name == "sgd":
    before = tf.keras.optimizers.SGD(learning_rate=0.05)
  else:
    before = optimizers._torch_adam_class()(learning_rate=0.05, epsilon=1e-8)  # pylint: disable=protected-access
  assert type(built) is type(before)
  start, gradients = _weights_and_gradients()
  for got, expected in zip(_stepped(built, start, gradients), _stepped(before, start, gradients)):
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_decay_and_clip_keep_the_plain_optimizers_checkpoint(tmp_path, name):
  """The same variables under the same keys: a run resumed with or without them restores the state whole."""
  def saved(optimizer, folder):
    weight = tf.Variable(np.ones(3, np.float32))
    optimizer.apply_gradients([(tf.ones(3), weight)])
    return tf.train.Checkpoint(weight=weight, optimizer=optimizer).save(str(tmp_path / folder / "ckpt"))

  def keys(path):
    return sorted(key for key, _ in tf.train.list_variables(path))

  knobs = saved(optimizers.make_optimizer(name, 0.1, weight_decay=0.1, clip_norm=1.0), "knobs")
  plain = saved(optimizers.make_optimizer(name, 0.1, checkpoint_format=optimizers.LEGACY), "plain")
  assert keys(knobs) == keys(plain)
  assert optimizers.optimizer_format(optimizers.make_optimizer(name, 0.1, weight_decay=0.1)) == optimizers.LEGACY


def test_the_clip_scales_the_global_norm_down_to_it_and_leaves_smaller_gradients_alone():
  """Over all weights together, with Keras' global_clipnorm arithmetic (which Keras refuses on the CPU
  replicas' CentralStorageStrategy and beside gradient_transformers)."""
  def step(optimizer, gradients):
    weights = [tf.Variable(np.zeros(2, np.float32)), tf.Variable(np.zeros(1, np.float32))]
    optimizer.apply_gradients(zip([tf.constant(g, tf.float32) for g in gradients], weights))
    return [w.numpy() for w in weights]

  large, small = ([3.0, 0.0], [4.0]), ([0.3, 0.0], [0.4])  # global norms 5 and 0.5
  clipped = step(optimizers.make_optimizer("sgd", 1.0, clip_norm=1.0), large)
  np.testing.assert_allclose(np.concatenate(clipped), [-0.6, 0.0, -0.8], rtol=1e-6)
  keras_sgd = optimizers._LEGACY_CLASSES["sgd"]()  # pylint: disable=protected-access
  keras_clip = step(keras_sgd(1.0, global_clipnorm=1.0), large)
  for ours, keras in zip(clipped, keras_clip):
    np.testing.assert_array_equal(ours, keras)
  for ours, given in zip(step(optimizers.make_optimizer("sgd", 1.0, clip_norm=1.0), small), small):
    np.testing.assert_array_equal(ours, -np.float32(given))


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_sparse_gradient_decays_the_whole_weight_and_is_clipped_as_a_dense_one(name):
  """An embedding's gradient (IndexedSlices) steps as its dense form does."""
  start = np.arange(1.0, 9.0, dtype=np.float32).reshape(4, 2)
  sparse = tf.IndexedSlices(tf.constant([[6.0, 0.0], [0.0, 4.0]]), tf.constant([1, 3]), tf.constant([4, 2]))
  weights = []
  for gradient in (sparse, tf.convert_to_tensor(sparse)):
    weight = tf.Variable(start)
    optimizers.make_optimizer(name, 0.1, weight_decay=0.5, clip_norm=1.0).apply_gradients([(gradient, weight)])
    weights.append(weight.numpy())
  np.testing.assert_allclose(weights[0], weights[1], rtol=1e-6)
  np.testing.assert_allclose(weights[0][0], start[0] * 0.95, rtol=1e-6)  # no gradient: the decay alone


def _one_step(backend, clip_norm, x, y):
  """The weights of a small model after one SGD step on (x, y), one global batch, on `backend`."""
  with backend.strategy.scope():
    inputs = tf.keras.Input((3,))
    hidden = tf.keras.layers.Dense(5, activation="tanh", kernel_initializer=tf.keras.initializers.GlorotUniform(3))(
        inputs)
    net = tf.keras.Model(inputs, tf.keras.layers.Dense(2, kernel_initializer=tf.keras.initializers.GlorotUniform(4))(
        hidden))
    net = backend.prepare_model(net)
    net.compile(optimizer=optimizers.make_optimizer("sgd", 0.5, clip_norm=clip_norm), loss="mse")
  before = net.get_weights()
  data, steps = backend.fit_input(tf.data.Dataset.from_tensors((x, y)), 1)
  net.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
  return before, net.get_weights()


def _cpu(replicas, accumulation=1):
  return cpu.create(RunConfig(model="mnist", backend="cpu", precision="32.32", replicas=replicas,
                              gradient_accumulation=accumulation))


def test_the_clip_acts_on_the_whole_batchs_gradient_the_same_for_one_and_two_replicas():
  """Two CPU replicas (CentralStorageStrategy; MirroredStrategy with the accumulating step) clip the
  norm of the summed gradient of the global batch of 8: the step of one replica, of norm lr x clip."""
  rng = np.random.default_rng(5)
  x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)
  before, one = _one_step(_cpu(1), 0.01, x, y)
  update = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(one, before)))
  np.testing.assert_allclose(update, 0.5 * 0.01, rtol=1e-3)  # the weights' rounding, about 1e-4 of it
  for backend in (_cpu(2), _cpu(2, accumulation=2)):
    _, replicated = _one_step(backend, 0.01, x, y)
    for a, b in zip(replicated, one):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  _, unclipped = _one_step(_cpu(1), 0.0, x, y)
  assert not np.allclose(unclipped[0], one[0], rtol=1e-3)


def test_under_mixed_float16_the_loss_scaled_optimizer_decays_and_clips_the_float32_weights():
  """The LossScaleOptimizer hands the inner optimizer unscaled float32 gradients: the clip bounds those,
  not the scaled ones, and the decay multiplies the float32 weights."""
  tf.keras.mixed_precision.set_global_policy("mixed_float16")
  rng = np.random.default_rng(6)
  x, y = rng.normal(size=(8, 3)).astype(np.float32) * 0.1, rng.normal(size=(8, 2)).astype(np.float32) * 0.1
  inputs = tf.keras.Input((3,))
  hidden = tf.keras.layers.Dense(5, activation="tanh")(inputs)
  net = tf.keras.Model(inputs, tf.keras.layers.Dense(2, dtype="float32")(hidden))
  net.compile(optimizer=optimizers.make_optimizer("sgd", 0.5, weight_decay=0.2, clip_norm=1e-3), loss="mse")
  assert isinstance(net.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
  before = net.get_weights()
  net.fit(x, y, batch_size=8, epochs=1, verbose=0)
  after = net.get_weights()
  assert all(w.dtype == np.float32 for w in after)
  update = np.sqrt(sum(np.sum((a - b * np.float32(0.9)) ** 2) for a, b in zip(after, before)))
  np.testing.assert_allclose(update, 0.5 * 1e-3, rtol=1e-2)  # the scaled gradients' clip: 2^-15 of it


class _SGDIpuOptimizer(optimizers._LEGACY_CLASSES["sgd"]()):  # pylint: disable=protected-access
  """ipu_tensorflow_addons' SGDIpuOptimizer (keras/optimizers/sgd_optimizer.py, r2.6/sdk-release-3.4): a
  subclass of Keras' SGD taking momentum_accum_dtype; without momentum, Keras' own update."""

  def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD", momentum_accum_dtype=None,
               **kwargs):
    del momentum_accum_dtype
    super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, name=name, **kwargs)


def test_on_ipus_the_clip_sees_the_gradient_averaged_over_the_replicas(monkeypatch):
  """IPUStrategy sums the replicas' gradients and the backend's gradient transformer divides by their
  count; the clip comes after it (Keras' own would come before), and the decay extends the IPU optimizer:
  the step of the CPU optimizer given one replica's gradient."""
  fake_ipu.install(monkeypatch)
  for name, module in fake_ipu.build_addons().items():
    monkeypatch.setitem(sys.modules, name, module)
  monkeypatch.setattr(sys.modules["ipu_tensorflow_addons.keras.optimizers"], "SGDIpuOptimizer", _SGDIpuOptimizer)
  backend = ipu_backend.create(RunConfig(model="neuron_inverter", backend="ipu", model_options={"design": "dev"}, seed=7, replicas=2,
                                         precision="16.16"))
  ipu_sgd = optimizers.make_optimizer("sgd", 0.5, backend.optimizer_factories(), weight_decay=0.2, clip_norm=1.0,
                                      **backend.optimizer_kwargs())
  assert isinstance(ipu_sgd, _SGDIpuOptimizer)
  start, gradients = _weights_and_gradients(steps=2)
  summed = [2 * g for g in gradients]  # two replicas' equal gradients, summed
  expected = _stepped(optimizers.make_optimizer("sgd", 0.5, weight_decay=0.2, clip_norm=1.0), start, gradients)
  for got, want in zip(_stepped(ipu_sgd, start, summed), expected):
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.skipif(not NEW_FAMILY, reason="TensorFlow < 2.11 has one optimizer family")
def test_a_run_checkpointed_with_keras_adamw_resumes_with_it_and_its_own_decay_and_clip():
  resumed = optimizers.make_optimizer("adamw", 1e-3, checkpoint_format=optimizers.KERAS_2_11, weight_decay=0.05,
                                      clip_norm=2.0)
  assert isinstance(resumed, tf.keras.optimizers.AdamW)
  assert (resumed.weight_decay, resumed.global_clipnorm) == (0.05, 2.0)
  assert optimizers.optimizer_format(resumed) == optimizers.KERAS_2_11


@pytest.mark.skipif(NEW_FAMILY, reason="TensorFlow >= 2.11 builds Keras' own AdamW")
def test_a_checkpoint_of_tensorflow_2_11_optimizers_is_refused_on_older_tensorflow():
  with pytest.raises(UserError, match="--resume"):
    optimizers.make_optimizer("adamw", 1e-3, checkpoint_format=optimizers.KERAS_2_11, weight_decay=0.01)


def test_the_ipu_reference_flagfile_gives_adamw_with_pytorchs_decay():
  flags.define_flags()  # idempotent
  with flagsaver.flagsaver():
    absl_flags.FLAGS.unparse_flags()
    absl_flags.FLAGS(["main.py", "--flagfile=" + os.path.join(REPO_ROOT, "configs",
                                                             "neuron_inverter_reference_ipu.flags")])
    config = flags.to_config(absl_flags.FLAGS)
  assert (config.optimizer, config.weight_decay, config.clip_norm, config.backend) == ("adamw", 0.01, 0.0, "ipu")
  assert (config.batch_size, config.epochs, config.learning_rate, config.replicas) == (192, 161, 1e-3, 4)


def test_a_run_trains_with_adamw_decay_and_clip_on_two_replicas(tmp_path):
  data = write_contiguous_folder(str(tmp_path))
  logdir = str(tmp_path / "run")
  result = run_main("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--precision=32.32",
                    "--replicas=2", "--batch_size=8", "--epochs=1", "--steps_per_epoch=2", "--eval_steps=1",
                    "--warmup_epochs=0", "--optimizer=adamw", "--weight_decay=0.05", "--clip_norm=1",
                    "--data_path=" + data, "--logdir=" + logdir)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(logdir, "run_config.yaml")) as f:
    saved = yaml.safe_load(f)
  assert (saved["optimizer"], saved["weight_decay"], saved["clip_norm"]) == ("adamw", 0.05, 1.0)
