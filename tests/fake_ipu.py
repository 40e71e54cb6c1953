"""A recording stand-in for Graphcore's `tensorflow.python.ipu` (and `popdist`), for tests only.

No IPU and no Graphcore wheel exist on CI machines, so the IPU path is checked against the documented
API (shared/reference/ipu_tf2_keras_api.md) with this stand-in: the same module paths, class and
function signatures, enum names, and the behaviours our code relies on (typed config attributes that
reject unknown names and wrong types, PRE_COMPILE needing a version, the Keras extension methods). Every
call is recorded in `CALLS` so tests can assert on what the application asked for.
"""

import contextlib
import enum
import importlib.abc
import importlib.util
import sys
import types

CALLS = []


def _record(name, *args, **kwargs):
  CALLS.append((name, args, kwargs))


class DeviceConnectionType(enum.Enum):
  ALWAYS = 0
  ON_DEMAND = 1
  PRE_COMPILE = 2
  NEVER = 3


class StochasticRoundingBehaviour(enum.Enum):
  OFF = 0
  ON = 1
  REPLICA_IDENTICAL_ONLY = 2

  @classmethod
  def from_bool(cls, value):
    return cls.ON if value else cls.OFF


class SelectionOrder(enum.Enum):
  AUTO = 0
  ZIGZAG = 1
  SNAKE = 2
  HOOF = 3


class _Category:
  """Typed attributes, as IPUConfig's _ConfigBase: unknown names are ValueError, wrong types TypeError."""

  _types = {}

  def __init__(self, **defaults):
    object.__setattr__(self, "_values", dict(defaults))

  def __getattr__(self, name):
    values = object.__getattribute__(self, "_values")
    if name not in values:
      raise ValueError("'%s' is not a valid attribute of this config." % name)
    return values[name]

  def __setattr__(self, name, value):
    values = object.__getattribute__(self, "_values")
    if name not in values:
      raise ValueError("'%s' is not a valid attribute of this config." % name)
    if isinstance(values[name], _Category):
      raise TypeError("Cannot assign to the category '%s'." % name)
    expected = self._types.get(name, type(values[name]))
    if not isinstance(value, expected):
      raise TypeError("Trying to set %s to %r, but it must be of type %s" % (name, value, expected))
    values[name] = value


class IPUConfig(_Category):
  _types = {"auto_select_ipus": (int, list, tuple), "select_ipus": (int, list, tuple)}

  def __init__(self):
    super().__init__(
        auto_select_ipus=[], select_ipus=[], allow_recompute=False, selection_order=SelectionOrder.AUTO,
        compilation_poplar_options={}, gcl_poplar_options={},
        device_connection=_Category(type=DeviceConnectionType.ALWAYS, version="",
                                    enable_remote_buffers=False),
        ipu_model=_Category(compile_ipu_code=True, tiles_per_ipu=0, version="ipu2"),
        floating_point_behaviour=_Category(inv=False, div0=False, oflo=False, nanoo=False,
                                           esr=StochasticRoundingBehaviour.OFF, set_all=False),
        matmuls=_Category(poplar_options={}, clear_pass_type=False),
        convolutions=_Category(poplar_options={}),
        experimental=_Category(enable_prng_stability=False))

  def configure_ipu_system(self, device="cpu"):
    connection = self.device_connection
    if connection.type in (DeviceConnectionType.PRE_COMPILE, DeviceConnectionType.NEVER) \
        and not connection.version:
      raise ValueError("device_connection.version must be set when device_connection.type is NEVER "
                       "or PRE_COMPILE")
    # tensorflow/python/ipu/config.py _poplar_options_to_protobuf assigns each value to a protobuf
    # string field, which raises TypeError for anything but a string.
    for options in (self.matmuls.poplar_options, self.convolutions.poplar_options,
                    self.compilation_poplar_options, self.gcl_poplar_options):
      if not all(isinstance(v, str) for v in options.values()):
        raise TypeError("Poplar option values must be strings")
    _record("configure_ipu_system", self, device=device)
    if FAIL_CONFIGURE:
      raise RuntimeError(FAIL_CONFIGURE)


