"""Model registry: `--model` names mapped to their builders and per-model defaults.

The registry is plain data so that `flags.py` can list the choices without importing TensorFlow (which
must not start before `strategies.environment` has set its start-up variables). A builder module is
imported only when a run asks for it. A new model is one module here plus one entry in `MODELS`.
"""

import dataclasses
import importlib

from errors import UserError


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  """What the application needs to know about a model before building it."""
  module: str            # module with build(config) -> tf.keras.Model, loss(), metrics()
  dataset: str           # key in data.DATASETS
  task: str              # "classification" or "regression"
  title: str            # banner: "<title>, running on <BACKEND>"
  description: str
  defaults: dict         # flag values used when the user leaves the flag unset


MODELS = {
    "mnist": ModelInfo(
        module="model.mnist",
        dataset="mnist",
        task="classification",
        title="Keras MNIST example",
        description="Keras MNIST check: small CNN, 3 epochs of SGD at batch 64 (about 96% test accuracy)",
        defaults={"batch_size": 64, "epochs": 3, "learning_rate": 0.01, "optimizer": "sgd"},
    ),
}


def get_model_info(name: str) -> ModelInfo:
  """Returns the registry entry for `name`, or a UserError listing the valid names."""
  try:
    return MODELS[name]
  except KeyError:
    raise UserError("unknown model %r; valid models: %s" % (name, ", ".join(sorted(MODELS)))) from None


def get_model_module(name: str):
  """Imports and returns the builder module of model `name` (this imports TensorFlow)."""
  return importlib.import_module(get_model_info(name).module)
