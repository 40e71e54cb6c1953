"""Backend selection: CPU replicas as logical devices, clear errors for missing GPUs and IPU software."""

import os

import pytest
import tensorflow as tf

from errors import UserError
from run_config import RunConfig
from strategies import environment, ipu, select


def test_auto_picks_cpu_here():
  if tf.config.list_physical_devices("GPU"):
    pytest.skip("this machine has a GPU")
  assert select.resolve_kind("auto") == "cpu"


def test_one_cpu_replica_uses_one_device_strategy():
  backend = select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=1))
  assert isinstance(backend.strategy, tf.distribute.OneDeviceStrategy)
  assert backend.replicas == 1 and backend.label == "CPU"


def test_two_cpu_replicas_use_mirrored_strategy_over_logical_devices():
  backend = select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=2))
  assert isinstance(backend.strategy, tf.distribute.MirroredStrategy)
  assert backend.replicas == 2 and len(set(backend.devices)) == 2
  # The replicas really compute separately: each sees its own replica id.
  ids = backend.strategy.run(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group)
  assert sorted(int(t) for t in backend.strategy.experimental_local_results(ids)) == [0, 1]


def test_too_many_cpu_replicas_after_start_is_a_clear_error():
  with pytest.raises(UserError, match="--replicas=8 needs 8 logical CPU devices"):
    select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=8))


def test_gpu_replicas_need_visible_gpus():
  visible = len(tf.config.list_physical_devices("GPU"))
  with pytest.raises(UserError, match="--replicas=%d needs %d GPUs but TensorFlow sees %d"
                     % (visible + 1, visible + 1, visible)):
    select.select_backend(RunConfig(model="mnist", backend="gpu", replicas=visible + 1))


def test_ipu_without_graphcore_tensorflow_says_what_to_install():
  assert not ipu.graphcore_tensorflow_available()
  with pytest.raises(UserError, match="--backend=ipu: Graphcore's TensorFlow is not installed.*pip install"):
    select.select_backend(RunConfig(model="mnist", backend="ipu"))


def test_keras_is_version_2():
  assert select.keras_version().startswith("2.")
  assert os.environ["TF_USE_LEGACY_KERAS"] == "1"


def test_environment_refuses_to_run_after_tensorflow_import():
  with pytest.raises(RuntimeError, match="before TensorFlow is imported"):
    environment.prepare(RunConfig(model="mnist"))


@pytest.mark.parametrize("precision, kind, policy", [
    ("32.32", "cpu", "float32"), ("16.32", "cpu", "mixed_bfloat16"), ("16.16", "cpu", "bfloat16"),
    ("16.32", "gpu", "mixed_float16"), ("16.32", "ipu", "mixed_float16"), ("16.16", "ipu", "float16"),
])
def test_precision_maps_to_keras_policies(precision, kind, policy):
  try:
    assert select.set_precision(precision, kind) == policy
    assert tf.keras.mixed_precision.global_policy().name == policy
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")


def test_mixed_precision_model_keeps_float32_outputs():
  import model  # pylint: disable=import-outside-toplevel
  try:
    select.set_precision("16.32", "cpu")
    net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", design="dev"))
    assert net.get_layer("conv1").compute_dtype == "bfloat16"
    assert net.get_layer("conv1").dtype == "float32"            # weights stay float32
    assert net.output.dtype == tf.float32
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")
