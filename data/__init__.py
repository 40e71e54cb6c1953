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


def load(name: str, config, layout, first_epoch: int = 0):
  """Returns the `Splits` of dataset `name` for one run."""
  if name not in DATASETS:
    raise UserError("unknown dataset %r; valid datasets: %s" % (name, ", ".join(sorted(DATASETS))))
  return importlib.import_module(DATASETS[name]).load(config, layout, first_epoch)
