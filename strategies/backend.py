"""The `Backend` a run trains on: a distribution strategy plus the hardware decisions that go with it.

Code outside `strategies/` asks the backend, and nothing else, how to lay out batches, how to prepare
the model (stage placement, gradient accumulation) and what to pass to `compile()`. This base class is
the tf.distribute behaviour (CPU and GPU); `strategies/ipu.py` overrides it for IPUs. Its `Hardware`
holds the facts of the processor that a model may ask to choose the forms of its layers (model.layer_forms):
which forms those are is the model's knowledge, not the backend's.
"""

import contextlib
import dataclasses
import inspect
import tempfile
from typing import Optional

import tensorflow as tf

from data.splits import BatchLayout
from errors import UserError
from run_config import RunConfig
from strategies import accumulation, environment
from strategies import precision as precision_lib


def _keras_compiles_with_xla() -> bool:
  """Whether Keras' Model.compile takes `jit_compile` (Keras 2.8 on; TensorFlow 2.6's does not)."""
  return "jit_compile" in inspect.signature(tf.keras.Model.compile).parameters


def options_from_config(config: RunConfig) -> dict:
  """The Backend fields that come straight from the run configuration and from the start-up environment
  (the executable cache, strategies/environment.py); a UserError for --jit_compile where this Keras
  cannot compile a step with XLA. The precision is the backend module's to give (`precision.resolve`)."""
  if config.jit_compile and not _keras_compiles_with_xla():
    raise UserError("--jit_compile needs Keras' compile(jit_compile=...), which TensorFlow %s's Keras "
                    "lacks (TensorFlow 2.8 and later have it); leave --jit_compile off" % tf.__version__)
  return {"replicas": config.replicas, "gradient_accumulation": config.gradient_accumulation,
          "steps_per_execution": config.steps_per_execution or 1, "jit_compile": config.jit_compile,
          "cache_dir": environment.executable_cache_dir(config.backend)}


