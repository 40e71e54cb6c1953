"""CPU backend: one device, or N logical CPU devices under MirroredStrategy for `--replicas=N`.

Splitting the host CPU into logical devices lets a data-parallel command run unchanged on a laptop:
each replica gets its own slice of the global batch and gradients are all-reduced exactly as on GPUs.
"""

import tensorflow as tf

from errors import UserError
from run_config import RunConfig
from strategies.backend import Backend, options_from_config


def _ensure_logical_cpus(count: int) -> list:
  physical = tf.config.list_physical_devices("CPU")
  try:
    tf.config.set_logical_device_configuration(
        physical[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
  except RuntimeError:
    pass  # Already initialised in this process (e.g. a second run in one test session).
  logical = tf.config.list_logical_devices("CPU")
  if len(logical) < count:
    raise UserError("--replicas=%d needs %d logical CPU devices but TensorFlow was already started "
                    "with %d in this process" % (count, count, len(logical)))
  return [device.name for device in logical[:count]]


def create(config: RunConfig) -> Backend:
  """Returns a CPU backend with `config.replicas` data-parallel replicas."""
  replicas = config.replicas
  try:
    tf.config.set_visible_devices([], "GPU")  # A CPU run must not grab GPU memory or place ops there.
  except RuntimeError:
    pass
  if replicas == 1:
    return Backend("cpu", tf.distribute.OneDeviceStrategy("/cpu:0"), ("/cpu:0",),
                   **options_from_config(config))
  devices = _ensure_logical_cpus(replicas)
  # NCCL does not exist on CPU; reducing through one device is the CPU all-reduce.
  strategy = tf.distribute.MirroredStrategy(
      devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
  return Backend("cpu", strategy, tuple(devices), **options_from_config(config))
