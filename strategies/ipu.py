"""IPU backend, written against Graphcore's documented TensorFlow 2.6 / Keras API (Poplar SDK 2.6-3.4).

Every call below is cited in `shared/reference/ipu_tf2_keras_api.md` (sections in brackets). The
semantics traps it handles:
- IPUStrategy reports `num_replicas_in_sync == 1` and SUMS gradients over replicas [2.2]: gradients are
  divided by the replica count so learning rates mean the same as on CPU/GPU (PopDistStrategy already
  averages over its `getNumTotalReplicas()`).
- `steps_per_execution` is per replica [2.1]: every dataset's per-replica steps must be a multiple of it
  (or fewer: Keras truncates), for fit and for each evaluation; fit's validation steps over all the
  process's replicas too (its validation data handler is made for one replica); in fit it is also a
  multiple of the gradient-accumulation count; training is trimmed to whole optimizer steps.
- Replication factor = IPUs / IPUs per replica, rounded to powers of two [2.2]: counts must be powers
  of two.
- A pipeline runs a multiple of its overlap length of iterations (`pipeline_overlap`): gradient
  accumulation in training, min(steps_per_execution, steps) in evaluation and prediction, whose
  splits are trimmed to that multiple.
- Keras' steps for fit/evaluate/predict count elements over all local replicas: it runs steps // R per
  replica (keras/ipu/extensions/data_adapter.py `_infer_steps`); `fit_input` multiplies accordingly.
- Metrics with replication are the last replica's running means (keras/ipu/extensions: SDK 2.6/3.0
  `_get_last_batch_results`; SDK 3.1+ defaults to ReplicatedMetricReductionMethod.NONE). From SDK 3.1
  an unpipelined training model asks for the MEAN over replicas (over one instance's replicas under
  poprun); never an inference model, whose predictions MEAN would average too. Otherwise the log
  says the losses are one replica's.
- Pipelined training does not update BatchNormalization's moving statistics properly
  (keras/ipu/extensions/extensions_base.py warns for 0 < momentum < 1), and evaluation uses them: by
  default a pipelined run normalises with each batch's own statistics instead (strategies/select.py,
  model/normalization.py); one that asks for moving statistics gets a warning that says what it means.
  Unpipelined replicas each update their own copy of the moving statistics, and the host reads replica
  0's: each update is averaged over the replicas instead (`share_moving_statistics`).
- One execution runs `steps_per_execution` steps, and Keras calls per-batch callbacks only between
  executions (keras/ipu/docs/keras.rst): the cosine learning rate is the optimizer's own schedule,
  computed in the step (training/lr_schedule.py), and a signal is acted on when an execution ends.
"""

import contextlib
import dataclasses
import importlib
import os
import re
import shutil
import subprocess

import tensorflow as tf
from absl import logging

from data.splits import BatchLayout
from errors import UserError
from run_config import RunConfig
from strategies import environment
from strategies import precision as precision_lib
from strategies.backend import Backend, Hardware
from strategies.pipeline_rules import ipu_count_problem, pipeline_overlap, pipeline_problem, stage_devices

INSTALL_HINT = ("Graphcore's TensorFlow is not installed: enable the Poplar SDK (source "
                "<sdk>/enable) and pip install its TensorFlow 2 wheel, e.g. "
                "pip install <sdk>/tensorflow-2.6.3+gc*-cp38-cp38-linux_x86_64.whl "
                "and <sdk>/keras-2.6.0+gc*.whl, in a Python 3.8 environment")
CONNECTIONS = {"always": "ALWAYS", "on_demand": "ON_DEMAND", "pre_compile": "PRE_COMPILE"}
SCHEDULES = {"grouped": "Grouped", "interleaved": "Interleaved", "sequential": "Sequential"}


def import_ipu():
  """`from tensorflow.python import ipu`, the only supported import path [0]; None without it."""
  try:
    return importlib.import_module("tensorflow.python.ipu")
  except ImportError:
    return None


# IPUs compute 16-bit in float16.
POLICIES = {"32.32": "float32", "16.32": "mixed_float16", "16.16": "float16"}


def graphcore_tensorflow_available() -> bool:
  return import_ipu() is not None


