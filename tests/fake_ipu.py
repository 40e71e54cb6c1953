"""A recording stand-in for Graphcore's `tensorflow.python.ipu` (and `popdist`), for tests only.

No IPU and no Graphcore wheel exist on CI machines, so the IPU path is checked against the documented
API (shared/reference/ipu_tf2_keras_api.md) with this stand-in: the same module paths, class and
function signatures, enum names, and the behaviours our code relies on (typed config attributes that
reject unknown names and wrong types, PRE_COMPILE needing a version, the Keras extension methods). Every
call is recorded in `CALLS` so tests can assert on what the application asked for.
"""

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
    for category in (self.matmuls, self.convolutions):
      if not all(isinstance(v, str) for v in category.poplar_options.values()):
        raise TypeError("Poplar option values must be strings")
    _record("configure_ipu_system", self, device=device)
    if FAIL_CONFIGURE:
      raise RuntimeError(FAIL_CONFIGURE)


FAIL_CONFIGURE = None   # tests set a Poplar error message to simulate a host without IPUs


def reset_ipu_seed(seed, device="/device:IPU:0", cpu_device="cpu", experimental_identical_replicas=False):
  _record("reset_ipu_seed", seed, device=device, cpu_device=cpu_device,
          experimental_identical_replicas=experimental_identical_replicas)


class IPUStrategy:
  """IPUStrategyV1: num_replicas_in_sync is 1 whatever the replication."""

  num_replicas_in_sync = 1

  def __init__(self, ipu_device="/device:IPU:0", cpu_device="/device:CPU:0",
               enable_dataset_iterators=True, enable_keras_extensions=True):
    _record("IPUStrategy", ipu_device=ipu_device, cpu_device=cpu_device)


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
    if not isinstance(gradient_accumulation_steps_per_replica, int) \
        or gradient_accumulation_steps_per_replica < 1:
      raise ValueError("gradient_accumulation_steps_per_replica must be a positive integer")
    _record("set_pipelining_options", gradient_accumulation_steps_per_replica=
            gradient_accumulation_steps_per_replica, device_mapping=device_mapping,
            gradient_accumulation_reduction_method=gradient_accumulation_reduction_method,
            **pipelining_kwargs)

  def set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=None,
                                        gradient_accumulation_reduction_method="sum",
                                        **gradient_accumulation_optimizer_kwargs):
    _record("set_gradient_accumulation_options", gradient_accumulation_steps_per_replica=
            gradient_accumulation_steps_per_replica,
            gradient_accumulation_reduction_method=gradient_accumulation_reduction_method,
            **gradient_accumulation_optimizer_kwargs)

  model.get_pipeline_stage_assignment = get_pipeline_stage_assignment
  model.set_pipeline_stage_assignment = set_pipeline_stage_assignment
  model.set_pipelining_options = set_pipelining_options
  model.set_gradient_accumulation_options = set_gradient_accumulation_options
  return model


def _module(name, **attributes):
  module = types.ModuleType(name)
  module.__dict__.update(attributes)
  return module


def build_modules(sdk="3.x"):
  """The stand-in module tree: {module name: module}; sdk="2.6" puts PopDist under horovod."""
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
    horovod = _module("tensorflow.python.ipu.horovod", popdist_strategy=popdist_strategy,
                      init=lambda: _record("horovod.init"))
    modules.update({"tensorflow.python.ipu.horovod": horovod,
                    "tensorflow.python.ipu.horovod.popdist_strategy": popdist_strategy})
  else:
    distributed = _module("tensorflow.python.ipu.distributed", popdist_strategy=popdist_strategy)
    modules.update({"tensorflow.python.ipu.distributed": distributed,
                    "tensorflow.python.ipu.distributed.popdist_strategy": popdist_strategy})
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
