"""`select_backend(config)`: the one function that turns a run config into a `Backend`."""

import dataclasses

import tensorflow as tf
from absl import logging

from errors import UserError
from run_config import RunConfig
from strategies import cpu, device_pipelines, environment, gpu, ipu, multiworker
from strategies.backend import Backend

_CREATORS = {"cpu": cpu.create, "gpu": gpu.create, "ipu": ipu.create}
# Keras policies per --precision: IPUs and GPUs compute in float16; this CPU family has bfloat16
# arithmetic (AVX-512 BF16 / AMX) but no fast float16.
_POLICIES = {
    "32.32": {"cpu": "float32", "gpu": "float32", "ipu": "float32"},
    "16.32": {"cpu": "mixed_bfloat16", "gpu": "mixed_float16", "ipu": "mixed_float16"},
    "16.16": {"cpu": "bfloat16", "gpu": "float16", "ipu": "float16"},
}


def resolve_kind(requested: str) -> str:
  """Maps "auto" to the best backend present: IPU, then GPU, then CPU."""
  if requested != "auto":
    return requested
  if ipu.graphcore_tensorflow_available() and ipu.ipus_present():
    return "ipu"
  if gpu.visible_gpus():
    return "gpu"
  return "cpu"


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


def resolve_precision(requested: str, kind: str) -> str:
  """--precision=auto: mixed 16-bit where the processor has 16-bit arithmetic units, else float32."""
  if requested != "auto":
    return requested
  native = {"ipu": lambda: True, "gpu": gpu.has_tensor_cores,
            "cpu": lambda: cpu.has_bfloat16_units() and cpu.bfloat16_kernels_available()}[kind]()
  return "16.32" if native else "32.32"


def set_precision(precision: str, kind: str) -> str:
  policy = _POLICIES[precision][kind]
  tf.keras.mixed_precision.set_global_policy(policy)
  return policy


def select_backend(config: RunConfig) -> Backend:
  """Returns the backend for `config.backend` with `config.replicas` data-parallel replicas."""
  check_keras_2()
  kind = resolve_kind(config.backend)
  if kind not in _CREATORS:
    raise UserError("unknown backend %r; valid backends: auto, %s" % (kind, ", ".join(_CREATORS)))
  source = multiworker.cluster_source() if kind in ("cpu", "gpu") else None
  if kind in ("cpu", "gpu"):
    device_pipelines.apply()
  backend = multiworker.create(config, kind, source) if source else _CREATORS[kind](config)
  precision = resolve_precision(config.precision, kind)
  hardware = {}
  if kind == "cpu":
    cpu.check_precision(precision)
    hardware = cpu.conv_options(precision)
  backend = dataclasses.replace(backend, cache_dir=environment.executable_cache_dir(kind), precision=precision,
                                **hardware)
  policy = set_precision(precision, kind)
  logging.info("Backend %s, %d replica(s) on %s (TensorFlow %s, Keras %s, precision %s)", backend.label,
               backend.replicas, ", ".join(backend.devices), tf.__version__, keras_version(), policy)
  if kind != "ipu" and config.pipeline_stages > 1:
    logging.info("Pipeline stages place the model on several IPUs; on %s the model runs whole, with the "
                 "same gradient accumulation (%d micro-batches per step)", backend.label,
                 backend.gradient_accumulation)
  return backend