def present() -> bool:
  """Whether --backend=auto takes the IPUs: Graphcore's TensorFlow is installed and IPUs are reachable."""
  return graphcore_tensorflow_available() and ipus_present()


def has_16bit_units() -> bool:
  return True  # every IPU computes float16 natively


def check_precision(precision) -> None:
  del precision  # the IPU computes every --precision


def ipus_present() -> bool:
  """True when this host has an IPU to run on: the IPU Model, or a device that Graphcore's `gc-info`
  lists. An SDK host (gc-info on the PATH, an IPU-over-fabric configuration) outside any partition or
  Slurm job lists none. Without gc-info nothing can ask; an IPU-over-fabric configuration then counts."""
  if "--use_ipu_model" in os.environ.get("TF_POPLAR_FLAGS", ""):
    return True
  gc_info = shutil.which("gc-info")
  if gc_info is None:
    return bool(os.environ.get("IPUOF_CONFIG_PATH")) or os.path.isdir("/etc/ipuof.conf.d")
  try:
    # --list-devices "can be used at any time", also while another program runs on the IPUs (Graphcore's
    # command-line tools guide, gc-info); it lists the active partition's devices as "-+- Id: [0], ...".
    listing = subprocess.run([gc_info, "--list-devices"], capture_output=True, text=True, timeout=30,
                             check=False)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return listing.returncode == 0 and lists_a_device(listing.stdout)


def lists_a_device(gc_info_listing: str) -> bool:
  """Whether `gc-info --list-devices` output names a device ("-+- Id: [N], target: [...]")."""
  return re.search(r"^\s*-\+- Id: \[\d+\]", gc_info_listing, re.MULTILINE) is not None


def popdist_module():
  """The popdist package when this process was launched by poprun, else None [4.2]."""
  try:
    popdist = importlib.import_module("popdist")
  except ImportError:
    return None
  if not popdist.isPopdistEnvSet():
    return None
  # A submodule of its own (every Graphcore caller imports it: examples' vision/cnns/tensorflow2/
  # ipu_config.py, keras' keras/ipu/distributed_test.py); `import popdist` alone does not bind it.
  importlib.import_module("popdist.tensorflow")
  return popdist


def check_pipeline_settings(config: RunConfig) -> None:
  """Cross-flag rules of pipelining and replication on IPUs; one UserError per violation."""
  problem = ipu_count_problem(config.replicas, config.ipus_per_replica) or pipeline_problem(
      config.pipeline_schedule, config.pipeline_stages, config.ipus_per_replica,
      config.gradient_accumulation)
  if problem:
    raise UserError(problem)


def make_ipu_config(ipu, config: RunConfig, popdist=None):
  """An IPUConfig for this run [1.1], not yet applied."""
  cfg = ipu.config.IPUConfig()
  if popdist is not None:
    popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=config.ipus_per_replica, configure_device=True)
  else:
    cfg.auto_select_ipus = config.replicas * config.ipus_per_replica
  connection = getattr(ipu.config.DeviceConnectionType, CONNECTIONS[config.ipu_connection])
  cfg.device_connection.type = connection
  if config.ipu_connection != "always":
    # The executable's hash includes SupportsRemoteBuffers() (driver/poplar_executor.cc), which without
    # an attached device reads this option: a pre-compiled executable is found again by a later
    # on_demand run only if both set it. IPUConfig's docstring asks for it when the connection type is
    # not ALWAYS and the system that runs the programs has remote buffers, as the IPU-M2000 and Bow
    # machines (Bow-2000, Bow-POD64) do; examples' vision/cnns/tensorflow2 sets it the same way.
    cfg.device_connection.enable_remote_buffers = True
  if config.ipu_connection == "pre_compile":
    # Compile into the executable cache without IPUs; version is required for PRE_COMPILE [1.4, 5.2].
    cfg.device_connection.version = "ipu2"
  if config.available_memory_proportion:
    value = str(config.available_memory_proportion)  # Poplar option values must be strings [1.1]
    cfg.matmuls.poplar_options = {"availableMemoryProportion": value}
    cfg.convolutions.poplar_options = {"availableMemoryProportion": value}
  cfg.floating_point_behaviour.esr = ipu.config.StochasticRoundingBehaviour.from_bool(
      config.stochastic_rounding)
  # configure_system seeds every replica alike (reset_ipu_seed(..., experimental_identical_replicas=True));
  # the replicas draw identical random streams only with portable workers (tensorflow/python/ipu/
  # utils.py `reset_ipu_seed`; docs/rand_and_fp.rst: with the seed reset, set this option) [1.2].
  cfg.compilation_poplar_options = {"target.deterministicWorkers": "portable"}
  if config.pipeline_stages > 1:
    cfg.allow_recompute = True
    cfg.selection_order = ipu.config.SelectionOrder.SNAKE  # suits pipelines across neighbouring IPUs
  return cfg


