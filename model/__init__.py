"""Model registry: `--model` names mapped to their builders and per-model defaults.

The registry is plain data so that `flags.py` can list the choices without importing TensorFlow (which
must not start before `strategies.environment` has set its start-up variables). A builder module is
imported only when a run asks for it.

Adding a model: one module here, one entry in `MODELS` (and, for new data, one loader in `data.DATASETS`).
- The module (see `model/mnist.py`, the smallest) defines:
  - `build(config, input_shape, num_outputs, **options) -> tf.keras.Model`, uncompiled. `input_shape`
    and `num_outputs` come from the data's splits; give them defaults for the model's own data (the
    tests build every registered model as `build(RunConfig(model=name))`). Inputs arrive in the
    file's dtype (float16 frames for cellSpike: half the bytes per batch) and Keras casts them to the
    first layer's compute dtype. `options` are the backend's model options (e.g. the convolution
    options of `model/neuron_inverter/conv_layers.py`): a builder declares, as keyword parameters, the ones it
    honours, and receives only those (`accepted_options`);
  - `loss()` and `metrics()` for `compile`;
  - optionally `summary_note(net) -> str or None`, a line logged under the model summary (the
    Neuron-Inverter's explains padded layer widths);
  - optionally `STAGE_BOUNDARIES`, the names of the first layers of pipeline stages 2, 3, ... (IPU
    pipelining and sharding split the model there; without it the model runs as one stage).
- The output layer is built with `dtype="float32"`, so that under mixed precision the loss is computed
  at full precision.
- The `ModelInfo` entry names the module, its dataset (a key of `data.DATASETS`: a loader module with
  `load(config, layout, first_epoch) -> data.splits.Splits`), its task ("classification" reports
  accuracy; "regression" on the cellSpike data allows `--predict` and `tools/predict.py`, whose
  report is per conductance), the banner title and the defaults of the flags that
  are left unset (`flags.MODEL_DEFAULTED`), with `source_defaults` for those that depend on the data
  source. Set `uses_design` if `--design` picks its network, `has_batch_norm` if it builds its batch
  normalisation by `config.batch_norm_statistics`.
"""

import dataclasses
import importlib
import inspect
from typing import Callable, Optional

from data import mnist_sources
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
  uses_design: bool = False  # --design picks its network (model.neuron_inverter.designs); part of a checkpoint's identity
  has_batch_norm: bool = False  # --batch_norm_statistics applies; part of a checkpoint's identity
  # Defaults that depend on the run's other flags (its data source): flag values -> {flag: default}.
  source_defaults: Optional[Callable[[dict], dict]] = None


MODELS = {
    "mnist": ModelInfo(
        module="model.mnist",
        dataset="mnist",
        task="classification",
        title="Keras MNIST example",
        description="Keras MNIST check: small CNN, 3 epochs of SGD at batch 64 (about 96% test accuracy; "
                    "45 epochs on the 3,600 offline training digits, the same steps)",
        defaults={"batch_size": 64, "epochs": 3, "learning_rate": 0.01, "optimizer": "sgd", "dropout": 0.5,
                  "warmup_epochs": 0, "lr_schedule": "plateau"},
        source_defaults=mnist_sources.source_defaults,
    ),
    "neuron_inverter": ModelInfo(
        module="model.neuron_inverter.network",
        dataset="cellspike",
        task="regression",
        title="Neuron-Inverter",
        description="1-D CNN + FC regressor: cellSpike voltage traces (1600 x 4) -> 15 conductances",
        # Sized from measured learning curves on the built-in dataset (docs/performance.md, "The default job
        # (make run)"): 48 per replica, so that the main job's 4 replicas step with the reference's batch of
        # 192 (per sample, a global batch of 768 learned less: 0.57 of the baseline after 2 epochs against
        # 0.53); Adam at 1e-3 (2e-3 learned less); no dropout, which only slowed a run this short (train and
        # validation losses stay together: 3 epochs reached 0.49 of the baseline without it, 0.51 with the
        # reference's 0.05); 3 epochs with a cosine decay, the fewest that reach half the mean-predictor
        # baseline (warm-up + plateau, whose patience is 8 epochs, would never decay).
        # The reference's own runs: --flagfile=configs/neuron_inverter_reference.flags.
        defaults={"batch_size": 48, "epochs": 3, "learning_rate": 1e-3, "optimizer": "adam", "dropout": 0.0,
                  "warmup_epochs": 0, "lr_schedule": "cosine"},
        uses_design=True,
        has_batch_norm=True,
    ),
}


def names_for_task(task: str) -> list:
  """The registered models of `task` ("classification" or "regression")."""
  return sorted(name for name, info in MODELS.items() if info.task == task)


def get_model_info(name: str) -> ModelInfo:
  """Returns the registry entry for `name`, or a UserError listing the valid names."""
  try:
    return MODELS[name]
  except KeyError:
    raise UserError("unknown model %r; valid models: %s" % (name, ", ".join(sorted(MODELS)))) from None


def accepted_options(builder, **options) -> dict:
  """The `options` that `builder` declares as keyword parameters: a builder names the options it
  honours (the backend's convolution options; `standard_layers` for the benchmark of forms); the
  others do not apply to it."""
  parameters = inspect.signature(builder).parameters
  return {name: value for name, value in options.items() if name in parameters}


def build_network(module, config, input_shape, num_outputs: int, model_options: dict):
  """The uncompiled network of builder `module` (`get_model_module(config.model)`) for samples of
  `input_shape`, with the backend's `model_options` that its builder accepts, and its pipeline
  `STAGE_BOUNDARIES` (() if none).

  Training, prediction and export all build through here (inside the backend's strategy scope)."""
  net = module.build(config, tuple(input_shape), num_outputs,
                     **accepted_options(module.build, **model_options))
  return net, tuple(getattr(module, "STAGE_BOUNDARIES", ()))


def get_model_module(name: str):
  """Imports and returns the builder module of model `name` (this imports TensorFlow)."""
  return importlib.import_module(get_model_info(name).module)
