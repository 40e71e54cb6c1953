"""The same mathematics on every backend: a model trained on the IPU path (through the stand-in, which
computes what the IPUs compute: tests/support/fake_ipu.py `_Replicas`) and on the CPU path, with the
same replicas, gradient accumulation, data, seed and initial weights, ends with the same weights."""

import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf

from data.splits import Arrays, Splits, split_from_arrays
from run_config import RunConfig
from strategies import cpu
from strategies import ipu as ipu_backend
from tests.support import fake_ipu
from training import loop, optimizers


def _build(config, input_shape, num_outputs):
  """A small functional model that splits into pipeline stages at "flatten" and "hidden"."""
  del config
  inputs = tf.keras.Input(input_shape)
  x = tf.keras.layers.Dense(8, activation="tanh", name="dense")(inputs)
  x = tf.keras.layers.Flatten(name="flatten")(x)
  x = tf.keras.layers.Dense(4, activation="tanh", name="hidden")(x)
  return tf.keras.Model(inputs, tf.keras.layers.Dense(num_outputs, name="head")(x))


SMALL_MODEL = types.SimpleNamespace(build=_build, STAGE_BOUNDARIES=("flatten", "hidden"),
                                    loss=tf.keras.losses.MeanSquaredError,
                                    metrics=lambda: [tf.keras.metrics.MeanAbsoluteError(name="mae")])


def _arrays(samples=256, seed=3):
  rng = np.random.RandomState(seed)
  x = rng.randn(samples, 3).astype(np.float32)
  y = (x @ np.array([[1.5], [-2.0], [0.5]], np.float32) + 0.1 * rng.randn(samples, 1)).astype(np.float32)
  return Arrays(x, y)


def _splits(backend, batch_size, seed):
  """The training split as data/splits.py lays it out for `backend` (shuffled by the seed alone)."""
  train = split_from_arrays(_arrays(), backend.layout(batch_size), lambda x, y: (x, y), True, seed, 0, "train")
  return Splits(train=train, validation=None, test=None, source="small", input_shape=(3,), num_outputs=1)


def _train(config, backend, initial=None):
  """The application's own build (loop.build_and_compile) and fit (loop._fit); the trained weights, and
  the initial ones."""
  splits = _splits(backend, config.batch_size, config.seed)
  net = loop.build_and_compile(config, backend, SMALL_MODEL, splits)
  if initial is not None:
    net.set_weights(initial)
  start = net.get_weights()
  loop._fit(net, config, backend, splits, 0, 0, callbacks=[])  # pylint: disable=protected-access
  return net.get_weights(), start, int(net.optimizer.iterations.numpy())


@pytest.fixture(name="sdk_sgd")
def _sdk_sgd(monkeypatch):
  """--optimizer=sgd as on the SDK's TensorFlow 2.6: Keras' OptimizerV2 SGD, which takes the IPU
  backend's gradient_transformers (TensorFlow 2.11 and later keep that class as `legacy`). SGD's
  update is proportional to the gradient, so a gradient R times too large shows (Adam's would not)."""
  monkeypatch.setitem(optimizers.OPTIMIZERS, "sgd", getattr(tf.keras.optimizers, "legacy", tf.keras.optimizers).SGD)


def _config(**kwargs):
  base = dict(model="mnist", seed=5, batch_size=4, epochs=2, optimizer="sgd", learning_rate=0.05,
              lr_schedule="cosine", precision="32.32", replicas=2)
  base.update(kwargs)
  return RunConfig(**base)


def _cpu_and_ipu(monkeypatch, ipu_kwargs, accumulation, transform_backend=lambda backend: backend):
  """(CPU weights, IPU weights, CPU updates, IPU updates), trained from the same initial weights."""
  cpu_backend = cpu.create(_config(backend="cpu", gradient_accumulation=accumulation))
  cpu_weights, initial, cpu_updates = _train(_config(backend="cpu", gradient_accumulation=accumulation),
                                             cpu_backend)
  fake_ipu.install(monkeypatch)
  ipu_config = _config(backend="ipu", gradient_accumulation=accumulation, **ipu_kwargs)
  backend = transform_backend(ipu_backend.create(ipu_config))
  ipu_weights, ipu_initial, ipu_updates = _train(ipu_config, backend, initial)
  assert all((a == b).all() for a, b in zip(initial, ipu_initial))
  assert all(not np.allclose(a, b) for a, b in zip(initial, cpu_weights))   # it trained
  return cpu_weights, ipu_weights, cpu_updates, ipu_updates


def _assert_same(cpu_weights, ipu_weights):
  for a, b in zip(cpu_weights, ipu_weights):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("sdk_sgd")
def test_two_replicas_accumulating_two_micro_batches_train_alike_on_the_cpu_and_the_ipu(monkeypatch):
  """R = 2, G = 2: 256 samples in global batches of 16, 16 updates an epoch of a cosine rate; on the IPU 32
  micro-batch steps per replica, the replicas' gradients summed (ipu_strategy.py), averaged over G
  (GradientAccumulationOptimizerV2, MEAN) and divided by R (the backend's gradient transformer)."""
  cpu_weights, ipu_weights, cpu_updates, ipu_updates = _cpu_and_ipu(monkeypatch, {}, 2)
  assert cpu_updates == ipu_updates == 32
  _assert_same(cpu_weights, ipu_weights)


@pytest.mark.usefixtures("sdk_sgd")
def test_two_pipeline_stages_train_alike_on_the_cpu_and_the_ipu(monkeypatch):
  """The same with the model in 2 pipeline stages on 2 IPUs per replica (Grouped: G a multiple of 4);
  the CPU runs the model whole with the same accumulation."""
  cpu_weights, ipu_weights, cpu_updates, ipu_updates = _cpu_and_ipu(
      monkeypatch, {"ipus_per_replica": 2, "pipeline_stages": 2}, 4)
  assert cpu_updates == ipu_updates == 16
  _assert_same(cpu_weights, ipu_weights)


@pytest.mark.usefixtures("sdk_sgd")
def test_without_the_backends_average_the_ipu_would_train_otherwise(monkeypatch):
  """The comparison above can fail: without the 1/R gradient transformer, IPUStrategy's summed
  gradients make every SGD step R times too long."""
  cpu_weights, ipu_weights, _, _ = _cpu_and_ipu(
      monkeypatch, {}, 2, lambda backend: dataclasses.replace(backend, sums_replica_gradients=False))
  assert any(not np.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(cpu_weights, ipu_weights))