# Poplar's reasons for not reaching the IPUs, the same from SDK 2.6 to 3.4 (graphcore/tensorflow
# compiler/plugin/poplar/driver/poplar_executor.cc). They come from configure_ipu_system with the
# "always" connection, and from the first execution (poplar_executable.cc attaches there) with
# "on_demand", the default: inside Keras' fit, evaluate or predict.
_NO_IPU_MODEL = "model disabled"  # CreatePoplarTarget: "... model disabled and no hardware IPU found";
                                  # AttachToPoplarDevice: "Device not configured and IPU model disabled."
_NO_DEVICE = ("No device matches the requested configuration", "Could not find an available device",
              "Timed out trying to find an available device", "Unable to open Poplar device")


def device_problem(error):
  """The one line for a Poplar failure to reach the IPUs (`error` an exception or its text), or None
  where `error` is something else."""
  text = str(getattr(error, "message", error))
  if _NO_IPU_MODEL in text:
    return ("--backend=ipu: no IPU is attached to this host (use --ipu_model to emulate, or "
            "--ipu_connection=pre_compile to fill the executable cache)")
  for line in text.splitlines():
    reason = next((reason for reason in _NO_DEVICE if reason in line), None)
    if reason:  # Poplar's sentence, with its likely causes, without TensorFlow's prefix or op names
      problem = "--backend=ipu: " + re.sub(r"\s*\[\[.*$", "", line[line.index(reason):]).strip()
      if reason.startswith("Timed out"):
        problem += (" (--ipu_connection=on_demand waits for busy IPUs up to TF_POPLAR_FLAGS="
                    "--on_demand_device_timeout milliseconds, one hour by default)")
      return problem
  return None


def configure_system(ipu, cfg, config: RunConfig) -> None:
  """Applies the config and seeds; Poplar's multi-line failure becomes one line."""
  try:
    cfg.configure_ipu_system()
  except (tf.errors.OpError, RuntimeError, ValueError) as error:
    problem = device_problem(error)
    if problem:
      raise UserError(problem) from None
    first = (str(getattr(error, "message", error)).strip().splitlines() or [type(error).__name__])[0]
    raise UserError("--backend=ipu: configuring %d IPU(s) failed: %s" % (
        config.replicas * config.ipus_per_replica, first)) from None
  ipu.utils.reset_ipu_seed(config.seed, experimental_identical_replicas=True)


def make_strategy(ipu, popdist):
  """IPUStrategy, or PopDistStrategy under poprun (SDK 3.x path, then SDK 2.6's) [2, 4.2]."""
  if popdist is None:
    return ipu.ipu_strategy.IPUStrategy()
  try:
    module = importlib.import_module("tensorflow.python.ipu.distributed.popdist_strategy")
  except ImportError:  # SDK 2.6 keeps it under horovod and needs horovod initialised first
    importlib.import_module("tensorflow.python.ipu.horovod").init()
    module = importlib.import_module("tensorflow.python.ipu.horovod.popdist_strategy")
  return module.PopDistStrategy()


def _runs_whole(steps_per_execution: int, steps: int, depth_multiple: int = 1) -> bool:
  """Whether IPU Keras accepts it for a dataset of `steps` per-replica steps: it truncates a larger
  value to the steps and otherwise needs a divisor (keras/ipu/extensions/data_adapter.py,
  IPUDataHandler: "steps_per_execution (X) must be a divisor of the number of batches (Y)"). An
  inference pipeline's depth is that truncated value (extensions_base.py
  `_make_pipeline_ipu_test_function`), so it must be a multiple of `depth_multiple`."""
  depth = min(steps_per_execution, steps)
  return steps % depth == 0 and depth % depth_multiple == 0


