"""The IPU path, checked against Graphcore's documented API through the recording stand-in."""

import dataclasses
import json
import logging as python_logging
import os
import subprocess
import sys
import types

import pytest
import tensorflow as tf

import model
from data.splits import Arrays, Splits, count_steps, dividing_batch, eval_layout, split_from_arrays
from errors import UserError
from run_config import RunConfig
from strategies import ipu as ipu_backend
from tests.support import fake_ipu
from tests.support.helpers import REPO_ROOT, assert_names, train_in_process


def _config(**kwargs):
  options = dict({"design": "dev"}, **kwargs.pop("model_options", {}))
  base = dict(model="neuron_inverter", backend="ipu", model_options=options, seed=7)
  base.update(kwargs)
  return RunConfig(**base)


def _calls(name):
  return [call for call in fake_ipu.CALLS if call[0] == name]


def test_device_configuration(monkeypatch):
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2, ipus_per_replica=2, pipeline_stages=2,
                                       gradient_accumulation=8, available_memory_proportion=0.6,
                                       stochastic_rounding=True))
  (_, (cfg,), _), = _calls("configure_ipu_system")
  assert cfg.auto_select_ipus == 4
  assert cfg.device_connection.type == fake_ipu.DeviceConnectionType.ON_DEMAND
  assert cfg.matmuls.poplar_options == {"availableMemoryProportion": "0.6"}
  assert cfg.convolutions.poplar_options == {"availableMemoryProportion": "0.6"}
  assert cfg.floating_point_behaviour.esr == fake_ipu.StochasticRoundingBehaviour.ON
  assert cfg.compilation_poplar_options == {"target.deterministicWorkers": "portable"}
  assert cfg.allow_recompute
  (_, (seed,), kwargs), = _calls("reset_ipu_seed")
  assert seed == 7 and kwargs["experimental_identical_replicas"]
  assert _calls("IPUStrategy") and backend.replicas == 2 and backend.kind == "ipu"


def test_the_ipu_is_the_hardware_and_its_conv_blocks_keep_the_builders_defaults(monkeypatch):
  """The measured CPU forms (model/neuron_inverter/cpu_forms.py) do not apply to IPUs."""
  from model.neuron_inverter.designs import CONV_OPTION_DEFAULTS  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(precision="16.16"))
  assert backend.hardware.device == "ipu" and backend.hardware.precision == backend.precision
  assert not backend.hardware.cpu_features
  assert model.layer_forms(model.get_model_module("neuron_inverter"), backend.hardware) == (CONV_OPTION_DEFAULTS,)


def test_pre_compile_sets_the_required_version(monkeypatch):
  fake_ipu.install(monkeypatch)
  ipu_backend.create(_config(ipu_connection="pre_compile"))
  (_, (cfg,), _), = _calls("configure_ipu_system")
  assert cfg.device_connection.type == fake_ipu.DeviceConnectionType.PRE_COMPILE
  assert cfg.device_connection.version == "ipu2" and cfg.device_connection.enable_remote_buffers


@pytest.mark.parametrize("connection", ["on_demand", "pre_compile"])
def test_connections_without_a_device_support_remote_buffers(monkeypatch, connection):
  """So that a pre-compiled executable's hash matches a later on_demand run's (poplar_executor.cc)."""
  fake_ipu.install(monkeypatch)
  ipu_backend.create(_config(ipu_connection=connection))
  (_, (cfg,), _), = _calls("configure_ipu_system")
  assert cfg.device_connection.enable_remote_buffers


def test_ipu_dropout_keeps_the_noise_shape_and_draws_a_new_mask_at_every_step(monkeypatch):
  """A seeded Keras Dropout too: a seed would make the IPU op repeat one mask (rand_ops.py)."""
  fake_ipu.install(monkeypatch)
  for name, module in fake_ipu.build_addons().items():
    monkeypatch.setitem(sys.modules, name, module)
  inputs = tf.keras.Input((64,))
  outputs = tf.keras.layers.Dropout(0.5, seed=11, name="drop")(inputs)
  swapped = ipu_backend.swap_ipu_layers(tf.keras.Model(inputs, outputs))
  (_, (rate,), kwargs), = _calls("ipu_layers.Dropout")
  assert rate == 0.5 and kwargs == {"noise_shape": None, "seed": None, "layer_name": "drop"}
  masks = [swapped(tf.ones((4, 64)), training=True).numpy() != 0 for _ in range(2)]
  assert (masks[0] != masks[1]).any()
  seeded = sys.modules["ipu_tensorflow_addons.keras.layers"].Dropout(0.5, seed=[11, 0])  # what a seed did
  assert (seeded(tf.ones((4, 64)), training=True).numpy() == seeded(tf.ones((4, 64)), training=True).numpy()).all()
  assert swapped(tf.ones((2, 64)), training=False).shape == (2, 64)
  inputs = tf.keras.Input((6,))
  ipu_backend.swap_ipu_layers(tf.keras.Model(inputs, tf.keras.layers.Dropout(0.25, noise_shape=(1, 6))(inputs)))
  assert _calls("ipu_layers.Dropout")[-1][2]["noise_shape"] == (1, 6)


def test_a_noise_shape_the_ipu_dropout_refuses_stays_keras_dropout(monkeypatch):
  """rand_ops.py `dropout` takes 1 or the input's size in each dimension of noise_shape, never None
  (Keras' Dropout reads None as the input's size)."""
  fake_ipu.install(monkeypatch)
  for name, module in fake_ipu.build_addons().items():
    monkeypatch.setitem(sys.modules, name, module)
  ipu_dropout = sys.modules["ipu_tensorflow_addons.keras.layers"].Dropout
  with pytest.raises((TypeError, ValueError)):
    ipu_dropout(0.25, noise_shape=(None, 1))(tf.ones((4, 6)), training=True)
  with pytest.raises(ValueError, match="Dimension mismatch"):
    ipu_dropout(0.25, noise_shape=(2, 1))(tf.ones((4, 6)), training=True)
  assert ipu_dropout(0.25, noise_shape=(4, 1))(tf.ones((4, 6)), training=True).shape == (4, 6)
  fake_ipu.CALLS.clear()
  inputs = tf.keras.Input((6,))
  swapped = ipu_backend.swap_ipu_layers(
      tf.keras.Model(inputs, tf.keras.layers.Dropout(0.25, noise_shape=(None, 1))(inputs)))
  assert not _calls("ipu_layers.Dropout")
  assert swapped(tf.ones((4, 6)), training=True).shape == (4, 6)


def test_a_zero_dropout_rate_stays_an_identity_on_the_ipu(monkeypatch):
  fake_ipu.install(monkeypatch)
  for name, module in fake_ipu.build_addons().items():
    monkeypatch.setitem(sys.modules, name, module)
  inputs = tf.keras.Input((6,))
  swapped = ipu_backend.swap_ipu_layers(tf.keras.Model(inputs, tf.keras.layers.Dropout(0.0)(inputs)))
  assert not _calls("ipu_layers.Dropout")
  assert type(swapped.layers[-1]) is tf.keras.layers.Dropout  # pylint: disable=unidiomatic-typecheck


def test_no_ipu_attached_is_one_clear_line(monkeypatch):
  fake_ipu.install(monkeypatch)
  monkeypatch.setattr(fake_ipu, "FAIL_CONFIGURE", "Target configuration failed: model disabled and no "
                      "hardware IPU found. (Are you sure you enabled the Poplar driver ?)\nmore lines")
  with pytest.raises(UserError) as caught:
    ipu_backend.create(_config())
  assert_names(caught.value, "no IPU is attached", "--ipu_model")


@pytest.mark.parametrize("kwargs, message", [
    (dict(replicas=3), "3 IPUs.*powers of two"),
    (dict(replicas=2, ipus_per_replica=3, pipeline_stages=3), "6 IPUs"),
    (dict(ipus_per_replica=2, pipeline_stages=2, gradient_accumulation=6), "multiple of 4"),
    (dict(ipus_per_replica=2, pipeline_stages=2, pipeline_schedule="interleaved",
          gradient_accumulation=3), "multiple of 2"),
])
def test_pipeline_and_replication_rules(monkeypatch, kwargs, message):
  fake_ipu.install(monkeypatch)
  with pytest.raises(UserError, match=message):
    ipu_backend.create(_config(**kwargs))


