"""A run's saved configuration (run_config.yaml, else summary.yaml's params) read back into a `RunConfig`
for evaluation (`tools/predict.py`), checked by the command line's own flag definitions and validators.

It stands above `flags.py` and `training/`, so that `training/` never imports the command line. No
TensorFlow: the tool calls it before TensorFlow's start-up variables are set.
"""

import os

from absl import logging

import flags
import model
from errors import UserError
from run_config import RunConfig
from training import summary


def load_run_config(logdir: str, tool_defaults: dict = None, **overrides) -> RunConfig:
  """The RunConfig a run in `logdir` was trained with, reset for evaluation, updated by `overrides`.

  Keys the current RunConfig does not know (a newer or older run) are ignored, and missing (or null)
  ones take their defaults, each with one warning line naming them: a hand-edited typo (`desgin:`)
  would otherwise evaluate another network than the run trained. The model has no default: without
  it the file is refused. Overrides that are None are ignored. `tool_defaults` are a tool's own
  defaults (predict.py's --backend=auto, --replicas=1): applied as overrides, but left out of the
  messages that name what the user changed. No TensorFlow: tools call this before it starts.
  """
  if not os.path.isdir(logdir):
    raise UserError("--logdir=%s does not exist or is not a folder" % logdir)
  found = summary.saved_run_config(logdir)
  if found is None:
    raise UserError("--logdir=%s holds neither %s nor a summary.yaml with params: not a training run "
                    "folder" % (logdir, summary.RUN_CONFIG_FILE))
  source, saved = found
  if saved.get("model") is None:
    raise UserError("%s: model is %s; expected the model the run trained (%s)" % (
        source, "missing" if "model" not in saved else "null", "|".join(sorted(model.MODELS))))
  unknown = [str(key) for key in saved if key not in flags.RUN_CONFIG_FIELDS and key not in flags.MODEL_OPTIONS]
  if unknown:
    logging.warning("%s: ignoring %s, not settings of this version of the application (a typo, or a run "
                    "of another version)", source, ", ".join(unknown))
  values = dict(saved, **summary.EVAL_OVERRIDES, logdir=logdir)
  given = {key: value for key, value in overrides.items() if value is not None}
  values.update(tool_defaults or {}, **given)
  changed = ["--%s=%s" % (key, value) for key, value in given.items() if saved.get(key) != value]
  # Unset: not in the file (nor reset or given here), or null where the setting is no optional one.
  defaults = {name: field.default for name, field in flags.RUN_CONFIG_FIELDS.items()}
  defaults.update((name, option.default) for name, option in model.get_model_info(values["model"]).options.items())
  defaulted = [name for name, default in defaults.items() if values.get(name) is None and default is not None]
  # The command line's own definitions and validators check it (a hand-edited value, a moved file).
  config = flags.config_from_saved(values, source + (" with %s" % " ".join(changed) if changed else ""))
  if defaulted:
    logging.warning("%s: has no value for %s; using the default%s %s", source, ", ".join(defaulted),
                    "s" if len(defaulted) > 1 else "",
                    ", ".join("%s=%s" % (name, config.as_dict()[name]) for name in defaulted))
  return config