def _whole_optimizer_steps(steps_per_execution: int, train_steps: int, accumulation: int) -> bool:
  """fit's rule (see `derive_steps_per_execution`): the value as compiled and as truncated to an epoch."""
  return steps_per_execution % accumulation == 0 and min(steps_per_execution, train_steps) % accumulation == 0


def derive_steps_per_execution(train_steps, accumulation: int, requested: int, eval_steps=(),
                               eval_depth_multiple: int = 1, replicas: int = 1) -> int:
  """steps_per_execution for IPU Keras [2.1]: one value for fit and for every evaluation split.

  Every split's per-replica steps must accept it (`_runs_whole`, evaluation splits with the
  inference pipeline's `eval_depth_multiple`); in fit it must also be a multiple of the accumulation
  count (keras/ipu/extensions/extensions_base.py
  `_verify_and_get_gradient_accumulation_steps_per_replica`), a rule that inference does not have.
  fit checks the value given to compile, before its data handler truncates it to the epoch's steps
  (`_log_optimizer_batch_size` reads `steps_per_execution_value` outside
  keras/engine/data_adapter.py `_truncate_execution_to_epoch`, which restores it afterwards), and
  each truncated execution must also hold whole optimizer steps: both must be multiples.
  In training, an evaluation split may be fit's validation data, whose data handler `_fit_delegate`
  makes with IPUDataHandler's default replication_factor=1: its steps over all this process's
  `replicas` must accept the value too. The test split, evaluated after fit, would not need that, but
  the splits come unnamed. `train_steps` is None for inference alone. Without a request: the largest
  value that fits, so an epoch takes as few host round trips as possible (one per split where the
  step counts allow it).
  """
  splits = ([("the %d training steps per replica" % train_steps, train_steps, 1)] if train_steps else [])
  splits += [("the %d evaluation steps per replica" % n, n, eval_depth_multiple) for n in eval_steps]
  if train_steps and replicas > 1:
    splits += [("the %d evaluation steps of all %d replicas together (IPU Keras checks fit's validation "
                "data before dividing it among the replicas)" % (n * replicas, replicas), n * replicas, 1)
               for n in eval_steps]
  if requested:
    for name, steps, multiple in splits:
      if not _runs_whole(requested, steps, multiple):
        raise UserError("--steps_per_execution=%d must divide %s, or be at least that many%s"
                        % (requested, name, "" if multiple == 1 else
                           ", and give pipeline iterations in multiples of %d" % multiple))
    if train_steps and not _whole_optimizer_steps(requested, train_steps, accumulation):
      raise UserError("--steps_per_execution=%d must be a multiple of --gradient_accumulation=%d"
                      % (requested, accumulation))
    return requested
  # From the largest split's steps (rounded up to whole optimizer steps) down: a value at least every
  # split's steps is truncated to each, so each split runs in one execution.
  largest = max(steps for _, steps, _ in splits)
  for candidate in range(largest + (-largest % accumulation if train_steps else 0), 0, -1):
    if (not train_steps or _whole_optimizer_steps(candidate, train_steps, accumulation)) and all(
        _runs_whole(candidate, steps, m) for _, steps, m in splits):
      return candidate
  raise UserError("no --steps_per_execution fits the training (%s) and evaluation (%s) steps per replica "
                  "with --gradient_accumulation=%d%s: change --batch_size or the split sizes"
                  % (train_steps, ", ".join(map(str, eval_steps)), accumulation,
                     " and %d replicas" % replicas if train_steps and replicas > 1 else ""))


def assign_stages(model, stage_boundaries, stages: int, schedule: str, ipus_per_replica: int,
                  accumulation: int):
  """Splits a functional model at the builder's boundary layers and sets pipelining options [3.1, 3.2]."""
  ipu = import_ipu()
  if stages > len(stage_boundaries) + 1:
    raise UserError("--pipeline_stages=%d: model %s can be split into at most %d stages (boundaries: %s)"
                    % (stages, model.name, len(stage_boundaries) + 1, ", ".join(stage_boundaries)))
  starts = {name: i + 1 for i, name in enumerate(stage_boundaries[:stages - 1])}
  assignments = model.get_pipeline_stage_assignment()
  stage = 0
  for assignment in assignments:  # post-order: every layer after a boundary joins the next stage
    stage = max(stage, starts.get(assignment.layer.name, 0))
    assignment.pipeline_stage = stage
  model.set_pipeline_stage_assignment(assignments)
  model.set_pipelining_options(
      gradient_accumulation_steps_per_replica=accumulation,
      device_mapping=stage_devices(stages, ipus_per_replica),
      pipeline_schedule=getattr(ipu.ops.pipelining_ops.PipelineSchedule, SCHEDULES[schedule]),
      gradient_accumulation_reduction_method="mean")
  return model


