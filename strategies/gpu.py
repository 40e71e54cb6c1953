"""GPU backend: one GPU with a one-device strategy, N GPUs with MirroredStrategy."""

import tensorflow as tf

from errors import UserError
from run_config import RunConfig
from strategies import device_pipelines, environment, multiworker
from strategies import precision as precision_lib
from strategies.backend import Backend, Hardware, options_from_config
import tf_workarounds

POLICIES = {"32.32": "float32", "16.32": "mixed_float16", "16.16": "float16"}


def visible_gpus() -> list:
  return tf.config.list_physical_devices("GPU")


def present() -> bool:
  return bool(visible_gpus())


def check_precision(precision) -> None:
  del precision  # CUDA TensorFlow computes every --precision


def has_16bit_units() -> bool:
  return has_tensor_cores()


def has_tensor_cores() -> bool:
  """Whether every visible GPU has float16 tensor cores (compute capability 7.0 or newer)."""
  gpus = visible_gpus()
  capabilities = [tf.config.experimental.get_device_details(gpu).get("compute_capability") for gpu in gpus]
  return bool(gpus) and all(capability and capability >= (7, 0) for capability in capabilities)


def create(config: RunConfig) -> Backend:
  """Returns a GPU backend with one replica per GPU, or one worker's share of a multi-worker run; a
  UserError if too few GPUs are visible."""
  device_pipelines.apply()
  source = multiworker.cluster_source()
  if source:
    return multiworker.create(config, "gpu", "GPU", source, **_fields(config))
  replicas = config.replicas
  gpus = visible_gpus()
  if len(gpus) < replicas:
    hint = ("this machine has no NVIDIA device, no /dev/nvidia0: run on a GPU node, or use --backend=cpu"
            if not environment.nvidia_device_nodes() else
            "check CUDA_VISIBLE_DEVICES and that a CUDA-enabled TensorFlow is installed")
    raise UserError("--replicas=%d needs %d GPU%s but TensorFlow sees %d (%s)"
                    % (replicas, replicas, "" if replicas == 1 else "s", len(gpus), hint))
  for gpu in gpus:
    # Allocate as needed so that several processes (e.g. one per GPU under Slurm) can coexist.
    tf.config.experimental.set_memory_growth(gpu, True)
  devices = tuple("/gpu:%d" % i for i in range(replicas))
  strategy = (tf.distribute.OneDeviceStrategy(devices[0]) if replicas == 1
              else tf.distribute.MirroredStrategy(devices=list(devices)))
  tf_workarounds.close_pools_at_exit(strategy)
  return Backend("gpu", strategy, devices, **_fields(config))


def _fields(config: RunConfig) -> dict:
  """The Backend fields from `config`, with its precision as a value and the GPU as its Hardware."""
  precision = precision_lib.resolve(config.precision, has_16bit_units)
  return dict(options_from_config(config), hardware=Hardware(device="gpu", precision=precision))