@pytest.mark.parametrize("sdk, module", [("3.x", "distributed"), ("2.6", "horovod")])
def test_poprun_uses_popdist(monkeypatch, sdk, module):
  fake_ipu.install(monkeypatch, sdk=sdk, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2))
  backend = ipu_backend.create(_config(replicas=4))
  assert _calls("PopDistStrategy") and not _calls("IPUStrategy")
  assert bool(_calls("horovod.init")) == (module == "horovod")
  (_, (_,), kwargs), = _calls("popdist.set_ipu_config")
  assert kwargs == {"ipus_per_replica": 1, "configure_device": True}
  assert backend.replicas == 4 and backend.optimizer_kwargs() == {}  # PopDist averages itself


def test_poprun_instances_read_their_own_shards(monkeypatch):
  fake_ipu.install(monkeypatch, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2, index=1))
  layout = ipu_backend.create(_config(replicas=4)).layout(16)
  assert layout.replicas == 2 and list(layout.shards) == [2, 3] and layout.total_shards == 4
  assert not eval_layout(layout).keeps_tail    # static shapes: an evaluation leaves its tail out


@pytest.mark.parametrize("statistics, eval_rows, evaluated", [("moving", 32, 2048), ("batch", 48, 1920)])
def test_evaluation_covers_the_built_in_splits_in_batches_that_divide_the_shards(monkeypatch, statistics,
                                                                                eval_rows, evaluated):
  """The built-in 2,048 validation samples over 4 replicas of 48: 512 rows a replica, in 16 batches of
  32, every sample. Batch statistics depend on the batch size, so that setting keeps the micro-batch
  and leaves 128 rows out (32 a replica), as before."""
  fake_ipu.install(monkeypatch)
  config = _config(replicas=4, model_options={"batch_norm_statistics": statistics})
  evaluation = eval_layout(ipu_backend.create(config).layout(48, model.batch_dependent(config)), 2048)
  assert evaluation.replica_rows == eval_rows and not evaluation.keeps_tail
  rows = tf.range(2048, dtype=tf.float32)[:, None].numpy()
  split = split_from_arrays(Arrays(rows, rows), evaluation, lambda x, y: (x, y), False, 0, 0, "val")
  assert split.samples == evaluated and split.steps * 4 * eval_rows == evaluated
  seen = sorted(int(v) for x, _ in split.dataset for v in x.numpy().ravel())
  assert len(set(seen)) == len(seen) == evaluated and all(x.shape[0] == eval_rows for x, _ in split.dataset)


@pytest.mark.parametrize("statistics, rows", [("moving", 32), ("batch", 48)])
def test_predict_evaluates_in_the_batches_that_training_evaluates_in(monkeypatch, tmp_path, statistics, rows):
  """tools/predict.py and --predict lay out the test split as training's evaluation does: a network with
  batch statistics in micro-batches of 48, else batches that divide each replica's 128 rows."""
  from analysis import evaluation  # pylint: disable=import-outside-toplevel
  from tests.support.cellspike_files import write_cellspike  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 64, "val": 16, "test": 512})
  config = _config(replicas=4, batch_size=48, data_path=data_path,
                   model_options={"batch_norm_statistics": statistics})
  _, split = evaluation._eval_split(config, ipu_backend.create(config), "test", 0)  # pylint: disable=protected-access
  assert all(x.shape[0] == rows for x, _ in split.dataset.take(2))


@pytest.mark.parametrize("batch, shard_rows, multiple, rows", [
    (48, 512, 1, 32), (48, 480, 1, 48), (16, 512, 1, 16), (48, 17, 1, 48), (48, 512, 2, 32),
    (48, 480, 4, 40), (7, 9, 1, 7), (1, 5, 1, 1)])
def test_dividing_batch(batch, shard_rows, multiple, rows):
  assert dividing_batch(batch, shard_rows, multiple) == rows


def test_keras_steps_count_the_elements_of_all_local_replicas(monkeypatch):
  """IPU Keras runs steps // replicas per replica (keras/ipu/extensions/data_adapter.py _infer_steps)."""
  fake_ipu.install(monkeypatch)
  dataset = tf.data.Dataset.range(4)
  assert ipu_backend.create(_config(replicas=2)).fit_input(dataset, 10) == (dataset, 20)
  fake_ipu.install(monkeypatch, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2))
  assert ipu_backend.create(_config(replicas=4)).fit_input(dataset, 10) == (dataset, 20)


def test_poprun_replica_mismatch_is_refused(monkeypatch):
  fake_ipu.install(monkeypatch, popdist=fake_ipu.build_popdist(total_replicas=4))
  with pytest.raises(UserError) as caught:
    ipu_backend.create(_config(replicas=2))
  assert_names(caught.value, "--replicas=2", "poprun", "--num-replicas=4")


def test_gradients_are_averaged_over_ipu_strategy_replicas(monkeypatch):
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=4))
  (transform,) = backend.optimizer_kwargs()["gradient_transformers"]
  (gradient, variable), = transform([(tf.constant(8.0), "v")])
  assert float(gradient) == 2.0 and variable == "v"


def test_steps_per_execution_rules():
  assert ipu_backend.derive_steps_per_execution(120, 4, 0) == 120
  assert ipu_backend.derive_steps_per_execution(120, 4, 40) == 40
  with pytest.raises(UserError, match="120 training steps"):
    ipu_backend.derive_steps_per_execution(120, 4, 50)
  with pytest.raises(UserError, match="--gradient_accumulation=4"):
    ipu_backend.derive_steps_per_execution(120, 4, 30)


def test_steps_per_execution_fits_every_evaluation_split():
  """IPU Keras needs it to divide each evaluate's steps too, or truncates it (data_adapter.py)."""
  with pytest.raises(UserError, match="50 evaluation steps"):
    ipu_backend.derive_steps_per_execution(120, 4, 40, eval_steps=(50,))
  assert ipu_backend.derive_steps_per_execution(120, 4, 40, eval_steps=(30, 80)) == 40  # 30: truncated
  # derived: 180 truncates to the 120 training steps and runs each split in one execution. fit checks
  # the compiled value against the accumulation count before it truncates it, and the truncated one
  # after (extensions_base.py): 150 has no factor 4, so 152 it is; 50 with 8 training steps failed.
  assert ipu_backend.derive_steps_per_execution(120, 4, 0, eval_steps=(180,)) == 180
  assert ipu_backend.derive_steps_per_execution(120, 4, 0, eval_steps=(150,)) == 152
  assert ipu_backend.derive_steps_per_execution(120, 4, 0, eval_steps=(50,)) == 120
  assert ipu_backend.derive_steps_per_execution(8, 4, 0, eval_steps=(50,)) == 52
  with pytest.raises(UserError) as caught:
    ipu_backend.derive_steps_per_execution(8, 4, 10)
  assert_names(caught.value, "--steps_per_execution=10", "multiple", "--gradient_accumulation=4")
  # inference alone: no accumulation rule
  assert ipu_backend.derive_steps_per_execution(None, 4, 0, eval_steps=(30,)) == 30
  assert ipu_backend.derive_steps_per_execution(None, 4, 15, eval_steps=(30,)) == 15


def test_layout_feeds_micro_batches_per_replica_and_whole_optimizer_steps(monkeypatch):
  fake_ipu.install(monkeypatch)
  layout = ipu_backend.create(_config(replicas=2, gradient_accumulation=4)).layout(48)
  assert (layout.replica_rows, layout.element_per_replica, layout.steps_multiple) == (48, True, 4)