def _warn_pipelined_batch_norm(model: tf.keras.Model) -> None:
  names = [layer.name for layer in model.layers
           if isinstance(layer, tf.keras.layers.BatchNormalization) and 0 < layer.momentum < 1]
  if names:
    logging.warning("Pipelined: IPU Keras does not update the moving statistics of BatchNormalization "
                    "(%s) in pipelined training (keras/ipu/extensions/extensions_base.py), and validation, "
                    "test and tools/predict.py normalise with them, so their losses may be worse than the "
                    "weights are: --batch_norm_statistics=batch (or auto) normalises with each batch's "
                    "own statistics instead; data-parallel replicas (--pipeline_stages=1) do not have "
                    "this problem",
                    ", ".join(names))


@contextlib.contextmanager
def _device_errors_as_user_errors():
  try:
    yield
  except tf.errors.OpError as error:
    problem = device_problem(error)
    if problem is None:
      raise
    raise UserError(problem) from None


def share_moving_statistics(model: tf.keras.Model) -> list:
  """Makes every BatchNormalization of `model` keep one set of moving statistics on all replicas;
  returns the layers' names.

  Each replica of an unpipelined model updates its own copy of the moving mean and variance (plain
  variables on the IPU: tensorflow/python/ipu/ipu_strategy.py `IPUExtendedV1._create_variable`), from
  its own micro-batches, and nothing reduces them. The host reads replica 0's copy
  (compiler/plugin/poplar/driver/poplar_executor.cc `ConnectReplicatedDeviceToHost`): in the
  checkpoints, and in every evaluation, since a change of executable (training to evaluation) moves
  the variables to the host and back to every replica (`ExecuteEngineImpl`: MoveDeviceToHost, then
  MoveHostToDevice). Left so, the statistics would come from 1/R of the data. Here each update takes
  the mean over all replicas of what each computed (ipu.ops.cross_replica_ops.cross_replica_mean, over
  all poprun instances' replicas too): a replica still normalises its micro-batch with that batch's
  statistics, and the moving averages, linear in them, become the mean of the replicas' own, what
  tf.distribute's mirrored strategies read and save on CPUs and GPUs (training/replica_statistics.py).
  Every replica holds them, so evaluation and checkpoints see the same set. The cost: two all-reduces
  of one value per feature, per layer and micro-batch.

  SDK's IPUConfig.norms.experimental.distributed_batch_norm_replica_group_size would instead normalise
  each micro-batch with statistics over the group's batches (poplar's distributedBatchNormStatistics,
  driver/ops/custom_ops/popnn/norm.cc), another training computation than on CPUs and GPUs, and only
  in fused batch norms, which Keras uses for 4-D and 5-D inputs alone.
  """
  layers = [layer for layer in model.submodules if isinstance(layer, tf.keras.layers.BatchNormalization)]
  if layers:
    mean = import_ipu().ops.cross_replica_ops.cross_replica_mean
    for layer in layers:
      _update_with(layer, mean)
    logging.info("BatchNormalization (%s): each moving-statistics update is the mean over the replicas, "
                 "so every replica and the checkpoints hold one set",
                 ", ".join(layer.name for layer in layers))
  return [layer.name for layer in layers]


def _update_with(layer, mean) -> None:
  """`layer`'s moving averages updated with `mean` of the values it computes. Keras' BatchNormalization
  (keras 2.6 keras/layers/normalization/batch_normalization.py, and tf_keras) updates them through
  these two methods only: the batch statistic into the average, or (fused kernels, renorm) the new
  value; the mean of either is the update of the replicas' mean."""
  # pylint: disable=protected-access
  moving_average, new_value = layer._assign_moving_average, layer._assign_new_value

  def assign_moving_average(variable, value, momentum, inputs_size):
    return moving_average(variable, mean(value), momentum, inputs_size)

  def assign_new_value(variable, value):
    return new_value(variable, mean(value))

  layer._assign_moving_average = assign_moving_average
  layer._assign_new_value = assign_new_value


