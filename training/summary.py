"""`<logdir>/summary.yaml`: the machine-readable result of a run.

These keys are a contract that scripts rely on, for every model: model, backend, replicas,
global_batch_size, epochs, train_loss, val_loss (null without validation), test_loss, test_accuracy
(classification only), samples_per_sec_per_replica, compile_seconds, wall_seconds.
"""

import glob
import math
import os
import shlex
import shutil
import sys

import numpy as np
import yaml

import model
from errors import UserError, given_path, shown_path
from host import atomic_files
from run_config import RunConfig, flag_name
from training.logs import LOG_FILE, duration
from training.run_folder import HISTORY_FILE

REQUIRED_KEYS = ("model", "backend", "replicas", "global_batch_size", "epochs", "train_loss",
                 "val_loss", "test_loss", "samples_per_sec_per_replica", "compile_seconds",
                 "wall_seconds")


def build_summary(config: RunConfig, backend, info, splits, history: dict, test_results: dict, test_epoch,
                  throughput, checkpointing, *, global_batch_size: int, first_epoch: int,
                  wall_seconds: float, fit_seconds: float, weights_sha256: str,
                  tensorflow_version: str, keras_policy: str = None, total_seconds: float = None,
                  stops: dict = None, init_from: dict = None, layer_forms: tuple = ({}, "built-in")) -> dict:
  """The summary of a finished run, from its parts: what summary.yaml holds (REQUIRED_KEYS and more).
  `history` is this invocation's epochs; a resume that only tested (its run stopped after the last
  epoch) has none, and the last losses and rate are then the last epoch's from the checkpoint.
  summary.yaml's `history` is the whole run's, every epoch since the first across resumes (its `epoch`
  list, 1-based); `first_epoch` says where this invocation began. `stops`: how training ended early
  (`stopped_early`, `time_to_target_seconds` and its kin, training/stopping.py), `init_from`: where the
  starting weights came from, `layer_forms`: (form, chosen_by), the form of the model's layers trained
  with (forms_record)."""
  full_history = _full_history(checkpointing.epoch_logs)
  last = history if history.get("loss") else full_history
  rate = throughput.samples_per_sec_per_replica
  summary = {
      "model": config.model,
      "backend": backend.kind,
      "replicas": backend.replicas,
      "global_batch_size": global_batch_size,
      "per_replica_batch_size": config.batch_size,
      "gradient_accumulation": backend.gradient_accumulation,
      "precision": backend.precision.name,
      "keras_policy": keras_policy,  # the Keras mixed-precision policy that --precision became here
      **forms_record(*layer_forms),
      "epochs": config.epochs,
      "first_epoch": first_epoch,
      "steps_per_epoch": splits.train.steps,
      "train_samples_per_epoch": backend.optimizer_steps(splits.train.steps) * global_batch_size,  # all processes'
      "train_loss": _last(last, "loss"),
      "val_loss": _last(last, "val_loss"),
      "test_loss": float(test_results["loss"]) if "loss" in test_results else None,
      "test_weights_epoch": test_epoch,
      # Every sample on CPUs and GPUs (a short last batch); whole batches on IPUs, which need static
      # shapes, of a size that divides each replica's share where one does (data.splits.eval_layout).
      "test_samples": splits.test.samples * backend.world_size if splits.test and test_results else None,
      "samples_per_sec_per_replica": rate,
      "samples_per_sec": rate * backend.replicas if rate is not None else None,  # all replicas together
      "compile_seconds": throughput.compile_seconds,  # null where the first execution ran several steps
      "first_execution_seconds": throughput.first_execution_seconds,
      "first_execution_steps": throughput.first_execution_steps,
      "executable_from_cache": throughput.from_cache,
      "wall_seconds": wall_seconds,
      "total_seconds": total_seconds,  # from the process start: flags, data, TensorFlow, training, test
      "seconds_per_epoch": _epoch_time_stats(history),
      "wall_seconds_per_epoch": _epoch_time_stats(history, "epoch_wall_seconds"),
      "fit_seconds": fit_seconds,
      "best_val_loss": None if math.isinf(checkpointing.best_val_loss) else checkpointing.best_val_loss,
      "best_val_epoch": checkpointing.best_epoch,
      "final_lr": _last(last, "lr"),
      "data_source": splits.source,
      "devices": list(backend.devices),
      # Training's steps per device execution as compiled (IPUs derive theirs from the splits' steps
      # for a --steps_per_execution of 0, which params keeps).
      "steps_per_execution": backend.compile_kwargs(splits.train.steps, splits.evaluation_steps)["steps_per_execution"],
      "machine": backend.hardware.signature or None,  # the CPU behind the figures above (CPU backend)
      "rank": backend.rank,
      "world_size": backend.world_size,
      "replicas_per_process": backend.replicas_here,  # this process's (the chief's): workers, poprun instances
      "weights_sha256": weights_sha256,
      "tensorflow_version": tensorflow_version,
      "init_from": init_from,
      **(stops or {}),
      "params": recorded_settings(config),
      "history": full_history,
  }
  summary.update(splits.summary_extras)
  if info.task == "classification":
    summary["train_accuracy"] = _last(history, "accuracy")
    summary["test_accuracy"] = float(test_results["accuracy"]) if "accuracy" in test_results else None
  return summary