def test_the_stand_in_refuses_stage_assignments_that_ipu_keras_refuses(monkeypatch):
  """functional_extensions.py `_get_pipelined_post_order`: the post-order's length and order, a stage
  for every layer, and no input from a later stage."""
  fake_ipu.install(monkeypatch)
  net = fake_ipu.inject_keras_extensions(model.get_model_module("neuron_inverter").build(_config(model_options={"design": "dev"})))
  def assigned(stages):
    assignments = net.get_pipeline_stage_assignment()
    for assignment, stage in zip(assignments, stages):
      assignment.pipeline_stage = stage
    return assignments
  count = len(net.get_pipeline_stage_assignment())
  with pytest.raises(ValueError, match="number of layers"):
    net.set_pipeline_stage_assignment(assigned([0] * count)[:-1])
  with pytest.raises(ValueError, match="the post-order"):
    net.set_pipeline_stage_assignment(list(reversed(assigned([0] * count))))
  with pytest.raises(ValueError, match="not been assigned"):
    net.set_pipeline_stage_assignment(assigned([0] * (count - 1) + [None]))
  with pytest.raises(ValueError, match="previous pipeline stages"):
    net.set_pipeline_stage_assignment(assigned([1] + [0] * (count - 1)))
  net.set_pipeline_stage_assignment(assigned([0] * (count // 2) + [1] * (count - count // 2)))


def test_stage_assignment_at_the_builder_boundary(monkeypatch):
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(ipus_per_replica=2, pipeline_stages=2, gradient_accumulation=8))
  module = model.get_model_module("neuron_inverter")
  net = fake_ipu.inject_keras_extensions(module.build(_config()))
  backend.prepare_model(net, module.STAGE_BOUNDARIES)
  (_, (stages,), _), = _calls("set_pipeline_stage_assignment")
  assert stages["conv3"] == 0 and stages["conv_channels"] == 0
  assert stages["flatten"] == 1 and stages["batch_norm"] == 1 and stages["conductances"] == 1
  (_, _, options), = _calls("set_pipelining_options")
  assert options["gradient_accumulation_steps_per_replica"] == 8
  assert options["device_mapping"] == [0, 1]
  assert options["pipeline_schedule"] == fake_ipu.PipelineSchedule.Grouped
  assert options["gradient_accumulation_reduction_method"] == "mean"


def test_a_pipelined_batch_norm_is_warned_about_and_replicas_are_not(monkeypatch, caplog):
  """keras/ipu/extensions/extensions_base.py: BatchNormalization's moving statistics (0 < momentum < 1)
  are not properly updated in pipelined training; a run that asks for them anyway is told so, naming
  the layer; each batch's own statistics need no warning."""
  fake_ipu.install(monkeypatch)
  module = model.get_model_module("neuron_inverter")
  caplog.set_level("WARNING")
  for stages, statistics, warned in ((1, "moving", False), (2, "batch", False), (2, "moving", True)):
    config = _config(ipus_per_replica=stages, pipeline_stages=stages, gradient_accumulation=8,
                     model_options={"batch_norm_statistics": statistics})
    backend = ipu_backend.create(config)
    backend.prepare_model(fake_ipu.inject_keras_extensions(module.build(config)), module.STAGE_BOUNDARIES)
    assert ("moving statistics of" in caplog.text and "(batch_norm)" in caplog.text) == warned
  assert "--batch_norm_statistics=batch" in caplog.text


def test_optimizer_steps_are_micro_batch_steps_over_the_accumulation_count(monkeypatch):
  """IPU Keras counts a step per micro-batch (keras/ipu/docs/keras.rst); the optimizer and the cosine
  rate count updates, one per G micro-batches."""
  fake_ipu.install(monkeypatch)
  assert ipu_backend.create(_config(gradient_accumulation=4)).optimizer_steps(40) == 10
  assert ipu_backend.create(_config()).optimizer_steps(40) == 40


def test_too_many_stages_for_the_model(monkeypatch):
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(ipus_per_replica=4, pipeline_stages=4, gradient_accumulation=8))
  module = model.get_model_module("neuron_inverter")
  net = fake_ipu.inject_keras_extensions(module.build(_config()))
  with pytest.raises(UserError, match="at most 2 stages"):
    backend.prepare_model(net, module.STAGE_BOUNDARIES)


def test_unpipelined_accumulation_uses_the_ga_options(monkeypatch):
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(gradient_accumulation=4))
  net = fake_ipu.inject_keras_extensions(model.get_model_module("mnist").build(_config(model="mnist")))
  backend.prepare_model(net, ())
  (_, _, options), = _calls("set_gradient_accumulation_options")
  assert options == {"gradient_accumulation_steps_per_replica": 4,
                     "gradient_accumulation_reduction_method": "mean"}


def _environment_after_prepare(*flags_and_env):
  """Runs strategies.environment.prepare in a fresh process, before TensorFlow, as main.py does."""
  args, env = [a for a in flags_and_env if isinstance(a, str)], dict(os.environ)
  for variable in ("TF_POPLAR_FLAGS", "TF_XLA_FLAGS", "POPLAR_ENGINE_OPTIONS", "PVTI_OPTIONS"):
    env.pop(variable, None)
  for extra in flags_and_env:
    if isinstance(extra, dict):
      env.update(extra)
  code = ("import json, os, sys; from run_config import RunConfig; from strategies import environment; "
          "environment.prepare(RunConfig(model='mnist', %s)); "
          "assert 'tensorflow' not in sys.modules; print(json.dumps(dict(os.environ)))" % ", ".join(args))
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                       text=True, check=True).stdout
  return json.loads(out)


def test_environment_for_ipu_cache_model_and_profiles(tmp_path):
  env = _environment_after_prepare("backend='ipu'", "ipu_model=True", "cache_dir=%r" % str(tmp_path / "c"),
                                   "profile_dir=%r" % str(tmp_path / "p"))
  flags = env["TF_POPLAR_FLAGS"].split()
  assert "--use_ipu_model" in flags
  assert "--executable_cache_path=%s" % (tmp_path / "c") in flags   # underscores, absolute
  assert json.loads(env["POPLAR_ENGINE_OPTIONS"])["autoReport.directory"] == str(tmp_path / "p")
  assert json.loads(env["PVTI_OPTIONS"])["enable"] == "true"
  assert env["TF_USE_LEGACY_KERAS"] == "1" and "TF_XLA_FLAGS" not in env


def test_profile_options_keep_the_users_own(tmp_path):
  env = _environment_after_prepare("backend='ipu'", "profile_dir=%r" % str(tmp_path / "p"),
                                   {"POPLAR_ENGINE_OPTIONS": '{"target.hostSyncTimeout": "60", '
                                                             '"autoReport.all": "false"}'})
  options = json.loads(env["POPLAR_ENGINE_OPTIONS"])
  assert options["target.hostSyncTimeout"] == "60" and options["autoReport.all"] == "false"
  assert options["autoReport.directory"] == str(tmp_path / "p")


def test_poprun_cache_path_wins(tmp_path):
  env = _environment_after_prepare("backend='ipu'", "cache_dir=%r" % str(tmp_path / "c"),
                                   {"POPDIST_EXECUTABLE_CACHE_PATH": str(tmp_path / "poprun")})
  assert "--executable_cache_path" not in env.get("TF_POPLAR_FLAGS", "")


def test_synthetic_data_keeps_the_users_own_initializer():
  """The user's --synthetic_data_initializer=normal was followed by ours (random), which then won."""
  flags = _environment_after_prepare("backend='ipu'", "synthetic_data=True", {
      "TF_POPLAR_FLAGS": "--synthetic_data_initializer=normal"})["TF_POPLAR_FLAGS"].split()
  assert "--use_synthetic_data" in flags
  assert [f for f in flags if f.startswith("--synthetic_data_initializer=")] == [
      "--synthetic_data_initializer=normal"]
  flags = _environment_after_prepare("backend='ipu'", "synthetic_data=True")["TF_POPLAR_FLAGS"].split()
  assert "--synthetic_data_initializer=random" in flags


def test_xla_cache_only_where_tensorflow_has_it(tmp_path):
  env = _environment_after_prepare("backend='cpu'", "jit_compile=True", "cache_dir=%r" % str(tmp_path))
  if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
    assert env["TF_XLA_FLAGS"] == "--tf_xla_persistent_cache_directory=%s" % (tmp_path / "xla")
  else:  # TensorFlow 2.6 aborts on this unknown flag
    assert "TF_XLA_FLAGS" not in env
  assert "TF_POPLAR_FLAGS" not in env


def test_sixteen_bit_weights_use_ipu_optimizers_with_float32_state(monkeypatch):
  fake_ipu.install(monkeypatch)
  for name, module in fake_ipu.build_addons().items():
    monkeypatch.setitem(sys.modules, name, module)
  assert ipu_backend.create(_config()).optimizer_factories() == {}       # 32-bit weights: Keras' own
  factories = ipu_backend.create(_config(replicas=2, precision="16.16")).optimizer_factories()
  from training.optimizers import make_optimizer  # pylint: disable=import-outside-toplevel
  make_optimizer("adam", 0.002, factories, gradient_transformers=[])
  (_, _, kwargs), = _calls("AdamIpuOptimizer")
  assert kwargs == {"learning_rate": 0.002, "m_dtype": tf.float32, "v_dtype": tf.float32,
                    "gradient_transformers": []}