def swap_ipu_layers(model: tf.keras.Model) -> tf.keras.Model:
  """Replaces Keras Dropout with IPU Dropout (no mask kept in memory) when the addons are installed [7]."""
  try:
    ipu_layers = importlib.import_module("ipu_tensorflow_addons.keras.layers")
  except ImportError:
    return model

  def clone(layer):
    # A rate of 0 stays Keras' Dropout, an identity; the IPU's would still draw a mask on the device.
    # So does a noise_shape with a None (the batch's size, say): the IPU op refuses any size but 1 or
    # the input's (tensorflow/python/ipu/ops/rand_ops.py `dropout`), where Keras' takes the input's.
    if type(layer) is tf.keras.layers.Dropout and layer.rate > 0 and None not in (  # pylint: disable=unidiomatic-typecheck
        layer.noise_shape or ()):
      # No seed, even from a seeded Keras Dropout: with one, the IPU op draws the same mask at every
      # step (tensorflow/python/ipu/ops/rand_ops.py `dropout` -> ipu_dropout_with_seed; its
      # dropout_test.py testUserSeed); without, it draws from the IPU's own generator, which
      # reset_ipu_seed(--seed) makes reproducible.
      return ipu_layers.Dropout(layer.rate, noise_shape=layer.noise_shape, name=layer.name)
    return layer.__class__.from_config(layer.get_config())

  swapped = tf.keras.models.clone_model(model, clone_function=clone)
  swapped.set_weights(model.get_weights())
  return swapped