def forms_record(form: dict, chosen_by: str) -> dict:
  """The form of the model's layers a run trained with (model.layer_forms: the builder's options) and how
  it was chosen ("built-in", or "measured" or "cached" by --autotune), as summaries record them."""
  return {"layer_forms": dict(form), "layer_forms_chosen_by": chosen_by}


def _last(history: dict, key: str):
  values = history.get(key)
  return float(values[-1]) if values and values[-1] is not None else None


def _epoch_time_stats(history: dict, key: str = "epoch_seconds"):
  """Mean and standard deviation of this run's epoch times, without its first epoch, which carries
  the compilation; named, so that summary.yaml reads without the README."""
  seconds = history.get(key, [])[1:]
  if not seconds:
    return None
  return {"mean": float(np.mean(seconds)), "std": float(np.std(seconds)), "epochs": len(seconds)}


def _full_history(epoch_logs: list) -> dict:
  """Per-key lists over every epoch of the run since epoch 1, across resumes (None where missing)."""
  keys = []
  for entry in epoch_logs:
    keys += [key for key in entry if key not in keys]
  return {key: [entry.get(key) for entry in epoch_logs] for key in keys}


def _plain(value):
  """numpy scalars and tuples to plain YAML types."""
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


def write_summary(logdir: str, summary: dict) -> str:
  """Writes summary.yaml atomically (temporary name, then rename) and returns its path."""
  missing = [key for key in REQUIRED_KEYS if key not in summary]
  if missing:
    raise ValueError("summary is missing contract keys: %s" % ", ".join(missing))
  return write_yaml(os.path.join(logdir, "summary.yaml"), summary)


def write_yaml(path: str, content: dict) -> str:
  """Writes `content` (numpy scalars as plain numbers) to `path` atomically (host/atomic_files.py: a
  fresh temporary name, fsync, rename; never through a link). Returns `path`. A link at `path`, or a
  failed write (a full disk), is a UserError naming it, with `path` as it was."""
  text = yaml.safe_dump(_plain(content), sort_keys=False)  # whole before the file is touched
  atomic_files.write_text(path, text)
  return path


def read_summary(logdir: str) -> dict:
  """`<logdir>/summary.yaml` as a dict; {} when the run has none (not finished) or it holds no mapping."""
  path = os.path.join(logdir, "summary.yaml")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    content = yaml.safe_load(f)
  return content if isinstance(content, dict) else {}


def _loss_line(name: str, loss, baseline) -> str:
  # Three decimals for the ratio: "below half the baseline" is the first thing a user checks, and
  # 0.4952 printed as 0.50 read as a miss.
  if baseline:
    return "%s %.4f (%.3f of the mean-predictor baseline %.4f)" % (name, loss, loss / baseline, baseline)
  return "%s %.4f" % (name, loss)