def test_only_poprun_instance_zero_writes(monkeypatch, tmp_path):
  """examples' popdist_training.py saves only on popdist.getInstanceIndex() == 0."""
  for index in (0, 1):
    fake_ipu.install(monkeypatch, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2, index=index))
    backend = ipu_backend.create(_config(replicas=4))
    assert (backend.rank, backend.world_size, backend.is_chief) == (index, 2, index == 0)
    assert (backend.output_dir(str(tmp_path)) == str(tmp_path)) == (index == 0)
    assert backend.alone() is None  # --predict is left to tools/predict.py, run without poprun


@pytest.mark.parametrize("sdk, call", [("2.6", "horovod.allreduce"), ("3.0", "host_collective_ops.allreduce"),
                                       ("3.x", "host_collective_ops.allreduce")])
def test_poprun_instances_agree_on_a_stop_through_a_host_allreduce(monkeypatch, sdk, call):
  fake_ipu.install(monkeypatch, sdk=sdk, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2))
  backend = ipu_backend.create(_config(replicas=4))
  assert backend.any_process(True)
  assert not backend.any_process(False)
  fake_ipu.OTHER_INSTANCES_FLAGGED = 1  # the other instance was signalled
  assert backend.any_process(False)
  assert [args for _, args, _ in _calls(call)] == [(1.0,), (0.0,), (0.0,)]


def test_a_signal_to_one_instance_stops_all_at_the_next_batch_end(monkeypatch):
  from stop_signals import InterruptFlag  # pylint: disable=import-outside-toplevel
  from training import interrupt  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2))
  backend = ipu_backend.create(_config(replicas=4))
  saved = []
  checkpointing = type("Checkpointing", (), {
      "save_interrupted": lambda self, epoch, step, logs: saved.append((epoch, step)) or "ckpt-1-step2"})()
  stop = interrupt.GracefulStop(InterruptFlag(), checkpointing, steps_per_epoch=4, total_epochs=3,
                                any_process=backend.any_process)
  stop.on_epoch_begin(0)
  stop.on_train_batch_end(0, {"loss": 0.5})  # nobody signalled: training goes on
  fake_ipu.OTHER_INSTANCES_FLAGGED = 1
  with pytest.raises(interrupt.TrainingInterrupted) as stopped:
    stop.on_train_batch_end(1, {"loss": 0.5})
  assert saved == [(0, 2)]
  assert_names(stopped.value.where, "epoch 1", "step 2 of 4")


@pytest.mark.parametrize("schedule, stages, ipus, training, overlap", [
    ("grouped", 2, 2, True, 4), ("grouped", 2, 2, False, 2), ("grouped", 4, 2, False, 4),
    ("interleaved", 2, 2, True, 2), ("interleaved", 4, 4, False, 4),
    ("sequential", 4, 2, True, 1), ("grouped", 1, 1, True, 1)])
def test_pipeline_overlap_follows_the_pipeline_visitor(schedule, stages, ipus, training, overlap):
  """driver/visitors/pipeline_visitor.cc: iterations must be a multiple of ScheduleOffsets(mapping)."""
  assert ipu_backend.pipeline_overlap(schedule, stages, ipus, training) == overlap


def test_interleaved_training_needs_one_ipu_per_stage(monkeypatch):
  fake_ipu.install(monkeypatch)
  with pytest.raises(UserError, match="one IPU per stage"):
    ipu_backend.create(_config(ipus_per_replica=2, pipeline_stages=4, pipeline_schedule="interleaved",
                               gradient_accumulation=8))


def test_pipelined_evaluation_splits_are_trimmed_to_the_inference_pipeline_depth(monkeypatch):
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(ipus_per_replica=2, pipeline_stages=2, gradient_accumulation=8))
  assert eval_layout(backend.layout(16)).steps_multiple == 2  # grouped inference: the 2 stages
  assert backend.compile_kwargs(120, [30]) == {"steps_per_execution": 120}  # depth min(120, 30) = 30
  with pytest.raises(UserError, match="multiples of 4"):  # depth 10
    ipu_backend.derive_steps_per_execution(120, 8, 40, eval_steps=(10,), eval_depth_multiple=4)
  with pytest.raises(UserError, match="no --steps_per_execution"):  # depth 15 is odd
    ipu_backend.derive_steps_per_execution(120, 8, 0, eval_steps=(15,), eval_depth_multiple=2)


def test_prediction_places_the_model_as_training_does(monkeypatch):
  """An unpipelined model counts as one IPU per replica (extensions_base.py _get_shard_count)."""
  from analysis import evaluation  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(ipus_per_replica=2, pipeline_stages=2, gradient_accumulation=8))
  evaluation.build_model(_config(), (1600, 4), 15, backend)
  (_, _, options), = _calls("set_pipelining_options")
  assert options["device_mapping"] == [0, 1]
  assert _calls("set_pipeline_stage_assignment")
  unpipelined = dataclasses.replace(backend, pipeline_stages=1)
  with pytest.raises(UserError) as caught:
    evaluation.build_model(_config(), (1600, 4), 15, unpipelined)
  assert_names(caught.value, "--ipus_per_replica=2", "pipeline stages")


@pytest.mark.parametrize("sdk, replicas, stages, reduced", [
    ("3.x", 2, 1, True), ("3.x", 1, 1, False), ("3.x", 2, 2, False), ("3.0", 2, 1, False),
    ("2.6", 2, 1, False)])
def test_replicated_metrics_are_averaged_where_ipu_keras_can(monkeypatch, sdk, replicas, stages, reduced):
  """SDK 3.1+ defaults to ReplicatedMetricReductionMethod.NONE (the last replica's values)."""
  from analysis import evaluation  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch, sdk=sdk)
  config = _config(replicas=replicas, ipus_per_replica=stages, pipeline_stages=stages,
                   gradient_accumulation=8)
  backend = ipu_backend.create(config)
  module = model.get_model_module("neuron_inverter")
  with backend.strategy.scope():
    backend.prepare_model(module.build(config), module.STAGE_BOUNDARIES)
  assert [args for _, args, _ in _calls("set_replication_options")] == ([("MEAN",)] if reduced else [])
  fake_ipu.CALLS.clear()
  evaluation.build_model(config, (1600, 4), 15, backend)  # MEAN would average the predictions too
  assert not _calls("set_replication_options")


def test_the_stand_in_refuses_what_ipu_keras_refuses(monkeypatch):
  """keras/ipu/extensions/extensions_base.py and gradient_accumulation.py parse rules."""
  fake_ipu.install(monkeypatch)
  net = fake_ipu.inject_keras_extensions(model.get_model_module("mnist").build(_config(model="mnist")))
  with pytest.raises(ValueError, match="GradientAccumulationReductionMethod"):
    net.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4,
                                          gradient_accumulation_reduction_method="average")
  with pytest.raises(ValueError, match="list of integers"):
    net.set_pipelining_options(gradient_accumulation_steps_per_replica=4, device_mapping=(0, 1))
  with pytest.raises(ValueError, match="Found `repeat_count`"):
    net.set_pipelining_options(gradient_accumulation_steps_per_replica=4, repeat_count=2)
  with pytest.raises(ValueError, match="positive integer"):
    net.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=0)
  with pytest.raises(ValueError, match="ReplicatedMetricReductionMethod"):
    net.set_replication_options(replicated_metric_reduction_method="average")
  cfg = fake_ipu.IPUConfig()
  cfg.compilation_poplar_options = {"target.deterministicWorkers": 1}
  with pytest.raises(TypeError, match="strings"):
    cfg.configure_ipu_system()


# --- IPU Keras' fit, evaluate and predict, as the stand-in plays them --------------------------------

def _tiny_build(config, input_shape=(3,), num_outputs=1):
  """A functional model with four possible stages (boundaries: flatten, hidden, head)."""
  del config
  inputs = tf.keras.Input(input_shape)
  x = tf.keras.layers.Dense(4, name="dense")(inputs)
  x = tf.keras.layers.Flatten(name="flatten")(x)
  x = tf.keras.layers.Dense(4, name="hidden")(x)
  outputs = tf.keras.layers.Dense(num_outputs, name="head")(x)
  return tf.keras.Model(inputs, outputs)


TINY_MODEL = types.SimpleNamespace(
    build=_tiny_build, STAGE_BOUNDARIES=("flatten", "hidden", "head"),
    loss=tf.keras.losses.MeanSquaredError,
    metrics=lambda: [tf.keras.metrics.MeanAbsoluteError(name="mae")])