@dataclasses.dataclass(frozen=True)
class IPUBackend(Backend):
  """IPUStrategy/PopDistStrategy with replication, pipelining and gradient accumulation on device."""
  places_pipeline_stages = True
  profiles_with_tensorflow = False
  pipeline_stages: int = 1
  pipeline_schedule: str = "grouped"
  ipus_per_replica: int = 1
  sums_replica_gradients: bool = True     # IPUStrategy: yes; PopDistStrategy averages itself
  local_replicas: int = 0                 # under poprun: this instance's replicas (0: all; see replicas_here)
  rank: int = 0                           # under poprun: popdist.getInstanceIndex()
  world_size: int = 1                     # under poprun: popdist.getNumInstances()

  @property
  def replicas_here(self) -> int:
    """The replicas this process feeds: under poprun its instance's, else all of them."""
    return self.local_replicas or self.replicas

  def optimizer_steps(self, steps: int) -> int:
    # IPU Keras: "a step refers to the forward and backward passes on a micro batch" [keras.rst], and
    # the optimizer runs once per G of them (GradientAccumulationOptimizerV2's resource update).
    return steps // self.gradient_accumulation

  def samples_per_step(self, micro_batch: int) -> int:
    # One Keras step is one micro-batch on each replica, all instances' (keras/ipu/docs/keras.rst;
    # extensions_base.py `_fit_delegate` gives callbacks the steps per replica), not an optimizer step.
    return micro_batch * self.replicas

  def layout(self, micro_batch: int, batch_dependent: bool = False) -> BatchLayout:
    # Each replica takes whole micro-batches from the infeed in turn; G micro-batches per optimizer step.
    # Under poprun each instance feeds its local replicas from its own shards [4.2]. A network whose
    # outputs depend on the batch (batch statistics in evaluation) evaluates in micro-batches too,
    # instead of batches that divide each replica's shard.
    local = self.replicas_here
    return BatchLayout(replicas=local, replica_rows=micro_batch, element_per_replica=True,
                       steps_multiple=self.gradient_accumulation,
                       eval_steps_multiple=self.eval_depth_multiple,
                       eval_divides_shards=not batch_dependent,
                       first_shard=self.rank * local, num_shards=self.replicas)

  @property
  def eval_depth_multiple(self) -> int:
    """The multiple an inference pipeline's depth must be (1 unpipelined)."""
    return pipeline_overlap(self.pipeline_schedule, self.pipeline_stages, self.ipus_per_replica,
                            training=False)

  def fit_input(self, dataset, steps: int):
    # IPU Keras divides the steps given to fit/evaluate/predict among this process's replicas
    # (keras/ipu/extensions/data_adapter.py, IPUDataHandler._infer_steps: steps // replication
    # factor); examples' vision/cnns/tensorflow2/train.py passes micro-batches over all replicas.
    # Our `steps` count optimizer steps, each one element per local replica.
    return dataset, steps * self.replicas_here

  def prepare_model(self, model, stage_boundaries=()):
    model = swap_ipu_layers(model)
    self._reduce_metrics(model)
    if self.pipeline_stages > 1:
      _warn_pipelined_batch_norm(model)
      return assign_stages(model, tuple(stage_boundaries), self.pipeline_stages, self.pipeline_schedule,
                           self.ipus_per_replica, self.gradient_accumulation)
    if self.replicas > 1:
      share_moving_statistics(model)
    if self.gradient_accumulation > 1:
      model.set_gradient_accumulation_options(
          gradient_accumulation_steps_per_replica=self.gradient_accumulation,
          gradient_accumulation_reduction_method="mean")
    return model

  def device_errors(self):
    """Poplar's failures to reach the IPUs as one line, where they surface: with the on_demand
    connection (the default) the device is attached at the first execution, inside fit, evaluate or
    predict, not when the system is configured."""
    return _device_errors_as_user_errors()

  def _reduce_metrics(self, model) -> None:
    """Metrics over all replicas where IPU Keras can (SDK 3.1+, unpipelined: `_reduce_metric` runs only
    in the single-IPU train/test/predict functions of keras/ipu/extensions/extensions_base.py)."""
    local = self.replicas_here
    if local == 1:
      return
    if self.pipeline_stages == 1 and hasattr(model, "set_replication_options"):
      model.set_replication_options(replicated_metric_reduction_method="MEAN")
      logging.info("Losses and metrics are means over %s%d replicas", "this instance's " if
                   self.world_size > 1 else "", local)
    else:
      logging.warning("IPU Keras reports one replica's metrics here (SDK before 3.1, or a pipelined model): "
                      "training, validation and test losses are computed on that replica's 1/%d of the "
                      "data", local)

  def inference_model(self, model, stage_boundaries=()):
    # The same placement as in training: IPU Keras derives the replication factor from the model's
    # shard count, which is 1 for an unpipelined model (keras/ipu/extensions/extensions_base.py
    # `_get_shard_count`), so an unpipelined model on 2-IPU replicas would run as twice the replicas.
    model = swap_ipu_layers(model)
    if self.pipeline_stages > 1:
      return assign_stages(model, tuple(stage_boundaries), self.pipeline_stages, self.pipeline_schedule,
                           self.ipus_per_replica, self.gradient_accumulation)
    if self.ipus_per_replica > 1:
      raise UserError("--ipus_per_replica=%d without pipeline stages: nothing places the model on more "
                      "than one IPU (set --pipeline_stages)" % self.ipus_per_replica)
    return model

  def optimizer_kwargs(self) -> dict:
    if not self.sums_replica_gradients or self.replicas == 1:
      return {}
    replicas = float(self.replicas)
    return {"gradient_transformers": [lambda pairs: [(g / replicas, v) for g, v in pairs]]}

  def optimizer_factories(self) -> dict:
    """With 16-bit weights, IPU Addons optimizers keep their state in float32 [7]."""
    if not self.precision.half_weights:
      return {}
    try:
      addons = importlib.import_module("ipu_tensorflow_addons.keras.optimizers")
    except ImportError:
      return {}
    # make_optimizer gives "adam" PyTorch's epsilon: AdamIpuOptimizer adds it where PyTorch does, to the
    # square root of the bias-corrected v (ipu_tensorflow_addons keras/optimizers/adam_optimizer.py
    # `_adam_step`: m_hat / (sqrt(v_hat) + epsilon), in float32), so the update is the other backends'.
    # Both are Keras 2.6 OptimizerV2 subclasses (of keras.optimizers.Adam and .SGD, r2.6/sdk-release-2.6
    # to 3.4) with no weight decay of their own (only the LAMB optimizer has one): make_optimizer's
    # decoupled weight decay extends them, and its clip joins their gradient_transformers.
    return {
        "adam": (addons.AdamIpuOptimizer, {"m_dtype": tf.float32, "v_dtype": tf.float32}),
        "sgd": (addons.SGDIpuOptimizer, {"momentum_accum_dtype": tf.float32}),
    }

  def alone(self):
    # Whether one instance can run an IPU predict alone under PopDist is not settled by Graphcore's
    # sources (its examples evaluate with every instance); the default strategy would run on the host.
    return self if self.world_size == 1 else None

  def any_process(self, flag: bool) -> bool:
    """Whether any poprun instance has `flag` set: one host all-reduce, never an IPU op.

    The host collectives are the ones Graphcore's own Keras callbacks call eagerly (examples'
    vision/cnns/tensorflow2 callbacks/allreduce_metrics_callback.py): SDK 3.1+
    `tensorflow.python.ipu.distributed.host_collective_ops.allreduce` (3.0 spells it `all_reduce`;
    both need popdist.init(), which PopDistStrategy's constructor calls), SDK 2.6
    `tensorflow.python.ipu.horovod.allreduce` (initialised by make_strategy). An eager
    `strategy.run`, as the multi-worker path uses, would place the op on the IPU.
    """
    if self.world_size == 1:
      return flag
    with tf.device("/device:CPU:0"):
      value = tf.constant(1.0 if flag else 0.0)
    try:
      collectives = importlib.import_module("tensorflow.python.ipu.distributed.host_collective_ops")
    except ImportError:  # SDK 2.6
      horovod = importlib.import_module("tensorflow.python.ipu.horovod")
      total = horovod.allreduce(value, op=horovod.Sum)
    else:
      allreduce = getattr(collectives, "allreduce", None) or collectives.all_reduce
      total = allreduce(value, tf.distribute.ReduceOp.SUM)
    return float(total) > 0

  def compile_kwargs(self, train_steps, eval_steps=()) -> dict:
    steps = derive_steps_per_execution(train_steps, self.gradient_accumulation,
                                       self.steps_per_execution, tuple(eval_steps),
                                       self.eval_depth_multiple, self.replicas_here)
    return {"steps_per_execution": steps}


