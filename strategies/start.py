"""The process's first import of TensorFlow, with the CUDA probe's lines dropped: `start_backend` for a
run (main.py and the tools that train or evaluate), `import_tensorflow` for the tools that run
TensorFlow without a backend.

`strategies.environment.prepare(config)` must have run. This module imports no TensorFlow itself: the
import happens inside the functions, under `environment.quiet_cuda_probe`.
"""

from run_config import RunConfig
from strategies.environment import quiet_cuda_probe


def start_backend(config: RunConfig):
  """Imports TensorFlow and returns `(config, backend)`: the config with every "auto" resolved and
  holding what the backend decided (strategies/select.py `settle`; what run_config.yaml and summary.yaml
  record), and its Backend."""
  with quiet_cuda_probe():
    from strategies.select import settle  # pylint: disable=import-outside-toplevel
    return settle(config)


def import_tensorflow(config: RunConfig):
  """TensorFlow, imported and its devices found (`start_backend` does the same for a run)."""
  del config  # what the import reads, prepare(config) has set
  with quiet_cuda_probe():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.list_physical_devices()
  return tf
