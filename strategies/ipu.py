"""IPU backend (Graphcore's TensorFlow from the Poplar SDK).

Detection lives here so that `auto` can ask whether IPUs are usable without importing Poplar on other
machines. The IPUStrategy implementation itself arrives with issue 4.
"""

import os
import shutil

from errors import UserError

INSTALL_HINT = ("Graphcore's TensorFlow is not installed: enable the Poplar SDK (source "
                "<sdk>/enable) and pip install its TensorFlow 2 wheel, e.g. "
                "pip install <sdk>/tensorflow-2.6.3+gc*-cp38-cp38-linux_x86_64.whl "
                "and <sdk>/keras-2.6.0+gc*.whl, in a Python 3.8 environment")


def graphcore_tensorflow_available() -> bool:
  try:
    from tensorflow.python import ipu  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


def ipus_present() -> bool:
  """True when this host can reach IPUs (IPU-over-fabric config, local devices, or the IPU Model)."""
  if "--use_ipu_model" in os.environ.get("TF_POPLAR_FLAGS", ""):
    return True
  if os.environ.get("IPUOF_CONFIG_PATH") or os.path.isdir("/etc/ipuof.conf.d"):
    return True
  return shutil.which("gc-info") is not None


def create(replicas: int):
  """Returns the IPU backend; raises UserError when Graphcore's TensorFlow is missing."""
  del replicas
  if not graphcore_tensorflow_available():
    raise UserError("--backend=ipu: " + INSTALL_HINT)
  raise UserError("--backend=ipu: the IPUStrategy backend is not implemented yet (issue 4); "
                  "use --backend=cpu or --backend=gpu")