def _tiny_net(backend, inference=False):
  """The tiny model as the application places it (training: prepare_model; prediction: inference_model)."""
  with backend.strategy.scope():
    net = TINY_MODEL.build(None)
    place = backend.inference_model if inference else backend.prepare_model
    return place(net, TINY_MODEL.STAGE_BOUNDARIES)


def _elements(count, rows=2):
  """`count` dataset elements of `rows` samples; element k's targets are k % 2 * 10 (replica 1 of 2)."""
  x = tf.reshape(tf.range(count * rows * 3, dtype=tf.float32), (count, rows, 3)) / 100.0
  y = tf.reshape(tf.repeat(tf.cast(tf.range(count) % 2 * 10, tf.float32), rows), (count, rows, 1))
  return tf.data.Dataset.from_tensor_slices((x, y))


def test_the_stand_in_refuses_what_the_ipu_data_handler_refuses(monkeypatch):
  """keras/ipu/extensions/data_adapter.py IPUDataHandler: steps_per_execution divides each replica's
  steps, or is truncated to them; in fit it is a multiple of the accumulation count as compiled and as
  truncated."""
  fake_ipu.install(monkeypatch)
  net = _tiny_net(ipu_backend.create(_config(replicas=2, gradient_accumulation=2)))
  net.compile(loss="mse", steps_per_execution=4)
  with pytest.raises(ValueError) as caught:
    net.evaluate(_elements(12), steps=12)
  assert_names(caught.value, "`steps_per_execution` (4)", "divisor", "batches (6)", "to this replica.")
  with pytest.raises(ValueError, match=r"batches \(6\)"):
    net.predict(_elements(12).map(lambda x, y: x), steps=12)
  with pytest.raises(ValueError, match="all 2 replicas"):
    net.evaluate(_elements(1), steps=1)
  extension = net.ipu_extension
  assert extension.check_inference(16) == (2, 8, 4)
  assert extension.check_inference(6) == (2, 3, 3)               # truncated to the 3 steps per replica
  assert extension.check_fit(16, validation_steps=8) == 4
  with pytest.raises(RuntimeError) as caught:
    net.fit(_elements(6).repeat(), steps_per_epoch=6)             # truncated to 3, not a multiple of 2
  assert_names(caught.value, "(set to 3)", "not divisible", "`gradient_accumulation_steps_per_replica`", "(2)")
  # Infeeds need static shapes: a batch without drop_remainder is refused (IPUDataHandler).
  with pytest.raises(ValueError) as caught:
    net.evaluate(_elements(12).unbatch().batch(2), steps=4)
  assert_names(caught.value, "shape (None, 3)", "not fully defined")
  # The value as compiled is checked too, before fit truncates it (`_log_optimizer_batch_size`): 5
  # truncated to the 2 steps per replica of 4 would pass.
  with pytest.raises(RuntimeError) as caught:
    extension.check_fit(4, steps_per_execution=5)
  assert_names(caught.value, "(set to 5)", "not divisible")


def test_validation_in_fit_is_checked_for_all_replicas_together(monkeypatch):
  """extensions_base.py `_fit_delegate` makes the validation data handler with IPUDataHandler's default
  replication_factor=1: 30 steps per replica truncate 40, but 60 steps in all must be divisible by it."""
  fake_ipu.install(monkeypatch)
  net = _tiny_net(ipu_backend.create(_config(replicas=2)))
  net.compile(loss="mse", steps_per_execution=40)
  assert net.ipu_extension.check_inference(60) == (2, 30, 30)   # evaluate alone is fine
  with pytest.raises(ValueError) as caught:
    net.ipu_extension.check_fit(240, validation_steps=60)
  assert_names(caught.value, "`steps_per_execution`", "(40)", "divisor", "batches (60)", "dataset provided.")
  with pytest.raises(UserError) as caught:
    ipu_backend.derive_steps_per_execution(120, 1, 40, eval_steps=(30,), replicas=2)
  assert_names(caught.value, "60 evaluation steps", "all 2 replicas")
  assert ipu_backend.derive_steps_per_execution(None, 1, 40, eval_steps=(30,), replicas=2) == 40  # predict
  # derived: 80 truncates to the 50 steps per replica but does not divide the 100 of both replicas
  assert ipu_backend.derive_steps_per_execution(80, 1, 0, eval_steps=(50,)) == 80
  assert ipu_backend.derive_steps_per_execution(80, 1, 0, eval_steps=(50,), replicas=2) == 100


@pytest.mark.parametrize("schedule, stages, ipus, iterations, multiple", [
    ("grouped", 2, 2, 3, 2), ("grouped", 4, 2, 6, 4), ("interleaved", 2, 2, 3, 2)])
def test_the_stand_in_checks_the_inference_pipeline_depth(monkeypatch, schedule, stages, ipus, iterations,
                                                         multiple):
  """extensions_base.py `_make_pipeline_ipu_test_function`: depth = the truncated steps_per_execution,
  which pipeline_visitor.cc `VerifyPipelineArgumentsFixed` needs in multiples of the overlap length."""
  fake_ipu.install(monkeypatch)
  net = _tiny_net(ipu_backend.create(_config(ipus_per_replica=ipus, pipeline_stages=stages,
                                             pipeline_schedule=schedule, gradient_accumulation=8)),
                  inference=True)
  extension = net.ipu_extension
  assert extension.check_inference(4 * multiple, multiple) == (1, 4 * multiple, multiple)
  with pytest.raises(tf.errors.FailedPreconditionError) as caught:
    extension.check_inference(iterations, 100)                  # truncated to the 3 or 6 steps
  assert_names(caught.value, "multiple of %d" % multiple, "it is %d" % iterations)


def test_the_stand_in_places_models_as_ipu_keras(monkeypatch):
  """`_get_replication_factor`: IPUs over the shard count rounded up to a power of two, and an
  unpipelined model counts as one shard whatever --ipus_per_replica asks for."""
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2, ipus_per_replica=2, pipeline_stages=2,
                                       gradient_accumulation=4))
  assert _tiny_net(backend).ipu_extension.replication_factor() == 2
  unpipelined = fake_ipu.inject_keras_extensions(TINY_MODEL.build(None))
  assert unpipelined.ipu_extension.replication_factor() == 4
  fake_ipu.install(monkeypatch, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2))
  assert _tiny_net(ipu_backend.create(_config(replicas=4))).ipu_extension.replication_factor() == 2


SWEEP_CONFIGS = [
    ({}, None), ({"replicas": 2}, None), ({"replicas": 4, "gradient_accumulation": 4}, None),
    ({"replicas": 4}, (4, 2)),    # poprun: 2 instances of 2 replicas
    ({"replicas": 2, "ipus_per_replica": 2, "pipeline_stages": 2, "gradient_accumulation": 4}, None),
    ({"ipus_per_replica": 2, "pipeline_stages": 4, "gradient_accumulation": 8}, None),
    ({"ipus_per_replica": 2, "pipeline_stages": 2, "pipeline_schedule": "interleaved",
      "gradient_accumulation": 6}, None),
]


def _refusal(check, *args):
  """Why the stand-in refuses `check(*args)` as IPU Keras would, or None."""
  try:
    check(*args)
  except (ValueError, RuntimeError, NotImplementedError, tf.errors.FailedPreconditionError) as error:
    return "%s: %s" % (type(error).__name__, error)
  return None


def _fit_refusal(training, train, val, test, steps_per_execution):
  """Fit with either evaluation split as its validation data (the backend is not told which one is),
  which includes evaluating it; None if IPU Keras runs them."""
  return (_refusal(training.check_fit, train, val, steps_per_execution)
          or _refusal(training.check_fit, train, test, steps_per_execution))


def _eval_steps(layout, samples, name):
  """Steps of an evaluation split of `samples` rows, as the loaders lay it out."""
  evaluation = eval_layout(layout, samples)
  return count_steps(samples, evaluation.step_rows, 0, name, evaluation.steps_multiple)