FAIL_CONFIGURE = None   # tests set a Poplar error message to simulate a host without IPUs


def reset_ipu_seed(seed, device="/device:IPU:0", cpu_device="cpu", experimental_identical_replicas=False):
  _record("reset_ipu_seed", seed, device=device, cpu_device=cpu_device,
          experimental_identical_replicas=experimental_identical_replicas)


@contextlib.contextmanager
def _keras_extensions_scope():
  """What IPUStrategy.scope() gives Keras (ipu_strategy.py with enable_keras_extensions=True: models
  made in the scope get the IPU extension methods; keras/ipu/extensions): here, every Model made in
  the scope gets the stand-in methods, inside the default strategy's scope."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  original = tf.keras.Model.__init__

  def init(self, *args, **kwargs):
    original(self, *args, **kwargs)
    inject_keras_extensions(self)

  tf.keras.Model.__init__ = init
  try:
    with tf.distribute.get_strategy().scope():
      yield
  finally:
    tf.keras.Model.__init__ = original


class IPUStrategy:
  """IPUStrategyV1: num_replicas_in_sync is 1 whatever the replication."""

  num_replicas_in_sync = 1

  def __init__(self, ipu_device="/device:IPU:0", cpu_device="/device:CPU:0",
               enable_dataset_iterators=True, enable_keras_extensions=True):
    _record("IPUStrategy", ipu_device=ipu_device, cpu_device=cpu_device)

  def scope(self):
    return _keras_extensions_scope()


class PopDistStrategy:
  def __init__(self, ipu_device="/device:IPU:0", add_ipu_cross_replica_reductions=True,
               enable_dataset_iterators=True, enable_keras_extensions=True):
    _record("PopDistStrategy", ipu_device=ipu_device)


class PipelineSchedule(enum.IntEnum):
  Grouped = 0
  Interleaved = 1
  Sequential = 2


class FunctionalLayerPipelineStageAssignment:
  def __init__(self, layer, node_index=0, inbound_layers=(), pipeline_stage=None):
    self.layer, self.node_index, self.inbound_layers = layer, node_index, inbound_layers
    self.pipeline_stage = pipeline_stage


SDK = "3.x"   # the SDK the stand-in plays; `install` sets it
REPLICATED_METRIC_REDUCTIONS = ("NONE", "LIST", "SUM", "MEAN")


def _parse_replicated_metric_reduction(value):
  """keras/ipu/extensions/extensions_base.py (SDK 3.1+) ReplicatedMetricReductionMethod.parse: a
  member, or a string whose upper case names one."""
  if isinstance(value, str) and value.upper() in REPLICATED_METRIC_REDUCTIONS:
    return value.upper()
  raise ValueError("Cannot parse %s as a ReplicatedMetricReductionMethod. Valid values are: NONE, LIST, "
                   "SUM, MEAN." % (value,))


def _parse_accumulation_reduction(value):
  """tensorflow/python/ipu/gradient_accumulation.py GradientAccumulationReductionMethod.parse."""
  if isinstance(value, str) and value.upper() in ("SUM", "MEAN", "RUNNING_MEAN"):
    return value.upper()
  raise ValueError("Cannot parse %s as one of GradientAccumulationReductionMethod. Valid values are: "
                   "SUM, MEAN, RUNNING_MEAN." % (value,))


def _check_accumulation_count(count):
  """keras/ipu/extensions/extensions_base.py `_set_pipelining_options_impl` and
  `_set_gradient_accumulation_options_impl` (None leaves the setting alone)."""
  if count is not None and (not isinstance(count, int) or count < 1):
    raise ValueError("Expected `gradient_accumulation_steps_per_replica` to be a positive integer, but got "
                     "%s instead." % (count,))


# extensions_base.py `_set_pipelining_options_impl`: keys of pipelining_kwargs that Keras refuses.
_EXPLICIT_PIPELINING_ARGS = ("gradient_accumulation_count", "device_mapping", "accumulate_outfeed")
_AUTOMATIC_PIPELINING_ARGS = ("computational_stages", "repeat_count", "inputs", "infeed_queue",
                              "outfeed_queue", "optimizer_function")
_INVALID_PIPELINING_ARGS = ("outfeed_loss", "outfeed_mask", "batch_serialization_iterations",
                            "experimental_normalize_gradients")


def inject_keras_extensions(model):
  """What IPUStrategy.scope() does to a functional model: add the IPU extension methods [3.1]."""
  state = {"assignment": None}

  def get_pipeline_stage_assignment():
    # Post-order of the functional graph: the model's layers minus the input layer.
    return [FunctionalLayerPipelineStageAssignment(layer) for layer in model.layers[1:]]

  def set_pipeline_stage_assignment(assignments):
    if any(a.pipeline_stage is None for a in assignments):
      raise ValueError("every layer needs a pipeline stage")
    state["assignment"] = {a.layer.name: a.pipeline_stage for a in assignments}
    _record("set_pipeline_stage_assignment", state["assignment"])

  def set_pipelining_options(gradient_accumulation_steps_per_replica=None, device_mapping=None,
                             accumulate_outfeed=None, gradient_accumulation_reduction_method="sum",
                             **pipelining_kwargs):
    _parse_accumulation_reduction(gradient_accumulation_reduction_method)
    _check_accumulation_count(gradient_accumulation_steps_per_replica)
    if device_mapping is not None and not (isinstance(device_mapping, list)
                                           and all(isinstance(x, int) for x in device_mapping)):
      raise ValueError("Expected `device_mapping` to be a list of integers.")
    for key in _EXPLICIT_PIPELINING_ARGS + _AUTOMATIC_PIPELINING_ARGS + _INVALID_PIPELINING_ARGS:
      if key in pipelining_kwargs:
        raise ValueError("Found `%s` key in `pipelining_kwargs`." % key)
    _record("set_pipelining_options", gradient_accumulation_steps_per_replica=
            gradient_accumulation_steps_per_replica, device_mapping=device_mapping,
            gradient_accumulation_reduction_method=gradient_accumulation_reduction_method,
            **pipelining_kwargs)

  def set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=None,
                                        gradient_accumulation_reduction_method="sum",
                                        **gradient_accumulation_optimizer_kwargs):
    _parse_accumulation_reduction(gradient_accumulation_reduction_method)
    _check_accumulation_count(gradient_accumulation_steps_per_replica)
    _record("set_gradient_accumulation_options", gradient_accumulation_steps_per_replica=
            gradient_accumulation_steps_per_replica,
            gradient_accumulation_reduction_method=gradient_accumulation_reduction_method,
            **gradient_accumulation_optimizer_kwargs)

  def set_replication_options(replicated_metric_reduction_method="NONE"):
    _record("set_replication_options", _parse_replicated_metric_reduction(replicated_metric_reduction_method))

  if SDK not in ("2.6", "3.0"):  # from SDK 3.1: functional_extensions.py, sequential_extensions.py
    model.set_replication_options = set_replication_options
  model.get_pipeline_stage_assignment = get_pipeline_stage_assignment
  model.set_pipeline_stage_assignment = set_pipeline_stage_assignment
  model.set_pipelining_options = set_pipelining_options
  model.set_gradient_accumulation_options = set_gradient_accumulation_options
  return model


def _module(name, **attributes):
  module = types.ModuleType(name)
  module.__dict__.update(attributes)
  return module


OTHER_INSTANCES_FLAGGED = 0   # what the other poprun instances add to a host all-reduce (tests set it)


def _host_allreduce(name, value):
  _record(name, float(value))
  return value + OTHER_INSTANCES_FLAGGED


def _horovod_module(popdist_strategy):
  """SDK 2.6 `tensorflow.python.ipu.horovod`: `allreduce(tensor, op=None, prescale_factor=1.0,
  postscale_factor=1.0)` (horovod/__init__.py; the default op is Average) raises until `init()` was
  called (horovod/basics.py: "Horovod has not been initialized; use hvd.init().")."""
  state = {"initialised": False}

  def init():
    state["initialised"] = True
    _record("horovod.init")

  def allreduce(tensor, op=None, prescale_factor=1.0, postscale_factor=1.0):
    del prescale_factor, postscale_factor
    if not state["initialised"]:
      raise ValueError("Horovod has not been initialized; use hvd.init().")
    if op != "Sum":
      raise AssertionError("the stand-in sums only; the default op averages")
    return _host_allreduce("horovod.allreduce", tensor)

  return _module("tensorflow.python.ipu.horovod", popdist_strategy=popdist_strategy, init=init,
                 allreduce=allreduce, Sum="Sum", Average="Average")


def _host_collective_ops(sdk):
  """SDK 3.x `tensorflow.python.ipu.distributed.host_collective_ops`: `allreduce(value, reduce_op,
  tensor_name=None)` from 3.1; SDK 3.0 spells it `all_reduce` (host_collective_ops.py of each branch)."""
  def allreduce(value, reduce_op, tensor_name=None):
    del tensor_name
    if reduce_op != tf_reduce_op().SUM:
      raise AssertionError("the stand-in sums only")
    return _host_allreduce("host_collective_ops.allreduce", value)
  name = "all_reduce" if sdk == "3.0" else "allreduce"
  return _module("tensorflow.python.ipu.distributed.host_collective_ops", **{name: allreduce})


def tf_reduce_op():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.distribute.ReduceOp


def build_modules(sdk="3.x"):
  """The stand-in module tree: {module name: module}; sdk="2.6" puts PopDist under horovod, "3.0" and
  "3.x" (3.1 and later) under distributed."""
  config = _module("tensorflow.python.ipu.config", IPUConfig=IPUConfig,
                   DeviceConnectionType=DeviceConnectionType, SelectionOrder=SelectionOrder,
                   StochasticRoundingBehaviour=StochasticRoundingBehaviour)
  utils = _module("tensorflow.python.ipu.utils", reset_ipu_seed=reset_ipu_seed)
  strategy = _module("tensorflow.python.ipu.ipu_strategy", IPUStrategy=IPUStrategy,
                     IPUStrategyV1=IPUStrategy)
  pipelining = _module("tensorflow.python.ipu.ops.pipelining_ops", PipelineSchedule=PipelineSchedule)
  ops = _module("tensorflow.python.ipu.ops", pipelining_ops=pipelining)
  ipu = _module("tensorflow.python.ipu", config=config, utils=utils, ipu_strategy=strategy, ops=ops)
  modules = {"tensorflow.python.ipu": ipu, "tensorflow.python.ipu.config": config,
             "tensorflow.python.ipu.utils": utils, "tensorflow.python.ipu.ipu_strategy": strategy,
             "tensorflow.python.ipu.ops": ops, "tensorflow.python.ipu.ops.pipelining_ops": pipelining}
  popdist_strategy = _module("popdist_strategy", PopDistStrategy=PopDistStrategy)
  if sdk == "2.6":
    horovod = _horovod_module(popdist_strategy)
    modules.update({"tensorflow.python.ipu.horovod": horovod,
                    "tensorflow.python.ipu.horovod.popdist_strategy": popdist_strategy})
  else:
    collectives = _host_collective_ops(sdk)
    distributed = _module("tensorflow.python.ipu.distributed", popdist_strategy=popdist_strategy,
                          host_collective_ops=collectives)
    modules.update({"tensorflow.python.ipu.distributed": distributed,
                    "tensorflow.python.ipu.distributed.popdist_strategy": popdist_strategy,
                    "tensorflow.python.ipu.distributed.host_collective_ops": collectives})
  return modules


def build_popdist(total_replicas=4, instances=2, index=0):
  """A stand-in `popdist` as poprun sets it up [4.2].

  `popdist.tensorflow` is a submodule that `import popdist` does not bind (popdist's package
  __init__; every Graphcore caller imports it explicitly: examples' vision/cnns/tensorflow2/
  ipu_config.py, keras' keras/ipu/distributed_test.py): `install` makes it importable, and only
  importing it sets the attribute, as Python's import system does for a real package.
  """
  set_ipu_config = lambda config, ipus_per_replica=1, configure_device=True: _record(  # noqa: E731
      "popdist.set_ipu_config", config, ipus_per_replica=ipus_per_replica,
      configure_device=configure_device)
  tensorflow = _module("popdist.tensorflow", set_ipu_config=set_ipu_config)
  popdist = _module("popdist", __path__=[], isPopdistEnvSet=lambda: True,
                    getNumTotalReplicas=lambda: total_replicas, getNumInstances=lambda: instances,
                    getInstanceIndex=lambda: index,
                    getNumLocalReplicas=lambda: total_replicas // instances)
  return {"popdist": popdist, "popdist.tensorflow": tensorflow}


class AdamIpuOptimizer:
  def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
               name="Adam", m_dtype=None, v_dtype=None, vhat_dtype=None, debiasing=True, **kwargs):
    _record("AdamIpuOptimizer", learning_rate=learning_rate, m_dtype=m_dtype, v_dtype=v_dtype, **kwargs)


class SGDIpuOptimizer:
  def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD",
               momentum_accum_dtype=None, **kwargs):
    _record("SGDIpuOptimizer", learning_rate=learning_rate, momentum_accum_dtype=momentum_accum_dtype,
            **kwargs)


def _ipu_dropout_class():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  class Dropout(tf.keras.layers.Layer):
    """ipu_tensorflow_addons keras/layers/dropout.py: (rate, noise_shape=None, seed=None); the seed
    goes to tensorflow/python/ipu/ops/rand_ops.py `dropout`, which takes a pair of 32-bit ints."""

    def __init__(self, rate, noise_shape=None, seed=None, **kwargs):
      if seed is not None and len(seed) != 2:
        raise ValueError("seed must be a two-element tensor-like object, got %r" % (seed,))
      _record("ipu_layers.Dropout", rate, noise_shape=noise_shape, seed=seed, layer_name=kwargs.get("name"))
      self.rate, self.noise_shape, self.seed = rate, noise_shape, seed
      super().__init__(**kwargs)

    def call(self, inputs, training=None):
      return tf.nn.dropout(inputs, self.rate, noise_shape=self.noise_shape) if training else inputs

  return Dropout


def build_addons():
  """A stand-in `ipu_tensorflow_addons`: its optimizers and its Dropout layer [7]."""
  optimizers = _module("ipu_tensorflow_addons.keras.optimizers", AdamIpuOptimizer=AdamIpuOptimizer,
                       SGDIpuOptimizer=SGDIpuOptimizer)
  layers = _module("ipu_tensorflow_addons.keras.layers", Dropout=_ipu_dropout_class())
  keras = _module("ipu_tensorflow_addons.keras", optimizers=optimizers, layers=layers)
  return {"ipu_tensorflow_addons": _module("ipu_tensorflow_addons", keras=keras),
          "ipu_tensorflow_addons.keras": keras, "ipu_tensorflow_addons.keras.optimizers": optimizers,
          "ipu_tensorflow_addons.keras.layers": layers}


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Makes prepared submodules importable; the import system then binds them to their parent."""

  def __init__(self, modules):
    self.modules = modules

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    return importlib.util.spec_from_loader(fullname, self) if fullname in self.modules else None

  def create_module(self, spec):
    return self.modules[spec.name]

  def exec_module(self, module):
    pass


def install(monkeypatch, sdk="3.x", popdist=None):
  """Puts the stand-in into sys.modules for one test; returns the `ipu` module."""
  CALLS.clear()
  monkeypatch.setattr(sys.modules[__name__], "OTHER_INSTANCES_FLAGGED", 0)
  monkeypatch.setattr(sys.modules[__name__], "SDK", sdk)
  modules = build_modules(sdk)
  submodules = {}
  if popdist:
    submodules["popdist.tensorflow"] = popdist.pop("popdist.tensorflow")
    modules.update(popdist)
  for name, module in modules.items():
    monkeypatch.setitem(sys.modules, name, module)
  for name in submodules:   # absent now, and removed again after the test (importing adds it)
    monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setattr(sys, "meta_path", [_SubmoduleFinder(submodules)] + sys.meta_path)
  return modules["tensorflow.python.ipu"]
