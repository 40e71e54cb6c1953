"""Input pipelines: dataset name -> loader module returning batched `tf.data` splits.

Each loader module exposes `load(config, global_batch_size) -> data.splits.Splits`. Loaders receive
plain arguments (the frozen config, batch and shard numbers), never flags or hardware objects.
"""

import importlib

from errors import UserError

DATASETS = {
    "mnist": "data.mnist",
}


def load(name: str, config, global_batch_size: int):
  """Returns the `Splits` of dataset `name` for one run."""
  if name not in DATASETS:
    raise UserError("unknown dataset %r; valid datasets: %s" % (name, ", ".join(sorted(DATASETS))))
  return importlib.import_module(DATASETS[name]).load(config, global_batch_size)