def _sweep_case(backend, training, inference, batch, samples, requested):
  """One run's splits laid out as the loaders do, given to the backend and then to the stand-in.

  Returns the disagreements: steps_per_execution values the application chooses and IPU Keras
  refuses, and refusals (UserError) where IPU Keras would run the request, or some value if derived.
  """
  backend = dataclasses.replace(backend, steps_per_execution=requested)
  layout = backend.layout(batch)
  try:
    train = count_steps(samples[0], layout.step_rows, 0, "train", layout.steps_multiple)
    val, test = (_eval_steps(layout, n, name) for n, name in ((samples[1], "val"), (samples[2], "test")))
  except UserError:
    return []   # a split smaller than one step: refused before steps_per_execution matters
  keras = [backend.fit_input(None, steps)[1] for steps in (train, val, test)]  # Keras' steps
  calls = {"fit": ((train, [val, test]), lambda spe: _fit_refusal(training, *keras, spe)),
           "predict": ((None, [test]), lambda spe: _refusal(inference.check_inference, keras[2], spe))}
  problems = []
  for name, (args, refusal) in calls.items():
    try:
      spe = backend.compile_kwargs(*args)["steps_per_execution"]
    except UserError as error:
      runs = [v for v in ([requested] if requested else range(1, max(keras) + 1)) if not refusal(v)]
      if runs:
        problems.append("%s refused (%s), but IPU Keras runs steps_per_execution=%d"
                        % (name, error, runs[0]))
      continue
    why = refusal(spe)
    if why:
      problems.append("%s chose steps_per_execution=%d, which IPU Keras refuses: %s" % (name, spe, why))
  return problems


@pytest.mark.parametrize("kwargs, poprun", SWEEP_CONFIGS)
def test_the_apps_step_counts_agree_with_the_ipu_keras_rules(monkeypatch, kwargs, poprun):
  """The application accepts exactly the layouts IPU Keras runs: splits trimmed by data/splits.py,
  steps_per_execution requested or derived by the backend, Keras steps from fit_input, checked by the
  stand-in's fit, evaluate and predict."""
  fake_ipu.install(monkeypatch, popdist=fake_ipu.build_popdist(*poprun) if poprun else None)
  backend = ipu_backend.create(_config(**kwargs))
  training, inference = (_tiny_net(backend, inference).ipu_extension for inference in (False, True))
  problems = []
  for batch in (1, 3):
    for train in (96, 200, 1000):
      for evaluation in range(24, 400, 29):
        for requested in (0, 1, 2, 3, 4, 6, 8, 12, 16, 20, 40):
          case = (batch, (train, evaluation, evaluation + 50), requested)
          problems += ["batch, samples, --steps_per_execution = %s: %s" % (case, problem)
                       for problem in _sweep_case(backend, training, inference, *case)]
  assert not problems, "%d disagreements, e.g.\n%s" % (len(problems), "\n".join(problems[:5]))


def _tiny_splits(backend, train_elements, eval_elements):
  """Train, validation and test splits of the tiny model through data/splits.py, in the backend's
  layouts: 2 samples per element, and evaluation targets of 0 for replica 0 and 10 for replica 1."""
  def arrays(elements, rows):
    x, y = next(iter(_elements(elements, rows).batch(elements)))
    return Arrays(x.numpy().reshape(-1, 3), y.numpy().reshape(-1, 1))
  layout = backend.layout(2)
  replicas = backend.local_replicas or backend.replicas
  split = lambda data, split_layout, name: split_from_arrays(  # noqa: E731
      data, split_layout, lambda x, y: (x, y), False, 7, 0, name)
  return Splits(train=split(arrays(train_elements, 2), layout, "train"),
                validation=split(arrays(eval_elements * replicas, 2),
                                 eval_layout(layout, eval_elements * replicas * 2), "val"),
                test=split(arrays(eval_elements * replicas, 2),
                           eval_layout(layout, eval_elements * replicas * 2), "test"),
                source="tiny", input_shape=(3,), num_outputs=1)


@pytest.mark.parametrize("sdk, kwargs, averaged", [
    ("3.x", {"replicas": 2}, True), ("2.6", {"replicas": 2}, False),
    ("3.x", {"replicas": 2, "ipus_per_replica": 2, "pipeline_stages": 2, "gradient_accumulation": 4},
     False)])
def test_reported_losses_are_all_replicas_or_the_log_says_otherwise(monkeypatch, caplog, sdk, kwargs,
                                                                    averaged):
  """Validation and test losses through loop.py's own calls: each replica's losses differ (targets 0 and
  10), and whatever is reported is their mean, or the log says it is one replica's."""
  from training import loop  # pylint: disable=import-outside-toplevel
  caplog.set_level(python_logging.INFO, logger="absl")  # other tests may leave absl's logger at WARNING
  fake_ipu.install(monkeypatch, sdk=sdk)
  # Adam: the legacy optimizer (TF 2.6's family), which takes the backend's gradient_transformers.
  config = _config(epochs=1, optimizer="adam", learning_rate=1e-6, **kwargs)
  backend = ipu_backend.create(config)
  splits = _tiny_splits(backend, train_elements=16, eval_elements=4)
  net = loop.build_and_compile(config, backend, TINY_MODEL, splits)
  history = loop._fit(net, config, backend, splits, 0, 0, callbacks=[])  # pylint: disable=protected-access
  test_x, test_steps = backend.fit_input(splits.test.dataset, splits.test.steps)
  test = net.evaluate(test_x, steps=test_steps, return_dict=True, verbose=0)
  (_, (validation_replicas,), _), (_, (test_replicas,), _) = _calls("evaluate")[-2:]
  said = "one replica's metrics" in caplog.text
  for reported, replicas in ((history["val_loss"][-1], validation_replicas), (test["loss"], test_replicas)):
    losses = [logs["loss"] for logs in replicas]
    assert losses[1] > losses[0] + 50                              # the replicas' figures differ
    mean = sum(losses) / len(losses)
    assert reported == pytest.approx(mean) or said, "one replica's loss reported without a word"
    assert reported == pytest.approx(mean if averaged else losses[-1])
  assert said != averaged


def test_prediction_returns_every_replicas_samples_in_order(monkeypatch):
  """extensions_util.py `merge_into_batch_dimension`; and MEAN, which the application never sets on an
  inference model, would average the replicas' predictions (SDK 3.1+ `_reduce_metric`)."""
  from analysis import evaluation  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2))
  net = _tiny_net(backend, inference=True)
  net.compile(loss="mse", **backend.compile_kwargs(None, [4]))
  dataset, steps = backend.fit_input(_elements(8), 4)
  truth, prediction = evaluation.collect_predictions(net, dataset, steps)
  expected = net(tf.concat([x for x, _ in _elements(8)], 0)).numpy()
  assert truth.shape == prediction.shape == (16, 1) and prediction == pytest.approx(expected, abs=1e-6)
  (_, _, info), = _calls("predict")
  assert info == {"replicas": 2, "steps_per_execution": 4, "reduction": "NONE"}
  net.set_replication_options(replicated_metric_reduction_method="MEAN")
  averaged = net.predict(dataset.map(lambda x, y: x), steps=steps)
  assert averaged[0:2] == pytest.approx(averaged[2:4]) and averaged[0:2] != pytest.approx(expected[0:2])


def test_a_pipelined_run_normalises_by_batch_statistics_and_its_predictions_do_too(monkeypatch, tmp_path,
                                                                                  caplog):
  """--batch_norm_statistics=auto in pipelined training: no moving statistics, which IPU Keras would not
  update (extensions_base.py); run_config.yaml records the choice, so evaluation, which runs the model
  unpipelined (summary.EVAL_OVERRIDES), builds the same layer and restores the checkpoint."""
  import saved_config  # pylint: disable=import-outside-toplevel
  from analysis import evaluation  # pylint: disable=import-outside-toplevel
  from strategies import select  # pylint: disable=import-outside-toplevel
  from strategies.backend import Backend  # pylint: disable=import-outside-toplevel
  from training import checkpoints, loop  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  caplog.set_level(python_logging.INFO, logger="absl")  # other tests may leave absl's logger at WARNING
  config, backend = select.settle(_config(ipus_per_replica=2, pipeline_stages=2, gradient_accumulation=4,
                                          batch_size=4, epochs=1, steps_per_epoch=8, eval_steps=4,
                                          synthetic_data=True, optimizer="adam", learning_rate=1e-3,
                                          lr_schedule="cosine", logdir=str(tmp_path / "run"),
                                          cache_dir=str(tmp_path / "cache")))
  config = model.settle_options(config, backend.hardware)  # as main.py does
  assert config.model_options["batch_norm_statistics"] == "batch"
  summary = loop.run(config, backend)
  # --steps_per_execution=0 stays the setting; the summary has what training compiled with: whole
  # optimizer steps (4 micro-batches each) of the 8-step epoch.
  assert summary["params"]["steps_per_execution"] == 0 and summary["steps_per_execution"] in (4, 8)
  assert "batch's own statistics" in caplog.text and "moving statistics of" not in caplog.text
  path = checkpoints.best_or_last(config.logdir)
  assert not [name for name, _ in tf.train.list_variables(path) if "moving_" in name]
  saved = saved_config.load_run_config(config.logdir)
  assert (saved.pipeline_stages, saved.model_options["batch_norm_statistics"]) == (1, "batch")
  net = evaluation.build_model(saved, (1600, 4), 15, Backend("cpu", tf.distribute.get_strategy(), ("/cpu:0",)))
  evaluation.restore_weights(net, path, (1600, 4), 15)
  assert type(net.get_layer("batch_norm")).__name__ == "BatchStatisticsNormalization"


