"""`<logdir>/summary.yaml`: the machine-readable result of a run.

These keys are a contract that scripts rely on, for every model: model, backend, replicas,
global_batch_size, epochs, train_loss, val_loss (null without validation), test_loss, test_accuracy
(classification only), samples_per_sec_per_replica, compile_seconds, wall_seconds.
"""

import os

import numpy as np
import yaml

REQUIRED_KEYS = ("model", "backend", "replicas", "global_batch_size", "epochs", "train_loss",
                 "val_loss", "test_loss", "samples_per_sec_per_replica", "compile_seconds",
                 "wall_seconds")


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
  path = os.path.join(logdir, "summary.yaml")
  temporary = path + ".tmp"
  with open(temporary, "w") as f:
    yaml.safe_dump(_plain(summary), f, sort_keys=False)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)
  return path