def without_auto_shard(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` with tf.data's auto-sharding off. The loaders already give every replica (and worker)
  its own rows (BatchLayout), so there is nothing to shard; left on, TensorFlow 2.6's attempt printed
  a warning with a protobuf dump of the pipeline at every fit and evaluate under MirroredStrategy."""
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  return dataset.with_options(options)


@dataclasses.dataclass(frozen=True)
class Hardware:
  """What a model may ask of the hardware it runs on, to pick the fastest form of its layers
  (model.layer_forms): facts only, no choice of a model's."""
  device: str                              # the processor the model's ops run on: "cpu", "gpu" or "ipu"
  precision: precision_lib.Precision       # the resolved --precision (Backend.precision reads it)
  # The host CPU features oneDNN's kernels may use (/proc/cpuinfo's flags, after an ONEDNN_MAX_CPU_ISA
  # cap: strategies/cpu.py cpu_features); empty off CPUs.
  cpu_features: frozenset = frozenset()
  cpu_generation: tuple = ()               # (vendor, family), as host.cpuinfo.generation() gives; () off CPUs
  signature: str = ""                      # what identifies the machine, as timings cached for it are keyed
  # Whether training updates batch normalisation's moving statistics (IPU Keras does not in pipelined
  # training: keras/ipu/extensions/extensions_base.py, graphcore/keras r2.6/sdk-release-3.4).
  updates_moving_statistics: bool = True


@dataclasses.dataclass(frozen=True)
class Backend:
  """A resolved backend for one run."""
  kind: str                                # its name in strategies/registry.py BACKENDS
  strategy: tf.distribute.Strategy
  devices: tuple                           # device names the replicas run on
  replicas: int = 1                        # data-parallel replicas (global: all processes)
  gradient_accumulation: int = 1           # micro-batches per optimizer step and replica
  steps_per_execution: int = 1             # steps per device call (Keras compile option); 0: IPUs derive
                                           # it for each compile from the splits' steps (strategies/ipu.py)
  jit_compile: bool = False
  cache_dir: Optional[str] = None          # executable cache in effect (IPU or XLA), for reporting
  # The processor and its facts, the resolved --precision among them (model.layer_forms); None: a
  # Hardware of device `kind` in float32 with no more known of it (see __post_init__).
  hardware: Optional[Hardware] = None

  rank = 0                                 # this process among all processes (workers, instances)
  world_size = 1                           # processes training together
  pipeline_stages = 1                      # stages placed on devices of their own (1: the model runs whole)

  # Whether this hardware places --pipeline_stages on devices of their own (IPUs); elsewhere the model
  # runs whole, with the same gradient accumulation.
  places_pipeline_stages = False  # class attributes, not dataclass fields
  # Whether TensorFlow's profiler (`--profile_dir`, TensorBoard's profile plugin) sees this hardware's
  # ops; IPU profiles come from Poplar's POPLAR_ENGINE_OPTIONS instead.
  profiles_with_tensorflow = True

  def __post_init__(self):
    if self.hardware is None:
      object.__setattr__(self, "hardware", Hardware(device=self.kind, precision=precision_lib.FLOAT32))

  @property
  def precision(self) -> precision_lib.Precision:
    """The resolved --precision, as a value (its one owner is the Hardware)."""
    return self.hardware.precision

  @property
  def replicas_here(self) -> int:
    """The replicas this process feeds (here, one process: all of them)."""
    return self.replicas

  @property
  def is_chief(self) -> bool:
    """Whether this process writes the run's outputs (always, except non-chief workers)."""
    return self.rank == 0

  def output_dir(self, logdir: str) -> str:
    """Where this process writes TensorBoard events, checkpoints and summary.yaml: `logdir` for the
    chief; a scratch folder for the others, which run the same code but must not write the run's files."""
    if self.is_chief:
      return logdir
    return tempfile.mkdtemp(prefix="process%d-" % self.rank)

  def alone(self) -> Optional["Backend"]:
    """A backend for this process to run inference on by itself (the others may have exited); None
    where this hardware cannot. Several CPU/GPU workers: the default strategy on the first device."""
    if self.world_size == 1:
      return self
    fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(Backend)}
    fields.update(strategy=tf.distribute.get_strategy(), devices=tuple(self.devices[:1]), replicas=1,
                  gradient_accumulation=1, steps_per_execution=1)
    return Backend(**fields)  # the same precision and hardware choices, on one device

  def device_errors(self):
    """A context for Keras' fit, evaluate and predict in which this hardware's failures to reach its
    devices (none attached, busy, a time-out) become a UserError. Here: none to translate."""
    return contextlib.nullcontext()

  def any_process(self, flag: bool) -> bool:
    """Whether `flag` is set in any process of the run (a collective every process must reach)."""
    return flag

  def fit_input(self, dataset: tf.data.Dataset, steps: int):
    """(x, steps) for Keras fit/evaluate/predict: the dataset, with tf.data's auto-sharding off."""
    return without_auto_shard(dataset), steps

  @property
  def label(self) -> str:
    """Upper-case name used in banners, e.g. "CPU"."""
    return self.kind.upper()

  def effective_batch(self, micro_batch: int) -> int:
    """Samples per optimizer step: micro-batch x gradient accumulation x replicas."""
    return micro_batch * self.gradient_accumulation * self.replicas

  def samples_per_step(self, micro_batch: int) -> int:
    """Samples that one Keras training step takes, over all processes (what throughput counts per
    step a callback sees): here one optimizer step's, the accumulating step walking through them."""
    return self.effective_batch(micro_batch)

  def optimizer_steps(self, steps: int) -> int:
    """Optimizer updates in `steps` steps of a training split: here a step is one update (the
    accumulating train step walks through its G micro-batches)."""
    return steps

  def layout(self, micro_batch: int, batch_dependent: bool = False) -> BatchLayout:
    """How batches of `micro_batch` rows per replica reach the replicas; `batch_dependent`: the network's
    outputs for a sample depend on its batch (model.batch_dependent), for hardware whose evaluation
    batch would otherwise differ from the training one. Here evaluation splits the global batch."""
    del batch_dependent
    # tf.distribute splits each global batch between replicas; a replica's G micro-batches arrive
    # together and the accumulating train step walks through them. It splits a short last batch
    # too, so evaluation reads every sample; Keras weights each replica's mean by its rows.
    return BatchLayout(replicas=self.replicas, replica_rows=micro_batch * self.gradient_accumulation,
                       eval_replica_rows=micro_batch if self.gradient_accumulation > 1 else None,
                       eval_keeps_tail=True)

  def prepare_model(self, model: tf.keras.Model, stage_boundaries=()) -> tf.keras.Model:
    """Called inside the strategy scope, before compile()."""
    del stage_boundaries  # Pipeline stages are an IPU placement; here the model runs whole.
    return accumulation.with_accumulation(model, self.gradient_accumulation)

  def inference_model(self, model: tf.keras.Model, stage_boundaries=()) -> tf.keras.Model:
    """Called inside the strategy scope for evaluation and prediction alone (no optimizer)."""
    del stage_boundaries
    return model

  def optimizer_kwargs(self) -> dict:
    return {}

  def optimizer_factories(self) -> dict:
    """Replacements for optimizers of the registry: name -> (a Keras OptimizerV2 class, its fixed keyword
    arguments); training/optimizers.py `make_optimizer` adds the learning rate, weight decay and clip."""
    return {}

  def compile_kwargs(self, train_steps, eval_steps=()) -> dict:
    """compile() options; `train_steps` (None for inference alone) and `eval_steps` are the splits'
    per-replica steps, for backends whose steps_per_execution must fit them."""
    del train_steps, eval_steps
    kwargs = {"steps_per_execution": self.steps_per_execution}
    if self.jit_compile:
      kwargs["jit_compile"] = True
    return kwargs