def test_compile_only_also_compiles_the_test_evaluation(monkeypatch, tmp_path):
  """A pipelined evaluation embeds its iterations in the graph (extensions_base.py
  `_make_ipu_test_function_wrapper`): a test split of another size than the validation split has an
  executable of its own, which --compile_only puts in the cache too."""
  from strategies import select  # pylint: disable=import-outside-toplevel
  from tests.support.cellspike_files import write_cellspike  # pylint: disable=import-outside-toplevel
  from training import loop  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  data_path = write_cellspike(str(tmp_path / "data.h5"), sizes={"train": 64, "val": 16, "test": 24})
  train_in_process(_config(ipus_per_replica=2, pipeline_stages=2, gradient_accumulation=4, batch_size=2,
                           epochs=1, data_path=data_path, optimizer="adam", learning_rate=1e-3, compile_only=True,
                           logdir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache")))
  assert [options["steps_per_execution"] for _, _, options in _calls("evaluate")] == [8, 12]


# --- What the stand-in computes: the replicas, their gradients, accumulation, and the step count -----

def legacy_sgd(learning_rate, **kwargs):
  """Keras' SGD of TensorFlow 2.6 (the SDK's): the OptimizerV2 class, which takes gradient_transformers
  (TensorFlow 2.11 and later keep it as tf.keras.optimizers.legacy.SGD)."""
  return getattr(tf.keras.optimizers, "legacy", tf.keras.optimizers).SGD(learning_rate, **kwargs)


def _mean_gradient_step(initial, elements, learning_rate):
  """The weights after one SGD step with the gradient of the mean loss over `elements` (all alike in
  size), computed with plain Keras: what every backend should train."""
  reference = TINY_MODEL.build(None)
  reference.set_weights(initial)
  x = tf.concat([x for x, _ in elements], 0)
  y = tf.concat([y for _, y in elements], 0)
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(reference(x) - y))
  gradients = tape.gradient(loss, reference.trainable_variables)
  return [w - learning_rate * g.numpy() for w, g in zip(initial, gradients)]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("averaged", [True, False])
def test_ipu_strategy_sums_the_replicas_gradients_and_the_backend_averages_them(monkeypatch, accumulation,
                                                                               averaged):
  """ipu_strategy.py `_reduce_to` sums, num_replicas_in_sync is 1: without the backend's 1/R the
  update is R times the mean-gradient step (so this test fails if the transformer goes)."""
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2, gradient_accumulation=accumulation))
  if not averaged:
    backend = dataclasses.replace(backend, sums_replica_gradients=False)
  net = _tiny_net(backend)
  net.compile(optimizer=legacy_sgd(0.1, **backend.optimizer_kwargs()), loss="mse",
              steps_per_execution=accumulation)
  initial = net.get_weights()
  elements = list(_elements(2 * accumulation))   # one optimizer step: G micro-batches on each replica
  net.fit(_elements(2 * accumulation), steps_per_epoch=2 * accumulation, verbose=0)
  expected = _mean_gradient_step(initial, elements, 0.1)
  assert int(net.optimizer.iterations) == 1
  for trained, start, mean_step in zip(net.get_weights(), initial, expected):
    update = mean_step - start
    assert trained - start == pytest.approx(update if averaged else 2 * update, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("sdk", ["3.x", "2.6"])
def test_popdist_reports_all_replicas_and_keras_divides_the_loss_by_them(monkeypatch, sdk):
  """distributed/popdist_strategy.py (horovod/ on 2.6): num_replicas_in_sync = getNumTotalReplicas(),
  and compile_utils.py divides each replica's loss by it: the sum over all replicas is the mean."""
  fake_ipu.install(monkeypatch, sdk=sdk, popdist=fake_ipu.build_popdist(total_replicas=4, instances=2))
  backend = ipu_backend.create(_config(replicas=4))
  assert backend.strategy.num_replicas_in_sync == 4
  net = _tiny_net(backend)
  net.compile(optimizer=legacy_sgd(0.1, **backend.optimizer_kwargs()), loss="mse")
  initial = net.get_weights()
  net.fit(_elements(2), steps_per_epoch=2, verbose=0)     # this instance's 2 replicas, one element each
  for trained, mean_step in zip(net.get_weights(), _mean_gradient_step(initial, list(_elements(2)), 0.1)):
    assert trained == pytest.approx(mean_step, rel=1e-4, abs=1e-7)


class _Steps(tf.keras.callbacks.Callback):
  """The batch indices and step count a fit's callbacks see."""

  def __init__(self):
    super().__init__()
    self.ends = []

  def on_train_batch_end(self, batch, logs=None):
    self.ends.append(batch)


def test_accumulation_updates_once_per_g_micro_batches_and_callbacks_count_one_replicas_steps(monkeypatch):
  """GradientAccumulationOptimizerV2 applies the Keras optimizer once every G micro-batches, so
  `iterations` (and a schedule of it) counts updates; `_fit_delegate` gives callbacks the steps per
  replica (data_adapter.py `_infer_steps`), at the end of each execution."""
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2, gradient_accumulation=4))
  net = _tiny_net(backend)
  rates = tf.keras.optimizers.schedules.PiecewiseConstantDecay([3], [0.01, 0.0])   # no update after 4
  net.compile(optimizer=legacy_sgd(rates, **backend.optimizer_kwargs()), loss="mse", steps_per_execution=4)
  steps = _Steps()
  net.fit(_elements(32).repeat(), steps_per_epoch=32, epochs=2, callbacks=[steps], verbose=0)
  assert steps.params["steps"] == 16 and steps.ends == [3, 7, 11, 15] * 2
  assert int(net.optimizer.iterations) == 8
  before = net.get_weights()
  net.fit(_elements(32).repeat(), steps_per_epoch=32, verbose=0)   # updates 9 to 12: a rate of 0
  assert all((a == b).all() for a, b in zip(before, net.get_weights()))


def test_each_replica_keeps_its_own_batch_norm_statistics_and_the_host_reads_replica_0s(monkeypatch):
  """Nothing reduces BatchNormalization's moving statistics across IPUStrategy replicas; the host reads
  replica 0's copy (poplar_executor.cc `ConnectReplicatedDeviceToHost`), and writes to all."""
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2))
  with backend.strategy.scope():
    inputs = tf.keras.Input((3,))
    norm = tf.keras.layers.BatchNormalization(momentum=0.5, name="norm")
    net = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(norm(inputs)))
  net.compile(optimizer=legacy_sgd(0.0), loss="mse")
  x = tf.constant([[[1.0] * 3] * 2, [[9.0] * 3] * 2])   # replica 0's element: ones, replica 1's: nines
  net.fit(tf.data.Dataset.from_tensor_slices((x, tf.zeros((2, 2, 1)))), steps_per_epoch=2, verbose=0)
  copies = [[v.numpy() for v in copy] for copy in net.ipu_extension.replicas.state]
  assert norm.moving_mean.numpy() == pytest.approx([0.5] * 3)          # 0.5 * 0 + 0.5 * 1
  assert copies[1][0] == pytest.approx([4.5] * 3)                       # 0.5 * 9
  norm.moving_mean.assign([2.0] * 3)                                    # a host write reaches both
  net.evaluate(tf.data.Dataset.from_tensor_slices((x, tf.zeros((2, 2, 1)))), steps=2, verbose=0)
  assert all(copy[0].numpy() == pytest.approx([2.0] * 3) for copy in net.ipu_extension.replicas.state)


