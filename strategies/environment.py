"""Environment variables that TensorFlow reads once, at import time, set in this one place.

Call `prepare(config)` before the first `import tensorflow` of the process. It must stay free of
TensorFlow imports itself.
"""

import os
import sys

from run_config import RunConfig


def prepare(config: RunConfig) -> None:
  """Sets TensorFlow's start-up variables for this run; raises if TensorFlow is already loaded."""
  del config  # Later backends (IPU cache, XLA cache) derive variables from the config.
  if "tensorflow" in sys.modules:
    raise RuntimeError("strategies.environment.prepare() must run before TensorFlow is imported")
  # Keras 2 everywhere: Graphcore's SDK ships Keras 2.6, and on TensorFlow >= 2.16 this makes
  # `tf.keras` the tf-keras package instead of Keras 3 (which has no multi-worker support either).
  os.environ["TF_USE_LEGACY_KERAS"] = "1"
  # TensorFlow's C++ INFO lines (oneDNN notices, CPU feature banners) bury the progress output.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