def closing_report(summary: dict, logdir: str, argv=(), processes: int = 1) -> str:
  """The last lines a user reads: how well the run learned, where its outputs are, what to run next.

  `argv` is the run's command line (`sys.argv`); the resume line repeats its flags, since a resume
  must be given the same model, design and optimizer (mid-epoch also the same replicas and batch). A
  run of several `processes` (workers, poprun instances) is continued by launching them all again.
  """
  pasted = given_path(logdir)  # as the commands below name it (tool_command makes its own)
  lines = ["", "Run finished: %s" % pasted]
  time_line = _time_line(summary)
  if time_line:
    lines.append("  time: " + time_line)
  if summary.get("best_val_loss") is not None:
    lines.append("  validation: %s, epoch %d; last epoch %.4f" % (
        _loss_line("best", summary["best_val_loss"], summary.get("mean_predictor_val_loss")),
        summary["best_val_epoch"], summary["val_loss"]))
  stop_line = _stop_line(summary)
  if stop_line:
    lines.append("  " + stop_line)
  if summary.get("test_loss") is not None:
    # Each split against its own baseline: the training mean scores 0.3326 on the built-in data's
    # validation split and 0.3336 on its test split.
    test = _loss_line("loss", summary["test_loss"], summary.get("mean_predictor_test_loss"))
    if summary.get("test_accuracy") is not None:
      test += ", accuracy %.4f" % summary["test_accuracy"]
    details = []
    if summary.get("test_samples"):
      details.append("%d samples" % summary["test_samples"])
    if summary.get("test_weights_epoch"):
      details.append("weights of epoch %d" % summary["test_weights_epoch"])
    if details:
      test += " (%s)" % ", ".join(details)
    lines.append("  test: %s" % test)
  lines.append("  outputs: %s" % _outputs(logdir))
  lines += ["Next:", "  " + tool_command("serve_tensorboard.py", logdir)]
  if model.get_model_info(summary["model"]).task == "regression":  # tools/predict.py's reports
    lines.append("  " + tool_command("predict.py", logdir))
  epochs = summary["epochs"] + 5
  note = relaunch_note(processes)
  lines.append("  %s   # train on to epoch %d%s" % (
      resume_line(argv or ["main.py", "--model=%s" % summary["model"]], pasted, epochs), epochs,
      ", " + note if note else ""))
  return "\n".join(lines)


def _time_line(summary: dict) -> str:
  """The run's time in all and in training, and its training rate over all replicas and per replica."""
  parts = []
  if summary.get("total_seconds"):
    parts.append("%s in all" % duration(summary["total_seconds"]))
  first, trained = summary.get("first_epoch"), summary.get("history", {}).get("epoch") or []
  if summary.get("fit_seconds") and first:
    epochs = len([epoch for epoch in trained if epoch >= first])
    parts.append("%s training (%s)" % (duration(summary["fit_seconds"]), _count(epochs, "epoch")))
  if summary.get("samples_per_sec"):
    replicas = summary.get("replicas") or 1
    rate = "%s samples/s" % format(int(round(summary["samples_per_sec"])), ",")
    if replicas > 1:
      rate += " on %d replicas (%s per replica)" % (
          replicas, format(int(round(summary["samples_per_sec_per_replica"])), ","))
    parts.append(rate)
  return ", ".join(parts)


def _count(number: int, noun: str) -> str:
  return "%d %s%s" % (number, noun, "" if number == 1 else "s")


def _stop_line(summary: dict) -> str:
  """Why training ended before its --epochs, and the time to a --target_loss."""
  stopped = summary.get("stopped_early") or {}
  target = (summary.get("params") or {}).get("target_loss")
  if stopped.get("reason") == "target_loss":
    return "target: validation loss at or below %g after epoch %d, %s from the start (%s of training)" % (
        target, summary["target_epoch"], duration(summary["time_to_target_seconds"]),
        duration(summary["time_to_target_training_seconds"]))
  if target is not None and "time_to_target_seconds" in summary:
    line = "target: validation loss %g not reached" % target
  else:
    line = ""
  if stopped.get("reason") == "early_stopping":
    patience = (summary.get("params") or {}).get("early_stopping_patience")
    line += ("; " if line else "") + "stopped early after epoch %d: no lower validation loss for %s" % (
        stopped["after_epoch"], _count(patience or 0, "epoch"))
  return line


