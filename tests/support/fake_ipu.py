"""A recording stand-in for Graphcore's `tensorflow.python.ipu` (and `popdist`), for tests only.

No IPU and no Graphcore wheel exist on CI machines, so the IPU path is checked against the documented
API (shared/reference/ipu_tf2_keras_api.md) with this stand-in: the same module paths, class and
function signatures, enum names, and the behaviours our code relies on (typed config attributes that
reject unknown names and wrong types, PRE_COMPILE needing a version, the Keras extension methods). Every
call is recorded in `CALLS` so tests can assert on what the application asked for.

Models made in `IPUStrategy.scope()` also get IPU Keras' fit, evaluate and predict (`_Extension`): the
data handler's steps_per_execution rules, the pipeline's iteration count, the replication factor, and
metrics that are one replica's unless reduced across replicas. Each rule names the Graphcore source it
follows (graphcore/keras and graphcore/tensorflow, branches r2.6/sdk-release-2.6 to -3.4).
"""

import contextlib
import enum
import importlib.abc
import importlib.util
import math
import sys
import types

import numpy as np

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
      # tensorflow/python/ipu/config.py `_ConfigBase._setattr`: a bare Exception, not a TypeError.
      raise Exception("%s is a category and cannot be assigned to." % name)  # pylint: disable=broad-exception-raised
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
    if isinstance(self.auto_select_ipus, int) and self.auto_select_ipus:  # poprun's are set by popdist
      SYSTEM["ipus"] = self.auto_select_ipus


FAIL_CONFIGURE = None   # tests set a Poplar error message to simulate a host without IPUs
SYSTEM = {"ipus": 0}    # this instance's IPUs once configured (IPU Keras' replication reads them)


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
  """distributed/popdist_strategy.py (horovod/ on SDK 2.6): a StrategyV1 with KerasExtensions, so its
  scope() gives models the IPU Keras methods as IPUStrategy's does."""

  def __init__(self, ipu_device="/device:IPU:0", add_ipu_cross_replica_reductions=True,
               enable_dataset_iterators=True, enable_keras_extensions=True):
    _record("PopDistStrategy", ipu_device=ipu_device)

  def scope(self):
    return _keras_extensions_scope()


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


def _inbound_layers(node) -> list:
  """The layers whose outputs a Keras node takes (a list in every Keras version)."""
  inbound = node.inbound_layers
  return list(inbound) if isinstance(inbound, (list, tuple)) else [inbound]


# --- IPU Keras' data handling and pipelines: the rules fit, evaluate and predict apply ---------------

