"""Input pipelines: dataset name -> loader module returning batched `tf.data` splits.

Each loader module exposes `load(config, layout, first_epoch) -> data.splits.Splits`: batches shaped
as the backend's `data.splits.BatchLayout` asks, and the shuffling order of `first_epoch` onwards (for
resumed runs). Loaders receive
plain arguments (the frozen config, batch and shard numbers), never flags or hardware objects.
"""

import importlib

from errors import UserError

DATASETS = {
    "mnist": "data.mnist",
    "cellspike": "data.cellspike",
}
# Modules whose `check_named_files(config)` opens and validates the files that a run's flags name,
# without TensorFlow: main.py runs it before TensorFlow's import (5 s on a 2-core VM), so a mistyped
# or damaged --data_path is one error line at once. The loader takes what the check read from
# data.checked_files (not validated twice) unless the files changed since.
FILE_CHECKS = {
    "cellspike": "data.cellspike_file",
    "mnist": "data.mnist_files",
}


def load(name: str, config, layout, first_epoch: int = 0):
  """Returns the `Splits` of dataset `name` for one run."""
  if name not in DATASETS:
    raise UserError("unknown dataset %r; valid datasets: %s" % (name, ", ".join(sorted(DATASETS))))
  return importlib.import_module(DATASETS[name]).load(config, layout, first_epoch)


def check_named_files(name: str, config):
  """The files of dataset `name` that `config` names, checked before TensorFlow starts (a UserError
  names the file and what is wrong). Datasets without an entry in FILE_CHECKS are checked as loaded.
  Returns what the check read (data/sizes.py sizes the flags by it), or None."""
  if name in FILE_CHECKS:
    return importlib.import_module(FILE_CHECKS[name]).check_named_files(config)
  return None