def run_folder_lines(logdir: str) -> str:
  """A run's first lines: its folder, and the commands that watch it while it trains (TensorBoard, and
  its log, which appears once the run's checks pass: `tail -F` waits for it)."""
  return "\n".join(["Run folder: %s" % given_path(logdir),
                    "  watch: " + tool_command("serve_tensorboard.py", logdir),
                    "  tail -F %s" % shlex.quote(given_path(os.path.join(logdir, LOG_FILE)))])


def interrupted_report(argv, logdir: str, epochs: int, processes: int = 1) -> str:
  """After a graceful stop: the command that continues the run (its warning line names the checkpoint)."""
  lines = ["Continue with:", "  " + resume_line(argv, given_path(logdir), epochs)]
  note = relaunch_note(processes)
  return "\n".join(lines + (["  (%s)" % note] if note else []))


# Set by the job scripts of tools/slurm/ for their runs: the sbatch command that submits the same job
# again, with the flags it was given. A batch job is continued by a new job, not by a python line.
RESUBMIT_VARIABLE = "NEURON_INVERTER_RESUBMIT"


def relaunch_note(processes: int) -> str:
  """What to add to a resume line: the sbatch options of a job script's run, or for a run of several
  processes launched by hand, that each must be launched again."""
  if os.environ.get(RESUBMIT_VARIABLE):
    return "with the sbatch options this job was given, if any"
  if processes <= 1:
    return ""
  return "in each of the %d processes, launched as before: srun, poprun or TF_CONFIG" % processes


def _outputs(logdir: str) -> str:
  """What the run folder holds, as the closing report lists it (only what is there)."""
  def present(*names):
    return [name for name in names if os.path.exists(os.path.join(logdir, *name.split("/")))]
  parts = present("summary.yaml", "run_config.yaml", LOG_FILE, HISTORY_FILE)
  checkpoints = [name.split("/")[1] for name in present("checkpoints/last", "checkpoints/best")]
  if checkpoints:
    parts.append("checkpoints/{%s}" % ",".join(checkpoints) if len(checkpoints) > 1
                 else "checkpoints/%s" % checkpoints[0])
  events = [name + "/" for name in present("train", "validation", "test")]
  if glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    events.append("the settings for the HParams tab")  # training/hparams.py
  if events:
    parts.append("TensorBoard events (%s)" % ", ".join(events))
  if present("predict"):
    parts.append("predict/ (figures, sum_pred.yaml, TensorBoard images)")
  return ", ".join(parts)


def resume_line(argv, logdir: str, epochs: int) -> str:
  """The line a user pastes to continue the run: this Python, then `resume_command`; in a job
  script's run, the script's sbatch command (RESUBMIT_VARIABLE), where later flags win."""
  resubmit = os.environ.get(RESUBMIT_VARIABLE)
  if resubmit:
    return " ".join([resubmit] + [shlex.quote(word) for word in _resume_flags(logdir, epochs)])
  return "%s %s" % (python_command(), resume_command(argv, logdir, epochs))


# Flags the resume line sets itself, and those of them that take a value.
_RESUME_SETS = ("logdir", "epochs", "resume", "noresume")
_RESUME_VALUED = ("logdir", "epochs")


def resume_command(argv, logdir: str, epochs: int) -> str:
  """`argv` (script, then flags) as a shell command that continues the run in `logdir` up to `epochs`:
  the run's own flags as given, except any --logdir / --epochs / --[no]resume, which it replaces."""
  kept, skip_value = [], False
  for token in argv[1:]:
    if skip_value:  # the value of `--logdir DIR` or `--epochs N`
      skip_value = False
      continue
    name = flag_name(token)
    if name in _RESUME_SETS:
      skip_value = name in _RESUME_VALUED and "=" not in token
      continue
    kept.append(token)
  script = shown_path(argv[0])
  words = [script] + kept + _resume_flags(logdir, epochs)
  return " ".join(shlex.quote(word) for word in words)


def _resume_flags(logdir: str, epochs: int) -> list:
  return ["--logdir=" + logdir, "--resume", "--epochs=%d" % epochs]