def _keras_steps(data, steps):
  """The steps Keras' `DataHandler._infer_steps` (keras/engine/data_adapter.py) takes for a call: those
  given, else the dataset's known size; an endless one needs steps, and IPUDataHandler._infer_steps
  refuses an unknown size. Every element's shape must be static (keras/ipu/extensions/data_adapter.py
  `IPUDataHandler._validate_dataset`)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if not isinstance(data, tf.data.Dataset):
    raise TypeError("the stand-in runs tf.data datasets of (x, y) or x, as the application passes them")
  for spec in tf.nest.flatten(data.element_spec):  # IPUDataHandler._validate_dataset (infeeds)
    if not spec.shape.is_fully_defined():
      raise ValueError("The provided set of data contains a shape %s which is not fully defined. Executing "
                       "on IPU requires all dataset elements to have fully defined shapes. If using "
                       "batch() make sure to set `drop_remainder=True`." % spec.shape)
  if steps is not None:
    return steps
  size = int(data.cardinality())
  if size == int(tf.data.INFINITE_CARDINALITY):
    raise ValueError("When passing an infinitely repeating dataset, please specify a `steps_per_epoch` "
                     "value so that epoch level callbacks continue to work.")
  if size < 0:
    raise ValueError("Could not infer the size of the data. You must specify the number of steps to run.")
  return size


def data_handler_steps(steps, replication_factor, steps_per_execution):
  """(steps per replica, steps per execution) as IPU Keras' data handler accepts them, else ValueError.

  keras/ipu/extensions/data_adapter.py `IPUDataHandler` (the same file from SDK 2.6 to 3.4):
  `_infer_steps` divides the steps given to fit/evaluate/predict among the replicas, dropping any
  remainder. `_validate_data_handler` runs inside keras/engine/data_adapter.py
  `DataHandler._truncate_execution_to_epoch`, which lowers steps_per_execution to the steps when it is
  larger, and requires what is left to divide them. Every execution runs that truncated value
  (`enumerate_epochs_with_reuse` truncates the same way), so it is what we return.
  """
  inferred = steps // replication_factor
  if inferred == 0:
    raise ValueError("The provided dataset contains %d items, but all %d replicas are requested to run %d "
                     "steps each. Make sure the dataset contains at least %d items."
                     % (steps, replication_factor, 1, replication_factor))
  per_execution = min(steps_per_execution, inferred)
  if inferred % per_execution:
    raise ValueError("`steps_per_execution` (%d) must be a divisor of the number of batches (%d) in the "
                     "dataset provided%s." % (per_execution, inferred,
                                              " to this replica" if replication_factor > 1 else ""))
  return inferred, per_execution


def _circular_union(mapping):
  """pipeline_visitor_utils.h `CircularUnion`: rotation 0, then every rotation of the mapping that puts
  a different device at each position than all the rotations accepted before it."""
  rotated = lambda k: mapping[k:] + mapping[:k]  # noqa: E731
  offsets = [0]
  for shift in range(1, len(mapping)):
    if all(a != b for k in offsets for a, b in zip(rotated(k), rotated(shift))):
      offsets.append(shift)
  return offsets


def pipeline_overlap(schedule, device_mapping, training):
  """The overlap length poplar checks a pipeline's iteration count against.

  tensorflow/compiler/plugin/poplar/driver/visitors/pipeline_visitor.cc: the stage mapping is the
  forward stages' devices, then the backward stages' in reverse (`GetPipelineStageDeviceMapping`;
  inference has no backward stages), and the length is `ScheduleOffsets(mapping).size()`
  (pipeline_visitor_utils.h: AllUnion, every offset, for Grouped; CircularUnion for Interleaved;
  NoUnion, one offset, for Sequential).
  """
  mapping = list(device_mapping) + (list(device_mapping)[::-1] if training else [])
  if schedule == PipelineSchedule.Grouped:
    return len(mapping)
  if schedule == PipelineSchedule.Interleaved:
    return len(_circular_union(mapping))
  return 1


def verify_pipeline_iterations(iterations, overlap):
  """pipeline_visitor.cc `VerifyPipelineArgumentsFixed`, a FailedPrecondition when the pipeline is
  compiled. `iterations` is the pipeline's gradient_accumulation_count."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  context = ("This number might be called `gradient_accumulation_count`, "
             "`gradient_accumulation_steps_per_replica` or `steps_per_execution` depending on the API "
             "used.")
  rule = ("a multiple of" if iterations % overlap else "at least" if iterations < overlap else None)
  if rule:
    raise tf.errors.FailedPreconditionError(None, None, "The number of iterations of the pipeline must be "
                                            "%s %d, but it is %d. %s" % (rule, overlap, iterations, context))


def _reduce_logs(per_replica, method):
  """The metrics evaluate returns: extensions_base.py `_get_last_batch_results` keeps the last replica's
  (x[-1] over the replica axis) and, from SDK 3.1, `_reduce_metric` first combines them across the
  replicas (LIST: all_gather; SUM, MEAN: cross_replica_sum, cross_replica_mean)."""
  if method == "NONE":
    return dict(per_replica[-1])
  values = {name: [float(logs[name]) for logs in per_replica] for name in per_replica[-1]}
  if method == "LIST":
    return values
  scale = 1.0 if method == "SUM" else 1.0 / len(per_replica)
  return {name: sum(v) * scale for name, v in values.items()}


def _results_list(model, logs):
  """evaluate(return_dict=False) in `_evaluate_delegate`: metrics_names order, then the rest sorted."""
  results = [logs[name] for name in model.metrics_names if name in logs]
  results += [logs[key] for key in sorted(logs) if key not in model.metrics_names]
  return results[0] if len(results) == 1 else results


