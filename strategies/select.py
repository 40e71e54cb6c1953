"""`settle(config)`: the one function that turns a run config into a `Backend`, and the config into one
that holds what the backend decided.

A plain dispatcher over `strategies/registry.py`: `resolve` settles `--backend=auto` and
`--precision=auto` (from what the chosen backend's module says of its hardware) before anything is built;
then that module creates the backend, its Keras policy for the precision is set, and
`config_with_decisions` writes the backend's choices back into the config (`select_backend` is the same
for callers that want the backend alone).
"""

import dataclasses
import importlib
import os

import tensorflow as tf
from absl import logging

from errors import UserError
from run_config import RunConfig
from strategies import precision as precision_lib
from strategies.backend import Backend
from strategies.registry import BACKEND_ONLY_FIELDS, BACKENDS


def backend_module(kind: str):
  """The module of backend `kind` (a name of strategies/registry.py)."""
  if kind not in BACKENDS:
    raise UserError("unknown backend %r; valid backends: auto, %s" % (kind, ", ".join(BACKENDS)))
  try:
    return importlib.import_module(BACKENDS[kind])
  except ModuleNotFoundError as error:
    if error.name != BACKENDS[kind]:
      raise  # a module it imports is missing: its own traceback says which
    raise UserError("strategies/registry.py names module %r for backend %r, and there is no such "
                    "module" % (BACKENDS[kind], kind)) from None


def resolve_kind(requested: str) -> str:
  """Maps "auto" to the first backend of the registry present here (IPU, then GPU, then CPU)."""
  if requested != "auto":
    return requested
  return next(kind for kind in BACKENDS if backend_module(kind).present())


def resolve_precision(requested: str, kind: str) -> str:
  """--precision=auto: mixed 16-bit where backend `kind`'s processor has 16-bit arithmetic units, else
  float32 (strategies/precision.py `resolve`). The name, as the config keeps it."""
  return precision_lib.resolve(requested, lambda: backend_module(kind).has_16bit_units()).name


def resolve(config: RunConfig) -> RunConfig:
  """`config` with its backend and precision settled: never "auto" from here on (run_config.yaml and
  summary.yaml record these). The model's own "auto" options are the model's to settle, for the backend's
  `Hardware` (model.settle_options)."""
  kind = resolve_kind(config.backend)
  return dataclasses.replace(config, backend=kind, precision=resolve_precision(config.precision, kind))


def keras_version() -> str:
  """Version of the package behind `tf.keras` (keras 2.x on TF 2.6, tf-keras or Keras 3 later)."""
  if hasattr(tf.keras, "__version__"):
    return tf.keras.__version__
  package = tf.keras.__name__.split(".")[0]  # "tf_keras" or "keras"
  return __import__(package).__version__


def check_keras_2() -> None:
  """The application is written against the Keras 2 API; refuse to run on Keras 3."""
  version = keras_version()
  if not version.startswith("2."):
    raise UserError("tf.keras is Keras %s; this application needs Keras 2: pip install tf-keras and "
                    "set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported" % version)


def set_precision(precision, kind: str) -> str:
  """Sets the Keras policy of `precision` (a Precision or its name) on backend `kind`; returns its name."""
  policy = backend_module(kind).POLICIES[precision_lib.parse(precision).name]
  tf.keras.mixed_precision.set_global_policy(policy)
  return policy


def other_backends_settings(config: RunConfig) -> dict:
  """{backend: [flags]}: settings given for another backend's hardware, which this run ignores."""
  defaults = {field.name: field.default for field in dataclasses.fields(RunConfig)}
  given = {name: ["--%s=%s" % (field, getattr(config, field)) for field in fields
                  if getattr(config, field) != defaults[field]]
           for name, fields in BACKEND_ONLY_FIELDS.items() if name != config.backend}
  return {name: flags for name, flags in given.items() if flags}


def _warn_other_backends_settings(config: RunConfig, label: str) -> None:
  for name, given in other_backends_settings(config).items():
    logging.warning("%s: %s setting%s, without effect on %s", ", ".join(given), name.upper(),
                    "" if len(given) == 1 else "s", label)


def select_backend(config: RunConfig) -> Backend:
  """Returns the backend for `config.backend` with `config.replicas` data-parallel replicas."""
  return settle(config)[1]


def settle(config: RunConfig):
  """`(config, backend)`: `config` resolved (`resolve`, once) and holding what creating its backend
  decided (`config_with_decisions`), and the backend, its Keras precision policy set."""
  check_keras_2()
  config = resolve(config)
  module = backend_module(config.backend)
  module.check_precision(config.precision)
  backend = module.create(config)
  policy = set_precision(backend.precision, backend.kind)
  logging.info("Backend %s, %d replica%s on %s (TensorFlow %s, Keras %s, precision %s)", backend.label,
               backend.replicas, "" if backend.replicas == 1 else "s", ", ".join(backend.devices),
               tf.__version__, keras_version(), policy)
  _warn_other_backends_settings(config, backend.label)
  if config.pipeline_stages > 1 and not backend.places_pipeline_stages:
    logging.info("Pipeline stages place the model on several IPUs; on %s the model runs whole, with the "
                 "same gradient accumulation (%d micro-batches per step)", backend.label,
                 backend.gradient_accumulation)
  return config_with_decisions(config, backend), backend


def config_with_decisions(config: RunConfig, backend: Backend) -> RunConfig:
  """`config` with the values that creating `backend` settled, for all that reads the config from here on
  and all that records it (run_config.yaml, TensorBoard's HParams row, summary.yaml's `params`): the
  backend, the precision's name, the replicas of all processes (a multi-worker or poprun run without
  --replicas counts its cluster's), the steps per execution (1 for the flag's 0 on CPUs and GPUs; IPUs
  derive theirs at each compile and keep 0 or the request), the pipeline stages placed (1 where the model
  runs whole) and the cache folder in effect. A resumed run starts from its own flags as typed (the
  resume line repeats them) and settles these again; its checks compare data, model and batch layout."""
  return dataclasses.replace(
      config, backend=backend.kind, precision=backend.precision.name, replicas=backend.replicas,
      steps_per_execution=backend.steps_per_execution, pipeline_stages=backend.pipeline_stages,
      cache_dir=_cache_dir_in_effect(config.cache_dir, backend.cache_dir))


def _cache_dir_in_effect(requested: str, executables) -> str:
  """--cache_dir, unless the backend's executables go to a folder outside it (`executables`, e.g. poprun's
  --executable-cache-path, which wins over --cache_dir, or one set in TF_POPLAR_FLAGS or TF_XLA_FLAGS):
  then that folder. XLA's cache is a folder inside --cache_dir, which stays the root."""
  if not executables:
    return requested
  if requested:
    root = os.path.abspath(requested)
    if os.path.commonpath([root, os.path.abspath(executables)]) == root:
      return requested
  return executables