def python_command() -> str:
  """How to call this Python in a command to paste, quoted for the shell where its path needs it: by
  its path relative to the working folder when it lies there (`make run`'s .venv, which the user has
  not activated); by the name `python3` or `python` when the PATH finds that name in this Python's own
  folder (an activated environment, a container's interpreter); else by its whole path, since another
  `python` would lack this one's packages."""
  shown = shown_path(sys.executable)
  if shown != sys.executable:  # below the working folder
    return shlex.quote(shown)
  folder = os.path.dirname(os.path.abspath(sys.executable))
  for name in ("python3", "python"):
    found = shutil.which(name)
    if found and os.path.dirname(os.path.abspath(found)) == folder:
      return name
  return shlex.quote(sys.executable)


_TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def tool_command(tool: str, logdir: str) -> str:
  """The command that runs `tools/<tool>` on `logdir`, as the user can paste it here."""
  return "%s %s --logdir %s" % (python_command(), shlex.quote(shown_path(os.path.join(_TOOLS, tool))),
                                shlex.quote(given_path(logdir)))


RUN_CONFIG_FILE = "run_config.yaml"
# run_config.yaml's one key that is no setting: the command that started the run (or its last --resume),
# its arguments as typed, flag files unexpanded.
COMMAND_LINE_KEY = "command_line"


def write_run_config(logdir: str, config, command_line=None) -> str:
  """Writes `<logdir>/run_config.yaml` (the whole RunConfig, as settled, and `command_line`, the arguments
  as typed, where given) at the start of a run; returns its path.

  summary.yaml records the settings under `params`, but only when training ends: this file lets
  `tools/predict.py` evaluate a run that is still going or was cut short, without repeating its flags.
  """
  content = recorded_settings(config)
  if command_line:
    content[COMMAND_LINE_KEY] = [str(argument) for argument in command_line]
  return write_yaml(os.path.join(logdir, RUN_CONFIG_FILE), content)


def recorded_settings(config) -> dict:
  """Every setting of `config` under its flag's name, each of its model's options included (a config made
  directly, not from the flags, may leave some to their defaults)."""
  return dict(config.as_dict(), **model.option_values(config))


def read_run_config(logdir: str) -> dict:
  """The saved run configuration of `logdir`: run_config.yaml, else summary.yaml's `params`.

  Returns a plain dict (possibly from an older or newer version of the application); None if neither
  file holds one. A run_config.yaml that holds no mapping is a UserError: it is read first, and
  falling back to summary.yaml past a damaged one would hide the damage.
  """
  saved = saved_run_config(logdir)
  return saved[1] if saved else None


def saved_run_config(logdir: str):
  """(the file it came from, as messages name it, the saved run configuration), or None."""
  for name, key in ((RUN_CONFIG_FILE, None), ("summary.yaml", "params")):
    path = os.path.join(logdir, name)
    if not os.path.isfile(path):
      continue
    try:
      with open(path) as f:
        content = yaml.safe_load(f)  # python/... tags are refused (ConstructorError), never run
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
      raise UserError("%s: not a readable run configuration (%s)" % (path, " ".join(str(error).split())))
    if key is None and not isinstance(content, dict):
      raise UserError("%s: holds %s; expected a mapping of flag names to values, as main.py writes it"
                      % (path, _described(content)))
    if isinstance(content, dict):
      content = content.get(key) if key else content
    if isinstance(content, dict):
      settings = {name: value for name, value in content.items() if name != COMMAND_LINE_KEY}
      return (path if key is None else "%s (%s)" % (path, key)), settings
  return None


def _described(content) -> str:
  """What a YAML file that should hold a mapping holds instead, for a message."""
  if content is None:
    return "nothing"
  if isinstance(content, list):
    return "a list"
  text = repr(content)
  return "the single value %s" % (text if len(text) <= 40 else text[:37] + "...")


# Fields of a saved run configuration that evaluation resets: the model runs whole, once, unprofiled.
EVAL_OVERRIDES = {"resume": False, "predict": False, "compile_only": False, "profile_dir": None,
                  "gradient_accumulation": 1, "pipeline_stages": 1, "ipus_per_replica": 1,
                  "steps_per_execution": 0, "steps_per_epoch": 0, "eval_steps": 0}