class _Extension:
  """What IPUStrategy.scope() adds to a functional model [3.1] (keras/ipu/extensions/
  functional_extensions.py over extensions_base.py): the setters our code calls, and fit, evaluate
  and predict with IPU Keras' checks.

  keras/engine/base_layer.py `extension_delegate` sends Model.fit/evaluate/predict to the extension's
  `_fit_delegate`, `_evaluate_delegate` and `_predict_delegate`; here the model's own methods are
  replaced (instance attributes), so Keras' fit also validates through `evaluate` below. The checks
  run first, then Keras computes on the CPU what the replicas would (see `evaluate`).
  """

  def __init__(self, model):
    self.model = model
    self.assignment = None                # layer name -> stage; `_is_pipelined` once it is set
    self.device_mapping = None
    self.schedule = PipelineSchedule.Grouped   # pipelining_ops.py `pipeline`'s default
    self.pipelining_accumulation = None   # `_pipelining_gradient_accumulation_steps_per_replica`
    self.accumulation = None              # `_gradient_accumulation_steps_per_replica`
    self.metric_reduction = "NONE"        # extensions_base.py (3.1+) `__init__`
    self.steps_per_execution = 1          # compile()'s; Keras' default is 1
    self._keras = {name: getattr(type(model), name).__get__(model)
                   for name in ("compile", "fit", "evaluate", "predict")}

  # The setters our code calls.

  def get_pipeline_stage_assignment(self):
    # Post-order of the functional graph: the model's layers minus the input layer.
    return [FunctionalLayerPipelineStageAssignment(layer) for layer in self.model.layers[1:]]

  def set_pipeline_stage_assignment(self, assignments):
    """keras/ipu/extensions/functional_extensions.py `_get_pipelined_post_order`: one assignment per
    layer, in the order `get_pipeline_stage_assignment` gave, each with a stage, and no layer may take
    an input from a later stage."""
    layers = self.model.layers[1:]
    if len(assignments) != len(layers):
      raise ValueError("The length of the provided `pipeline_stage_assignment` (%d) does not match the "
                       "number of layers in the graph (%d). Each layer needs to be assigned a pipeline "
                       "stage (excluding input layers)." % (len(assignments), len(layers)))
    for assignment, layer in zip(assignments, layers):
      if assignment.layer is not layer:
        raise ValueError("The order of `pipeline_stage_assignment` does not match the post-order "
                         "generated from the graph (%s != %s)." % (assignment.layer.name, layer.name))
      if assignment.pipeline_stage is None:
        raise ValueError("Layer %s with node_index 0 has not been assigned a pipeline stage in "
                         "`pipeline_stage_assignment`." % layer.name)
    stages = {a.layer.name: a.pipeline_stage for a in assignments}
    for layer in layers:
      inputs = [inbound.name for node in layer.inbound_nodes for inbound in _inbound_layers(node)]
      if any(stages.get(name, 0) > stages[layer.name] for name in inputs):
        raise ValueError("Layer %s in pipeline stage %d has a dependency from a pipeline stage which has "
                         "not yet been executed. Layers can only use outputs from current or previous "
                         "pipeline stages." % (layer.name, stages[layer.name]))
    self.assignment = stages
    _record("set_pipeline_stage_assignment", self.assignment)

  def set_pipelining_options(self, gradient_accumulation_steps_per_replica=None, device_mapping=None,
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
    if gradient_accumulation_steps_per_replica is not None:  # None leaves each setting alone
      self.pipelining_accumulation = gradient_accumulation_steps_per_replica
    if device_mapping is not None:
      self.device_mapping = device_mapping
    # Each call replaces all pipelining kwargs (extensions_base.py `_set_pipelining_options_impl`:
    # `self._pipelining_kwargs = pipelining_kwargs`): a call without a schedule means Grouped again.
    self.schedule = pipelining_kwargs.get("pipeline_schedule", PipelineSchedule.Grouped)
    _record("set_pipelining_options", gradient_accumulation_steps_per_replica=
            gradient_accumulation_steps_per_replica, device_mapping=device_mapping,
            gradient_accumulation_reduction_method=gradient_accumulation_reduction_method,
            **pipelining_kwargs)

  def set_gradient_accumulation_options(self, gradient_accumulation_steps_per_replica=None,
                                        gradient_accumulation_reduction_method="sum",
                                        **gradient_accumulation_optimizer_kwargs):
    _parse_accumulation_reduction(gradient_accumulation_reduction_method)
    _check_accumulation_count(gradient_accumulation_steps_per_replica)
    if gradient_accumulation_steps_per_replica is not None:
      self.accumulation = gradient_accumulation_steps_per_replica
    _record("set_gradient_accumulation_options", gradient_accumulation_steps_per_replica=
            gradient_accumulation_steps_per_replica,
            gradient_accumulation_reduction_method=gradient_accumulation_reduction_method,
            **gradient_accumulation_optimizer_kwargs)

  def set_replication_options(self, replicated_metric_reduction_method="NONE"):
    self.metric_reduction = _parse_replicated_metric_reduction(replicated_metric_reduction_method)
    _record("set_replication_options", self.metric_reduction)

  # Placement: pipeline and replicas.

  def pipelined(self):
    """functional_extensions.py `_is_pipelined`: a stage assignment has been set."""
    return bool(self.assignment)

  def stages(self):
    return max(self.assignment.values()) + 1

  def mapping(self):
    """The pipeline's devices: device_mapping, else stage i on IPU i (pipelining_ops.py `pipeline`)."""
    return self.device_mapping if self.device_mapping is not None else list(range(self.stages()))

  def replication_factor(self):
    """extensions_base.py `_get_replication_factor`: this instance's IPUs (`_get_num_ipus`: the device's
    over popdist.getNumInstances()) over the shard count rounded up to a power of two
    (`_get_shard_count`: max(device_mapping) + 1 when pipelined, else 1, whatever the IPUs per replica)."""
    ipus = SYSTEM["ipus"]
    if not ipus:
      raise ValueError(type(self.model).__name__ + " can only be used on an IPU device.")
    shards = max(self.mapping()) + 1 if self.pipelined() else 1
    rounded = 2 ** int(math.ceil(math.log2(shards)))
    if shards > ipus:
      raise ValueError("Current device has %d IPUs attached, however the current model requires a multiple "
                       "of %d IPUs." % (ipus, rounded))
    return ipus // rounded

  def check_pipeline(self, iterations, training):
    """What building and compiling the pipeline checks: pipelining_ops.py `pipeline` (two stages or
    more, one device each, no Interleaved training with stages sharing an IPU), then poplar's iteration
    count (`verify_pipeline_iterations`)."""
    mapping, stages = self.mapping(), self.stages()
    if stages < 2:
      raise ValueError("Pipeline requires at least two computational stages.")
    if len(mapping) != stages:
      raise ValueError("Each stage must be mapped to an IPU: %d mappings != %d stages"
                       % (len(mapping), stages))
    if training and self.schedule == PipelineSchedule.Interleaved and len(set(mapping)) != len(mapping):
      raise NotImplementedError("The pipelining schedule 'Interleaved' does not currently support multiple "
                                "pipeline stages on the same device for training graphs. Please use a "
                                "different pipeline schedule.")
    verify_pipeline_iterations(iterations, pipeline_overlap(self.schedule, mapping, training))

  # The checks of fit, evaluate and predict.

  def accumulation_count(self, steps_per_execution):
    """extensions_base.py `_verify_and_get_gradient_accumulation_steps_per_replica`, which fit calls
    twice: with compile()'s steps_per_execution in `_log_optimizer_batch_size`, before the data handler
    truncates it (keras/engine/data_adapter.py `_truncate_execution_to_epoch` restores it after each
    use), and in `_fit_delegate`'s epoch loop with the value truncated to the epoch's steps."""
    kind = "pipelined " if self.pipelined() else ""
    count = self.pipelining_accumulation if self.pipelined() else self.accumulation
    if count is None:
      if self.pipelined():
        raise ValueError("The model which you are attempting to train is pipelined, however "
                         "`gradient_accumulation_steps_per_replica` has not been set through "
                         "`set_pipelining_options()`.")
      return 1
    if steps_per_execution % count:
      raise RuntimeError("The %smodel has been configured to use gradient accumulation for training, "
                         "however the current `steps_per_execution` value (set to %d) is not divisible by "
                         "`gradient_accumulation_steps_per_replica` (%d)."
                         % (kind, steps_per_execution, count))
    return count

  def check_fit(self, steps, validation_steps=None, steps_per_execution=None):
    """What `_fit_delegate` refuses, for `steps` (and `validation_steps`) as given to fit; returns the
    training steps per execution. `steps_per_execution` defaults to compile()'s."""
    requested = steps_per_execution or self.steps_per_execution
    self.accumulation_count(requested)  # `_log_optimizer_batch_size`: the value as compiled
    _, per_execution = data_handler_steps(steps, self.replication_factor(), requested)
    accumulation = self.accumulation_count(per_execution)
    if self.pipelined():  # the training pipeline accumulates over `accumulation` iterations
      self.check_pipeline(accumulation, training=True)
    if validation_steps is not None:
      # `_fit_delegate` makes the validation data handler with IPUDataHandler's default
      # replication_factor=1 (at the first validation, after an epoch of training): the validation
      # steps of all replicas together are checked first, then per replica by evaluate.
      data_handler_steps(validation_steps, 1, requested)
      self.check_inference(validation_steps, requested)
    return per_execution

  def check_inference(self, steps, steps_per_execution=None):
    """What `_evaluate_delegate` and `_predict_delegate` refuse; returns (replication factor, steps per
    replica, steps per execution). A pipelined model's inference pipeline has
    gradient_accumulation_count = the truncated steps_per_execution and repeat_count 1
    (extensions_base.py `_make_pipeline_ipu_test_function`, `_make_pipeline_ipu_predict_function`)."""
    replicas = self.replication_factor()
    inferred, per_execution = data_handler_steps(steps, replicas,
                                                 steps_per_execution or self.steps_per_execution)
    if self.pipelined():
      self.check_pipeline(per_execution, training=False)
    return replicas, inferred, per_execution

  def reduction(self, replicas):
    """The cross-replica reduction outputs get: SDK 3.1+ `_reduce_metric` runs only in the single-IPU
    (unpipelined) train, test and predict functions, and only with replication."""
    return self.metric_reduction if replicas > 1 and not self.pipelined() else "NONE"

  # The calls.

  def compile(self, *args, **kwargs):
    """Model.compile; IPU Keras' data handlers read its `steps_per_execution`."""
    self.steps_per_execution = int(kwargs.get("steps_per_execution") or 1)
    return self._keras["compile"](*args, **kwargs)

  def fit(self, x=None, y=None, **kwargs):
    """`_fit_delegate`'s checks, then Keras' fit over the elements the replicas take. Validation comes
    through `evaluate` (Keras' fit calls self.evaluate). The training metrics are Keras' over all the
    elements, not the last replica's: the replicas share their weights, so the stand-in cannot train
    them apart."""
    steps = _keras_steps(x, kwargs.get("steps_per_epoch"))
    validation = kwargs.get("validation_data")
    validation_steps = (None if validation is None
                        else _keras_steps(validation, kwargs.get("validation_steps")))
    self.check_fit(steps, validation_steps)
    if kwargs.get("steps_per_epoch") is not None:  # a remainder of steps % replicas is dropped
      replicas = self.replication_factor()
      kwargs["steps_per_epoch"] = steps // replicas * replicas
    return self._keras["fit"](x, y, **kwargs)

  def evaluate(self, x=None, y=None, steps=None, callbacks=None, return_dict=False, **kwargs):
    """`_evaluate_delegate`'s checks, then every replica's metrics, reduced as IPU Keras reduces them.

    Replica r takes elements r, r + R, ... of the infeed (`Dataset.shard` here), and its metrics are
    running means over them; `_reduce_logs` then returns what IPU Keras would. Every replica's values
    are recorded in CALLS ("evaluate"), so that tests can tell one replica's figures from all of them.
    Batch-level callbacks are not called; the test-begin and test-end ones are.
    """
    verbose = kwargs.pop("verbose", 1)
    del kwargs  # batch_size, ...; tf_keras' fit also asks for its cached dataset
    if y is not None:
      raise TypeError("the stand-in runs tf.data datasets of (x, y), as the application passes them")
    replicas, inferred, per_execution = self.check_inference(_keras_steps(x, steps))
    callbacks = _callback_list(callbacks, self.model, verbose=verbose, steps=inferred)
    callbacks.on_test_begin()
    per_replica = [self._keras["evaluate"](x.shard(replicas, r), steps=inferred, verbose=0,
                                           return_dict=True) for r in range(replicas)]
    method = self.reduction(replicas)
    logs = _reduce_logs(per_replica, method)
    _record("evaluate", per_replica, replicas=replicas, steps_per_execution=per_execution, reduction=method)
    callbacks.on_test_end(logs)
    return logs if return_dict else _results_list(self.model, logs)

  def predict(self, x, steps=None, **kwargs):
    """`_predict_delegate`'s checks, then Keras' predict on the elements the replicas take, in the order
    the outfeed returns them (extensions_util.py `merge_into_batch_dimension`: steps, then replicas,
    then rows: the infeed's order). SDK 3.1+ `_reduce_metric` applies to predictions too: MEAN or SUM
    on an unpipelined model combines the replicas' predictions of each step."""
    replicas, inferred, per_execution = self.check_inference(_keras_steps(x, steps))
    outputs = self._keras["predict"](x, steps=inferred * replicas, **kwargs)
    method = self.reduction(replicas)
    _record("predict", replicas=replicas, steps_per_execution=per_execution, reduction=method)
    if method == "NONE":
      return outputs
    if method == "LIST":
      raise NotImplementedError("the stand-in does not gather predictions across replicas (LIST)")

    def combine(array):
      by_replica = array.reshape((inferred, replicas, -1) + array.shape[1:])
      combined = by_replica.sum(axis=1, keepdims=True) / (replicas if method == "MEAN" else 1)
      return np.broadcast_to(combined, by_replica.shape).reshape(array.shape)

    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.nest.map_structure(combine, outputs)


def _callback_list(callbacks, model, **params):
  """Keras' CallbackList; given `params` (verbose, steps), as Keras' evaluate makes it: with a progress
  bar unless verbose is 0, and the parameters that a bar among `callbacks` reads."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if isinstance(callbacks, tf.keras.callbacks.CallbackList):
    return callbacks
  if params:
    params = dict(params, add_progbar=params["verbose"] != 0, epochs=1)
  return tf.keras.callbacks.CallbackList(callbacks, model=model, **params)


def inject_keras_extensions(model):
  """What IPUStrategy.scope() does to a functional model: the extension's methods on the model, and
  the extension itself as `model.ipu_extension` for tests."""
  extension = _Extension(model)
  for name in ("get_pipeline_stage_assignment", "set_pipeline_stage_assignment", "set_pipelining_options",
               "set_gradient_accumulation_options", "compile", "fit", "evaluate", "predict"):
    setattr(model, name, getattr(extension, name))
  if SDK not in ("2.6", "3.0"):  # from SDK 3.1: functional_extensions.py, sequential_extensions.py
    model.set_replication_options = extension.set_replication_options
  model.ipu_extension = extension
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
  def set_ipu_config(config, ipus_per_replica=1, configure_device=True):
    _record("popdist.set_ipu_config", config, ipus_per_replica=ipus_per_replica,
            configure_device=configure_device)
    # This instance's share of the partition: what keras' extensions_base.py `_get_num_ipus` counts
    # (the device's IPUs over popdist.getNumInstances()).
    SYSTEM["ipus"] = total_replicas // instances * ipus_per_replica

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
      if not training:
        return inputs
      if self.seed is not None:  # ipu_dropout_with_seed: the same mask at every run (dropout_test.py
        # testUserSeed asserts equal outputs over repeated runs)
        shape = tf.shape(inputs) if self.noise_shape is None else [
            tf.shape(inputs)[i] if size is None else size for i, size in enumerate(self.noise_shape)]
        keep = tf.random.stateless_uniform(shape, seed=self.seed) >= self.rate  # TF 2.6 has this one
        return inputs * tf.cast(keep, inputs.dtype) / (1.0 - self.rate)
      return tf.nn.dropout(inputs, self.rate, noise_shape=self.noise_shape)

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
  monkeypatch.setattr(sys.modules[__name__], "SYSTEM", {"ipus": 0})
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