def test_the_stand_ins_replicas_answer_cross_replica_means_with_all_replicas_values(monkeypatch):
  """cross_replica_ops.py `cross_replica_mean` across the replicas the stand-in runs one after the other:
  the backend's shared statistics updates (prepare_model) leave one set, the replicas' mean."""
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2))
  with backend.strategy.scope():
    inputs = tf.keras.Input((3,))
    net = tf.keras.Model(inputs, tf.keras.layers.BatchNormalization(momentum=0.5, name="norm")(inputs))
    net = backend.prepare_model(net, ())
  net.compile(optimizer=legacy_sgd(0.0), loss="mse")
  x = tf.constant([[[1.0] * 3] * 2, [[9.0] * 3] * 2])
  net.fit(tf.data.Dataset.from_tensor_slices((x, tf.zeros((2, 2, 3)))), steps_per_epoch=2, verbose=0)
  for copy in net.ipu_extension.replicas.state:
    assert copy[0].numpy() == pytest.approx([2.5] * 3)                 # 0.5 * 0 + 0.5 * mean(1, 9)
  assert fake_ipu.cross_replica_sum(tf.constant(3.0)) == 3.0            # outside a step: one replica


class _OwnTrainStep(tf.keras.Model):
  def train_step(self, data):
    return super().train_step(data)


class _OwnTestStep(tf.keras.Model):
  def test_step(self, data):
    return super().test_step(data)


def _own_model(backend, cls):
  with backend.strategy.scope():
    inputs = tf.keras.Input((3,))
    x = tf.keras.layers.Dense(4, name="dense")(inputs)
    x = tf.keras.layers.Flatten(name="flatten")(x)
    net = cls(inputs, tf.keras.layers.Dense(1, name="head")(x))
    return backend.prepare_model(net, ("flatten",))


@pytest.mark.parametrize("sdk, kwargs", [("3.x", {}), ("2.6", {"gradient_accumulation": 2}),
                                         ("2.6", {"ipus_per_replica": 2, "pipeline_stages": 2,
                                                  "gradient_accumulation": 4})])
def test_the_stand_in_refuses_an_overridden_train_step(monkeypatch, sdk, kwargs):
  """extensions_base.py `_make_ipu_train_function_wrapper`: always from SDK 3.1; on 2.6 and 3.0 with
  pipelining or gradient accumulation."""
  fake_ipu.install(monkeypatch, sdk=sdk)
  net = _own_model(ipu_backend.create(_config(**kwargs)), _OwnTrainStep)
  net.compile(loss="mse", steps_per_execution=4)
  with pytest.raises(RuntimeError, match="`train_step`.*overridden"):
    net.fit(_elements(4), steps_per_epoch=4, verbose=0)


def test_the_stand_in_refuses_an_overridden_test_step_in_a_pipeline_and_eager_runs(monkeypatch):
  """`_make_ipu_test_function_wrapper` (pipelined models only) and `_check_mode`, which fit, evaluate and
  predict call first."""
  fake_ipu.install(monkeypatch)
  pipelined = _own_model(ipu_backend.create(_config(ipus_per_replica=2, pipeline_stages=2,
                                                    gradient_accumulation=4)), _OwnTestStep)
  pipelined.compile(loss="mse", steps_per_execution=4)
  with pytest.raises(RuntimeError, match="`test_step`.*pipelined"):
    pipelined.evaluate(_elements(4), steps=4, verbose=0)
  net = _own_model(ipu_backend.create(_config()), _OwnTestStep)
  net.compile(loss="mse")
  assert net.evaluate(_elements(4), steps=4, verbose=0) >= 0   # unpipelined: IPU Keras runs it
  net.compile(loss="mse", run_eagerly=True)
  for call in (lambda: net.fit(_elements(4), steps_per_epoch=4, verbose=0),
               lambda: net.evaluate(_elements(4), steps=4, verbose=0),
               lambda: net.predict(_elements(4).map(lambda x, y: x), steps=4)):
    with pytest.raises(RuntimeError, match="cannot run eagerly"):
      call()


def test_the_stand_in_refuses_a_finite_dataset_without_enough_data(monkeypatch):
  """data_adapter.py `IPUDataHandler._validate_dataset`: steps given that are not the dataset's size
  keep one iterator for all epochs, which must hold them all (per replica)."""
  fake_ipu.install(monkeypatch)
  net = _tiny_net(ipu_backend.create(_config(replicas=2)))
  net.compile(optimizer=legacy_sgd(0.01), loss="mse")
  with pytest.raises(ValueError, match=r"enough data.*5 batches"):
    net.fit(_elements(4), steps_per_epoch=2, epochs=5, verbose=0)
  net.fit(_elements(4), steps_per_epoch=4, epochs=5, verbose=0)   # the dataset's size: a new pass each epoch
  with pytest.raises(ValueError, match="does not have enough data"):
    net.evaluate(_elements(4), steps=10, verbose=0)


# --- Throughput: what one Keras step is on IPUs ---------------------------------------------------------

def test_one_keras_step_is_one_micro_batch_per_replica_on_ipus_and_an_optimizer_step_elsewhere(monkeypatch):
  from strategies.backend import Backend  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  ipu = ipu_backend.create(_config(replicas=2, gradient_accumulation=4))
  assert (ipu.samples_per_step(16), ipu.effective_batch(16)) == (32, 128)
  cpu = Backend("cpu", tf.distribute.get_strategy(), ("/cpu:0",), replicas=2, gradient_accumulation=4)
  assert cpu.samples_per_step(16) == cpu.effective_batch(16) == 128


class _Clock:
  """time.perf_counter for training/callbacks.py: one second later at every reading."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    self.now += 1.0
    return self.now


@pytest.mark.parametrize("steps_per_execution", [2, 8])
def test_ipu_throughput_counts_micro_batches_and_says_what_the_first_execution_held(monkeypatch, caplog,
                                                                                  steps_per_execution):
  """8 steps per replica and epoch, 2 replicas of 2 rows, G = 2, the clock one second on per reading:
  with 2 steps per execution the first execution (compilation and 2 steps) is timed alone and each
  epoch's rate counts 4 rows a step; with the epoch in one execution, compile_seconds is unknown and
  epoch 1 has its rate with compilation only."""
  from training import callbacks  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  caplog.set_level(python_logging.INFO, logger="absl")
  monkeypatch.setattr(callbacks, "time", _Clock())
  backend = ipu_backend.create(_config(replicas=2, gradient_accumulation=2))
  net = _tiny_net(backend)
  net.compile(optimizer=legacy_sgd(0.01, **backend.optimizer_kwargs()), loss="mse",
              steps_per_execution=steps_per_execution)
  throughput = callbacks.ThroughputCallback(backend.samples_per_step(2), backend.replicas)
  logger = callbacks.EpochLogger(2, 8, throughput)
  history = net.fit(_elements(16).repeat(), steps_per_epoch=16, epochs=2, callbacks=[throughput, logger],
                    verbose=0).history
  # Readings: train begin 1; epoch 1 begins at 2, its executions end at 3, 4, ...
  if steps_per_execution == 2:
    assert (throughput.compile_seconds, throughput.first_execution_seconds,
            throughput.first_execution_steps) == (None, 2.0, 2)
    assert history["samples_per_sec"] == [6 * 4 / 3.0, 8 * 4 / 4.0]   # not G times these
    assert throughput.samples_per_sec_per_replica == pytest.approx(14 * 4 / 7.0 / 2)
    assert "samples_per_sec_with_compilation" not in history
  else:
    assert (throughput.compile_seconds, throughput.first_execution_seconds,
            throughput.first_execution_steps) == (None, 2.0, 8)
    assert history["samples_per_sec_with_compilation"] == [8 * 4 / 2.0]
    assert history["samples_per_sec"] == [8 * 4 / 1.0]                  # epoch 2 alone
    assert "first execution (8 steps)" in caplog.text and "with compilation" in caplog.text


def test_a_first_execution_of_one_step_is_the_compile_time(monkeypatch):
  """Where an execution is one step (CPUs and GPUs by default), compile_seconds is the first one's."""
  from training import callbacks  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(callbacks, "time", _Clock())
  throughput = callbacks.ThroughputCallback(samples_per_step=64, replicas=2)
  logs = {}
  for call in (throughput.on_train_begin, lambda: throughput.on_epoch_begin(0),
               lambda: throughput.on_train_batch_end(0), lambda: throughput.on_train_batch_end(3),
               lambda: throughput.on_epoch_end(0, logs)):
    call()
  assert (throughput.compile_seconds, throughput.first_execution_steps) == (2.0, 1)
  assert logs["samples_per_sec"] == 3 * 64 / 1.0 and "samples_per_sec_with_compilation" not in logs
