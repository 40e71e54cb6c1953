"""A stand-in for Graphcore's `tensorflow.python.ipu` (and `popdist`, `ipu_tensorflow_addons`), for tests.

No IPU and no Graphcore wheel exist on CI machines, so the IPU path is checked against the documented
API (shared/reference/ipu_tf2_keras_api.md) with this stand-in: the same module paths, class and
function signatures, enum names, and the behaviours our code relies on (typed config attributes that
reject unknown names and wrong types, PRE_COMPILE needing a version, the Keras extension methods). Every
call is recorded in `CALLS` so tests can assert on what the application asked for.

Models made in a strategy's scope also get IPU Keras' fit, evaluate and predict (`_Extension`): the
data handler's rules, the pipeline's iteration count, the replication factor, and metrics that are one
replica's unless reduced across replicas. They compute what the IPUs compute (`_Replicas`): R replicas,
each on its own elements of the infeed, Keras' loss divided by what the strategy reports as
`num_replicas_in_sync`, the replicas' gradients summed, accumulated over G micro-batches into one
optimizer update, and callbacks that count the steps of one replica. Each rule names the Graphcore
source it follows (graphcore/keras, graphcore/tensorflow and graphcore/ipu_tensorflow_addons, branches
r2.6/sdk-release-2.6 to -3.4)."""

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
def _keras_extensions_scope(strategy):
  """What IPUStrategy.scope() gives Keras (ipu_strategy.py with enable_keras_extensions=True: models
  made in the scope get the IPU extension methods; keras/ipu/extensions): here, every Model made in
  the scope gets the stand-in methods, inside the default strategy's scope."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  original = tf.keras.Model.__init__

  def init(self, *args, **kwargs):
    original(self, *args, **kwargs)
    inject_keras_extensions(self, strategy)

  tf.keras.Model.__init__ = init
  try:
    with tf.distribute.get_strategy().scope():
      yield
  finally:
    tf.keras.Model.__init__ = original


class IPUStrategy:
  """IPUStrategyV1. tensorflow/python/ipu/ipu_strategy.py `IPUExtendedV1`: `_num_replicas_in_sync` is
  1 whatever the replication (so Keras does not divide the loss among the replicas), and `_reduce_to`
  SUMs (cross_replica_sum) the values Keras reduces across replicas, the gradients among them."""

  num_replicas_in_sync = 1
  instances = 1   # processes whose replicas the reductions span

  def __init__(self, ipu_device="/device:IPU:0", cpu_device="/device:CPU:0",
               enable_dataset_iterators=True, enable_keras_extensions=True):
    _record("IPUStrategy", ipu_device=ipu_device, cpu_device=cpu_device)

  def scope(self):
    return _keras_extensions_scope(self)


class PopDistStrategy:
  """distributed/popdist_strategy.py (horovod/ on SDK 2.6): a StrategyV1 with KerasExtensions, so its
  scope() gives models the IPU Keras methods as IPUStrategy's does. `PopDistExtendedV1.
  _num_replicas_in_sync` is popdist.getNumTotalReplicas(), and its `_reduce_to` on the IPU is a
  cross_replica_sum over all instances' replicas."""

  def __init__(self, ipu_device="/device:IPU:0", add_ipu_cross_replica_reductions=True,
               enable_dataset_iterators=True, enable_keras_extensions=True):
    _record("PopDistStrategy", ipu_device=ipu_device)
    popdist = sys.modules["popdist"]
    self.num_replicas_in_sync = popdist.getNumTotalReplicas()
    self.instances = popdist.getNumInstances()

  def scope(self):
    return _keras_extensions_scope(self)


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


def _check_enough_data(data, steps_given, inferred, epochs=1, initial_epoch=0):
  """keras/ipu/extensions/data_adapter.py `IPUDataHandler._validate_dataset`: a dataset of known size
  must hold the steps each replica runs: one epoch's where Keras makes a new iterator every epoch
  (keras/engine/data_adapter.py `DatasetAdapter.should_recreate_iterator`: no steps given, or as many
  as the dataset's elements), else every epoch's."""
  size = int(data.cardinality())
  if size < 0:  # infinite or unknown
    return
  recreated = steps_given is None or steps_given == size
  total = inferred if recreated else (epochs - initial_epoch) * inferred
  if total > size:
    raise ValueError("Your input does not have enough data. Make sure that your dataset or generator can "
                     "generate at least %d batches (currently it can only generate %d batches). You may "
                     "need to use the repeat() function when building your dataset." % (total, size))


def _overridden(model, name):
  """extensions_base.py `_train_step_overridden` and its siblings: the model's method is not Keras'."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return getattr(getattr(model, name), "__func__", None) is not getattr(tf.keras.Model, name)


def _refuse_overridden(model, name, why="This is not supported when using Keras within an IPUStrategy."):
  if _overridden(model, name):
    raise RuntimeError("The function `%s` for the model %s has been overridden. %s" % (name, model.name, why))


def _check_mode(model):
  """extensions_base.py `_check_mode`, first in `_fit_delegate`, `_evaluate_delegate` and
  `_predict_delegate` (SDK 2.6 to 3.4)."""
  if model.run_eagerly:
    raise RuntimeError("Keras models cannot run eagerly when using `IPUStrategy`. Set `run_eagerly=False` "
                       "when calling `compile`.")


FAIL_EXECUTION = None   # tests set a Poplar error that fit, evaluate and predict then raise


def _execute():
  """Where Poplar attaches with the on_demand connection: at an execution (poplar_executable.cc), inside
  Keras' fit, evaluate or predict."""
  if FAIL_EXECUTION:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    raise tf.errors.InternalError(None, None, FAIL_EXECUTION)


def _accumulation_scales(method, count, micro_batch):
  """tensorflow/python/ipu/optimizers/gradient_accumulation_optimizer.py `_compute_scales`: a
  micro-batch's gradient is added as accumulator * accum_scale + gradient * grad_scale; `micro_batch`
  is the iteration counter (a tensor), used by RUNNING_MEAN."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if method == "SUM":
    return 1.0, 1.0
  if method == "MEAN":
    return 1.0, 1.0 / count
  n = tf.cast(micro_batch % count, tf.float32)
  return n / (n + 1), 1.0 / (n + 1)


class _Lockstep:
  """The replicas' collectives (cross_replica_ops) in the stand-in's replica step, which runs the
  replicas one after the other: a first pass runs every replica's forward pass and records what each
  collective is given, in call order; the second, the real one, answers each call with the reduction of
  the values recorded at the same place. What a collective returns carries no gradient here (the
  application reduces statistics, which are not differentiated), and random draws (dropout) differ
  between the passes."""

  active = None   # the _Lockstep of the step being traced, if any

  def __init__(self, replicas, instances):
    self.replicas, self.instances = replicas, instances
    self.recorded = [[] for _ in range(replicas)]
    self.replica, self.calls, self.recording = 0, 0, True

  def start(self, replica, recording):
    self.replica, self.calls, self.recording = replica, 0, recording

  def reduce(self, x, op, group_size):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if self.recording:
      self.recorded[self.replica].append(x)
      return x
    size = group_size or self.replicas
    first = self.replica // size * size
    values = [self.recorded[r][self.calls] for r in range(first, first + size)]
    self.calls += 1
    total = tf.add_n(values)
    if group_size is None:  # all instances' replicas; the other instances' values taken as this one's
      total, size = total * self.instances, size * self.instances
    return tf.stop_gradient(total / size if op == "mean" else total)


COLLECTIVES_SEEN = []   # a cross-replica op was asked for (the step then runs its replicas in lockstep)


def _cross_replica(x, op, replica_group_size):
  COLLECTIVES_SEEN.append(op)
  if _Lockstep.active is None:  # one replica, or outside a training step: nothing to reduce with
    return x
  return _Lockstep.active.reduce(x, op, replica_group_size)


def cross_replica_sum(x, replica_group_size=None, name=None):
  """tensorflow/python/ipu/ops/cross_replica_ops.py (SDK 2.6 to 3.4): the sum over the replicas, or
  over consecutive groups of `replica_group_size`."""
  del name
  return _cross_replica(x, "sum", replica_group_size)


def cross_replica_mean(x, replica_group_size=None, name=None):
  """cross_replica_ops.py: the mean over the replicas (or groups)."""
  del name
  return _cross_replica(x, "mean", replica_group_size)


class _Replicas:
  """One instance's replicas, as the stand-in trains them; what the hardware computes:

  - Each replica runs its own elements of the infeed (replica r takes elements r, r + R, ...), and
    Keras' loss there is divided by the strategy's `num_replicas_in_sync` (keras/engine/compile_utils.py
    `LossesContainer.__call__` -> keras/utils/losses_utils.py `scale_loss_for_distribution`): by 1 under
    IPUStrategy, by all instances' replicas under PopDistStrategy.
  - Each replica's gradients, accumulated over the G micro-batches of an optimizer step
    (`GradientAccumulationOptimizerV2.apply_gradients`, or the pipeline's accumulation, both with the
    model's `gradient_accumulation_reduction_method`), go to the Keras optimizer's apply_gradients once
    every G micro-batches (its `resource_update`), so `optimizer.iterations` counts updates. There
    `_aggregate_gradients` reduces them across the replicas through the strategy's `_reduce_to`: a SUM
    (cross_replica_sum), then `_transform_gradients` runs the gradient_transformers. Under PopDist the
    sum spans every instance's replicas; the other instances are not run here, and their replicas'
    gradients are taken to be this instance's.
  - The loss goes through the optimizer's `get_gradients` (extensions_base.py `_KerasOptimizerWrapper.
    compute_gradients`), which a LossScaleOptimizer scales and unscales.
  - Each replica keeps its own copy of the non-trainable variables (BatchNormalization's moving
    statistics): nothing reduces them, and the host reads replica 0's (poplar_executor.cc
    `ConnectReplicatedDeviceToHost`); a value the host writes goes to every replica.
  - cross_replica_ops' sums and means reduce over the replicas (_Lockstep).
  """

  def __init__(self, model, count, reported_replicas=1, instances=1):
    self.model, self.count = model, count
    self.reported_replicas, self.instances = reported_replicas, instances
    self.state = None          # per replica: its copy of the model's non-trainable variables
    self.accumulators = None   # per replica: one accumulator per trainable variable
    self.micro_batches = None  # micro-batches run, for the accumulation's position in its step
    self.collectives = False   # whether the training step asks for cross-replica ops

  # The replicas' own variables.

  def from_host(self):
    """Before an execution: every replica's copy of the non-trainable variables, written anew where
    the host changed the model's (replica 0's copy as last read)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    variables = self.model.non_trainable_variables
    if self.state is None or len(self.state[0]) != len(variables):
      self.state = [[tf.Variable(v, trainable=False) for v in variables] for _ in range(self.count)]
      return
    if any(not np.array_equal(v.numpy(), c.numpy()) for v, c in zip(variables, self.state[0])):
      for copies in self.state:
        for v, c in zip(variables, copies):
          c.assign(v)

  def use(self, replica):
    """Replica `replica`'s copy into the model's variables (in a graph or eagerly)."""
    for v, c in zip(self.model.non_trainable_variables, self.state[replica]):
      v.assign(c)

  def keep(self, replica):
    for v, c in zip(self.model.non_trainable_variables, self.state[replica]):
      c.assign(v)

  # Training.

  def prepare(self, accumulation, features):
    """Eagerly, before a fit: the state the training step updates (accumulators, optimizer slots), and
    whether the model's training pass asks for collectives (traced, not run, on `features`' spec)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    self.from_host()
    if self.count > 1:
      del COLLECTIVES_SEEN[:]
      tf.function(lambda x: self.model(x, training=True)).get_concrete_function(features)
      self.collectives = bool(COLLECTIVES_SEEN)
    variables = self.model.trainable_variables
    optimizer = self.model.optimizer
    if hasattr(optimizer, "_create_all_weights"):   # slots now, not inside the step's condition
      optimizer._create_all_weights(variables)      # pylint: disable=protected-access
    elif hasattr(optimizer, "build"):
      optimizer.build(variables)
    if accumulation > 1 and self.accumulators is None:
      self.accumulators = [[tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
                           for _ in range(self.count)]
      self.micro_batches = tf.Variable(0, dtype=tf.int64, trainable=False)

  def gradients(self, x, y):
    """One replica's gradients on its micro-batch (x, y); updates the compiled metrics."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    model = self.model
    scaler = model.optimizer if isinstance(model.optimizer, tf.keras.mixed_precision.LossScaleOptimizer) \
        else None
    with tf.GradientTape() as tape:
      predictions = model(x, training=True)
      loss = model.compiled_loss(y, predictions, regularization_losses=model.losses)
      loss = loss / self.reported_replicas
      if scaler:
        loss = scaler.get_scaled_loss(loss)
    variables = model.trainable_variables
    gradients = tape.gradient(loss, variables)
    if scaler:
      gradients = scaler.get_unscaled_gradients(gradients)
    model.compiled_metrics.update_state(y, predictions)
    return [tf.zeros_like(v) if g is None else g for g, v in zip(gradients, variables)]

  def apply(self, per_replica):
    """The optimizer's update with the replicas' gradients summed (cross_replica_sum)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    summed = [tf.add_n(list(gradients)) for gradients in zip(*per_replica)]
    if self.instances > 1:
      summed = [gradient * self.instances for gradient in summed]
    self.model.optimizer.apply_gradients(zip(summed, self.model.trainable_variables))

  def train_step(self, accumulation, method):
    """The step Keras runs per element of the grouped infeed: (R, micro-batch, ...) tensors."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    def step(data):
      x, y = data
      per_replica = []
      own_state = bool(self.state[0])
      lockstep = _Lockstep(self.count, self.instances) if self.collectives else None
      _Lockstep.active = lockstep
      try:
        for replica in range(self.count if lockstep else 0):   # the collectives' values
          if own_state:
            self.use(replica)
          lockstep.start(replica, recording=True)
          self.model(x[replica], training=True)
        for replica in range(self.count):
          if own_state:
            self.use(replica)
          if lockstep:
            lockstep.start(replica, recording=False)
          per_replica.append(self.gradients(x[replica], y[replica]))
          if own_state:
            self.keep(replica)
      finally:
        _Lockstep.active = None
      if own_state:
        self.use(0)
      if accumulation == 1:
        self.apply(per_replica)
      else:
        accum_scale, grad_scale = _accumulation_scales(method, accumulation, self.micro_batches)
        for accumulators, gradients in zip(self.accumulators, per_replica):
          for accumulator, gradient in zip(accumulators, gradients):
            accumulator.assign(accumulator * tf.cast(accum_scale, accumulator.dtype)
                               + gradient * tf.cast(grad_scale, accumulator.dtype))
        self.micro_batches.assign_add(1)

        def update():
          self.apply([[a.read_value() for a in accumulators] for accumulators in self.accumulators])
          for accumulators in self.accumulators:
            for accumulator in accumulators:
              accumulator.assign(tf.zeros_like(accumulator))
          return tf.constant(True)

        tf.cond(tf.equal(self.micro_batches % accumulation, 0), update, lambda: tf.constant(False))
      return {metric.name: metric.result() for metric in self.model.metrics}

    return step


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

  def __init__(self, model, strategy=None):
    self.model = model
    self.strategy = strategy or IPUStrategy   # the class's num_replicas_in_sync when made outside a scope
    self.assignment = None                # layer name -> stage; `_is_pipelined` once it is set
    self.device_mapping = None
    self.schedule = PipelineSchedule.Grouped   # pipelining_ops.py `pipeline`'s default
    self.pipelining_accumulation = None   # `_pipelining_gradient_accumulation_steps_per_replica`
    self.accumulation = None              # `_gradient_accumulation_steps_per_replica`
    # `_gradient_accumulation_reduction_method`, which each setter sets (its default: SUM).
    self.accumulation_reduction = "SUM"
    self.replicas = None                  # _Replicas, once the replication factor is known
    self.compiled_step = None             # (replicas, accumulation, reduction) of the traced step
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
    self.accumulation_reduction = _parse_accumulation_reduction(gradient_accumulation_reduction_method)
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
    self.accumulation_reduction = _parse_accumulation_reduction(gradient_accumulation_reduction_method)
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

  def replicas_for(self, count):
    """The replicas' state (_Replicas) for a replication factor of `count`."""
    if self.replicas is None or self.replicas.count != count:
      self.replicas = _Replicas(self.model, count, self.strategy.num_replicas_in_sync,
                                self.strategy.instances)
    return self.replicas

  def check_train_functions(self, accumulation):
    """extensions_base.py `_make_ipu_train_function_wrapper`, when fit makes its train function: from
    SDK 3.1 an overridden `make_train_function` or `train_step` is refused; SDK 2.6 and 3.0 refuse
    `train_step` only for a pipelined model or with gradient accumulation, and otherwise run it."""
    _refuse_overridden(self.model, "make_train_function")
    if SDK not in ("2.6", "3.0"):
      _refuse_overridden(self.model, "train_step")
    elif self.pipelined():
      _refuse_overridden(self.model, "train_step", "This is not supported for pipelined Keras models.")
    elif accumulation > 1:
      _refuse_overridden(self.model, "train_step", "This is not supported for Keras models with gradient "
                         "accumulation enabled.")
    elif _overridden(self.model, "train_step"):
      raise NotImplementedError("the stand-in does not run a model's own train_step")

  def check_inference_functions(self, kind):
    """`_make_ipu_test_function_wrapper`, `_make_ipu_predict_function_wrapper` (SDK 2.6 to 3.4): an
    overridden `make_test_function` (`make_predict_function`) is refused, and `test_step`
    (`predict_step`) in a pipelined model."""
    _refuse_overridden(self.model, "make_%s_function" % kind)
    if self.pipelined():
      _refuse_overridden(self.model, "%s_step" % kind, "This is not supported for pipelined Keras models.")

  def fit(self, x=None, y=None, **kwargs):
    """`_fit_delegate`'s checks, then the replicas' training (_Replicas) through Keras' fit.

    Keras runs one step per micro-batch of each replica, as IPU Keras counts them (keras/ipu/docs/
    keras.rst; `_fit_delegate`'s CallbackList gets `steps=data_handler.inferred_steps`, the steps per
    replica): each Keras step takes the R elements the replicas take from the infeed. So callbacks see
    per-replica step indices, once per execution. Validation comes through `evaluate` (Keras' fit
    calls self.evaluate). The training metrics are Keras' over all the replicas' micro-batches."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    _check_mode(self.model)
    given = kwargs.get("steps_per_epoch")
    steps = _keras_steps(x, given)
    validation = kwargs.get("validation_data")
    validation_steps = (None if validation is None
                        else _keras_steps(validation, kwargs.get("validation_steps")))
    per_execution = self.check_fit(steps, validation_steps)
    replicas = self.replication_factor()
    _check_enough_data(x, given, steps // replicas, kwargs.get("epochs", 1), kwargs.get("initial_epoch", 0))
    if validation is not None:  # its data handler is made with replication_factor=1 (see check_fit)
      _check_enough_data(validation, kwargs.get("validation_steps"), validation_steps)
    accumulation = self.accumulation_count(per_execution)
    self.check_train_functions(accumulation)
    _execute()
    training = self.replicas_for(replicas)
    training.prepare(accumulation, tf.nest.flatten(x.element_spec)[0])
    method = self.accumulation_reduction
    if self.compiled_step != (replicas, accumulation, method):
      self.model.train_function = None   # IPU Keras makes a new train function for new settings
      self.compiled_step = (replicas, accumulation, method)
    if given is not None:
      kwargs["steps_per_epoch"] = steps // replicas
    self.model.train_step = training.train_step(accumulation, method)
    try:
      return self._keras["fit"](x.batch(replicas, drop_remainder=True), y, **kwargs)
    finally:
      del self.model.train_step

  def evaluate(self, x=None, y=None, steps=None, callbacks=None, return_dict=False, **kwargs):
    """`_evaluate_delegate`'s checks, then every replica's metrics, reduced as IPU Keras reduces them.

    Replica r takes elements r, r + R, ... of the infeed (`Dataset.shard` here), with its own
    non-trainable variables (_Replicas), and its metrics are running means over them; `_reduce_logs`
    then returns what IPU Keras would. Every replica's values are recorded in CALLS ("evaluate"), so
    that tests can tell one replica's figures from all of them. Batch-level callbacks are not called;
    the test-begin and test-end ones are.
    """
    verbose = kwargs.pop("verbose", 1)
    del kwargs  # batch_size, ...; tf_keras' fit also asks for its cached dataset
    _check_mode(self.model)
    if y is not None:
      raise TypeError("the stand-in runs tf.data datasets of (x, y), as the application passes them")
    replicas, inferred, per_execution = self.check_inference(_keras_steps(x, steps))
    _check_enough_data(x, steps, inferred)
    self.check_inference_functions("test")
    _execute()
    callbacks = _callback_list(callbacks, self.model, verbose=verbose, steps=inferred)
    callbacks.on_test_begin()
    per_replica = self.per_replica(replicas, lambda r: self._keras["evaluate"](
        x.shard(replicas, r), steps=inferred, verbose=0, return_dict=True))
    method = self.reduction(replicas)
    logs = _reduce_logs(per_replica, method)
    _record("evaluate", per_replica, replicas=replicas, steps_per_execution=per_execution, reduction=method)
    callbacks.on_test_end(logs)
    return logs if return_dict else _results_list(self.model, logs)

  def per_replica(self, replicas, run):
    """[run(r) for each replica r], each with that replica's non-trainable variables in the model."""
    state = self.replicas_for(replicas)
    state.from_host()
    try:
      results = []
      for replica in range(replicas):
        state.use(replica)
        results.append(run(replica))
      return results
    finally:
      state.use(0)

  def predict(self, x, steps=None, **kwargs):
    """`_predict_delegate`'s checks, then Keras' predict on the elements each replica takes, merged in
    the order the outfeed returns them (extensions_util.py `merge_into_batch_dimension`: steps, then
    replicas, then rows: the infeed's order). SDK 3.1+ `_reduce_metric` applies to predictions too:
    MEAN or SUM on an unpipelined model combines the replicas' predictions of each step."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    _check_mode(self.model)
    replicas, inferred, per_execution = self.check_inference(_keras_steps(x, steps))
    _check_enough_data(x, steps, inferred)
    self.check_inference_functions("predict")
    _execute()
    per_replica = self.per_replica(replicas, lambda r: self._keras["predict"](
        x.shard(replicas, r), steps=inferred, **kwargs))

    def merged(*arrays):   # each (inferred x rows, ...) -> (inferred, replicas, rows, ...) -> rows
      by_step = np.stack([a.reshape((inferred, -1) + a.shape[1:]) for a in arrays], axis=1)
      return by_step.reshape((-1,) + by_step.shape[3:])

    outputs = tf.nest.map_structure(merged, *per_replica)
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


def inject_keras_extensions(model, strategy=None):
  """What IPUStrategy.scope() (or `strategy`'s) does to a functional model: the extension's methods on
  the model, and the extension itself as `model.ipu_extension` for tests."""
  extension = _Extension(model, strategy)
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
  collectives = _module("tensorflow.python.ipu.ops.cross_replica_ops", cross_replica_sum=cross_replica_sum,
                        cross_replica_mean=cross_replica_mean)
  ops = _module("tensorflow.python.ipu.ops", pipelining_ops=pipelining, cross_replica_ops=collectives)
  ipu = _module("tensorflow.python.ipu", config=config, utils=utils, ipu_strategy=strategy, ops=ops)
  modules = {"tensorflow.python.ipu": ipu, "tensorflow.python.ipu.config": config,
             "tensorflow.python.ipu.utils": utils, "tensorflow.python.ipu.ipu_strategy": strategy,
             "tensorflow.python.ipu.ops": ops, "tensorflow.python.ipu.ops.pipelining_ops": pipelining,
             "tensorflow.python.ipu.ops.cross_replica_ops": collectives}
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
      if self.noise_shape:  # tensorflow/python/ipu/ops/rand_ops.py `dropout`, SDK 2.6 to 3.4, verbatim:
        # a None (or any size but 1 or the input's) is refused; "%d" of None is itself a TypeError
        x_shape = inputs.get_shape().as_list()
        if len(x_shape) != len(self.noise_shape):
          raise ValueError("The length of noise_shape must equal the rank of x.")
        for i, j in zip(x_shape, self.noise_shape):
          if j == 1:
            continue
          if i != j:
            raise ValueError("Dimension mismatch, %d != %d." % (i, j))
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
  monkeypatch.setattr(sys.modules[__name__], "FAIL_EXECUTION", None)
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
