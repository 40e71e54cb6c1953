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
    first layer's compute dtype. `options` choose the form of its layers (one of its `forms`, below;
    `standard_layers` for tools/benchmark_forms.py): a builder declares, as keyword parameters, the ones
    it honours, and receives only those (`accepted_options`);
  - optionally `forms(hardware) -> tuple of dicts`: forms of its layers that compute the same function,
    as `build`'s keyword options, the fastest known for `hardware` first (strategies/backend.py
    `Hardware`, read by attribute: the processor, precision and CPU features), then others worth timing
    on the machine (`--autotune`, training/autotune.py); without it `({},)` (`layer_forms`). The
    Neuron-Inverter's are `model/neuron_inverter/cpu_forms.py`'s;
  - `loss()` and `metrics()` for `compile`;
  - optionally `summary_note(net) -> str or None`, lines logged under the model summary (the
    Neuron-Inverter's explain padded layer widths and batch statistics);
  - optionally `STAGE_BOUNDARIES`, the names of the first layers of pipeline stages 2, 3, ... (IPU
    pipelining and sharding split the model there; without it the model runs as one stage);
  - optionally `SAVED_MODEL_FORM`, form options that an exported SavedModel is built with
    (analysis/export.py), where a form of training's would not load elsewhere.
- The output layer is built with `dtype="float32"`, so that under mixed precision the loss is computed
  at full precision.
- The `ModelInfo` entry names the module, its dataset (a key of `data.DATASETS`: a loader module with
  `load(config, layout, first_epoch) -> data.splits.Splits`), its task ("classification" reports
  accuracy; "regression" on the cellSpike data allows `--predict` and `tools/predict.py`, whose
  report is per conductance), the banner title and the defaults of the flags that
  are left unset (`flags.MODEL_DEFAULTED`), with `source_defaults` for those that depend on the data
  source. `options` declares the model's own hyperparameters (`model/options.py` `Option`, e.g.
  `model/neuron_inverter/options.py`): each is a flag, and the builder reads its values with
  `option_values(config)`; `batch_dependent(values)` says whether a sample's outputs depend on the other
  samples of its batch (batch statistics in evaluation), which the backend's batch layout must keep.
"""

import dataclasses
import importlib
import inspect
from typing import Callable, Optional

from data import mnist_sources
from errors import UserError
from model import options as options_lib
from model.neuron_inverter import options as neuron_inverter_options


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  """What the application needs to know about a model before building it."""
  module: str            # module with build(config) -> tf.keras.Model, loss(), metrics()
  dataset: str           # key in data.DATASETS
  task: str              # "classification" or "regression"
  title: str            # banner: "<title>, running on <BACKEND>"
  description: str
  defaults: dict         # flag values used when the user leaves the flag unset
  options: dict = dataclasses.field(default_factory=dict)  # name -> model.options.Option
  batch_dependent: Optional[Callable[[dict], bool]] = None  # option values -> outputs depend on the batch
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
        options=neuron_inverter_options.OPTIONS,
        batch_dependent=neuron_inverter_options.batch_dependent,
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


def declared_options() -> dict:
  """Every model's options, name -> Option (one flag each). Two models may declare the same name only
  with the same Option, since they share its flag."""
  declared = {}
  for name, info in sorted(MODELS.items()):
    for option_name, option in info.options.items():
      if declared.setdefault(option_name, option) != option:
        raise ValueError("model %r declares option %r unlike another model: one flag cannot be both"
                         % (name, option_name))
  return declared


def option_values(config) -> dict:
  """The values of `config.model`'s options: `config.model_options`', else each one's default."""
  return options_lib.values(get_model_info(config.model).options, config.model_options)


def settle_options(config, hardware):
  """`config` with its model's options all given, each "auto" settled for `hardware` (the backend's
  `Hardware`): what the run builds, and what run_config.yaml and summary.yaml record."""
  settled = options_lib.settled(get_model_info(config.model).options, config.model_options, hardware)
  return dataclasses.replace(config, model_options=settled)


def identity_options(config) -> dict:
  """The option values a checkpoint of this model must match (`Option.identity`)."""
  values = option_values(config)
  return {name: values[name] for name in identity_option_names(config.model)}


def identity_option_names(model_name: str) -> list:
  """The names of the options of model `model_name` that its checkpoints record ([] for a name not registered)."""
  info = MODELS.get(model_name)
  return [name for name, option in (info.options.items() if info else ()) if option.identity]


def before_recorded(model_name: str) -> dict:
  """Identity option -> the value a checkpoint written before its run recorded the option was made with."""
  info = MODELS.get(model_name)
  return {name: option.before_recorded for name, option in (info.options.items() if info else ())
          if option.before_recorded is not None}


def batch_dependent(config) -> bool:
  """Whether `config`'s network gives a sample outputs that depend on the rest of its batch."""
  info = get_model_info(config.model)
  return bool(info.batch_dependent and info.batch_dependent(option_values(config)))


def accepted_options(builder, **options) -> dict:
  """The `options` that `builder` declares as keyword parameters: a builder names the options it
  honours (the forms of its layers, `layer_forms`; `standard_layers` for the benchmark of forms); the
  others do not apply to it."""
  parameters = inspect.signature(builder).parameters
  return {name: value for name, value in options.items() if name in parameters}


def layer_forms(module, hardware) -> tuple:
  """The forms of builder `module`'s layers for `hardware` (the backend's `Hardware`), as `build`'s
  keyword options: `module.forms(hardware)`, the built-in choice first; `({},)` for a module without
  forms of its own."""
  forms = getattr(module, "forms", None)
  return tuple(forms(hardware)) if forms else ({},)


def build_network(module, config, input_shape, num_outputs: int, form: dict):
  """The uncompiled network of builder `module` (`get_model_module(config.model)`) for samples of
  `input_shape`, its layers in `form` (one of `layer_forms`; the options its builder accepts), and its
  pipeline `STAGE_BOUNDARIES` (() if none).

  Training, prediction and export all build through here (inside the backend's strategy scope)."""
  net = module.build(config, tuple(input_shape), num_outputs, **accepted_options(module.build, **form))
  return net, tuple(getattr(module, "STAGE_BOUNDARIES", ()))


def get_model_module(name: str):
  """Imports and returns the builder module of model `name` (this imports TensorFlow)."""
  return importlib.import_module(get_model_info(name).module)