def create(config: RunConfig) -> IPUBackend:
  """Returns the IPU backend; UserError when Graphcore's TensorFlow or the IPUs are missing."""
  ipu = import_ipu()
  if ipu is None:
    raise UserError("--backend=ipu: " + INSTALL_HINT)
  check_pipeline_settings(config)
  popdist = popdist_module()
  replicas = config.replicas
  if popdist is not None:
    replicas = popdist.getNumTotalReplicas()
    if config.replicas not in (1, replicas):
      raise UserError("--replicas=%d disagrees with poprun's --num-replicas=%d (leave --replicas unset "
                      "under poprun)" % (config.replicas, replicas))
  cfg = make_ipu_config(ipu, config, popdist)
  configure_system(ipu, cfg, config)
  strategy = make_strategy(ipu, popdist)
  logging.info("IPU system configured: %d replica%s x %d IPU%s, %s connection%s", replicas,
               "" if replicas == 1 else "s", config.ipus_per_replica,
               "" if config.ipus_per_replica == 1 else "s", config.ipu_connection,
               ", poprun instance %d of %d" % (popdist.getInstanceIndex(), popdist.getNumInstances())
               if popdist else "")
  precision = precision_lib.resolve(config.precision, has_16bit_units)
  return IPUBackend(
      kind="ipu", strategy=strategy, devices=("/device:IPU:0",), replicas=replicas,
      gradient_accumulation=config.gradient_accumulation, pipeline_stages=config.pipeline_stages,
      pipeline_schedule=config.pipeline_schedule, ipus_per_replica=config.ipus_per_replica,
      steps_per_execution=config.steps_per_execution,  # 0: derived for each compile (compile_kwargs)
      sums_replica_gradients=popdist is None,
      hardware=Hardware(device="ipu", precision=precision,
                        updates_moving_statistics=config.pipeline_stages == 1),
      cache_dir=environment.executable_cache_dir("ipu"),
      local_replicas=popdist.getNumLocalReplicas() if popdist else 0,
      rank=popdist.getInstanceIndex() if popdist else 0,
      world_size=popdist.getNumInstances() if popdist else 1)
