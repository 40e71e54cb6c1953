"""Environment variables that TensorFlow and Poplar read once, at start-up, set in this one place.

Call `prepare(config)` before the first `import tensorflow` of the process. It must stay free of
TensorFlow imports itself, so the TensorFlow version is read from the installed package's metadata.
It also holds what that import runs under (the CUDA probe's lines dropped, the collector paused), which
`strategies/start.py` uses, and `executable_cache_dir`, the variables read back for a backend.
"""

import atexit
import contextlib
import functools
import gc
import glob
import json
import os
import re
import sys
import tempfile

from absl import logging

from errors import UserError
from host import cpuinfo
from run_config import RunConfig, cache_hint
from stderr_lines import DroppedLines
from strategies import registry

_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tf-nightly")
# The XLA persistent cache flag exists in current TensorFlow; TF 2.6 aborts on any unknown TF_XLA_FLAGS.
XLA_PERSISTENT_CACHE_SINCE = (2, 16)
# TensorFlow runs oneDNN's CPU kernels by default since 2.9; the stock x86 wheels before it carry them
# behind TF_ENABLE_ONEDNN_OPTS=1.
ONEDNN_DEFAULT_SINCE = (2, 9)
# ...but only on CPUs with one of these (/proc/cpuinfo names; tensorflow/core/util/util.cc, IsMKLEnabled):
# elsewhere, on AVX2-only CPUs for one, they stay off unless TF_ENABLE_ONEDNN_OPTS=1.
_ONEDNN_BY_DEFAULT_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def installed_tensorflow() -> str:
  """The version string of the installed TensorFlow distribution without importing it ("" if none)."""
  try:
    from importlib import metadata  # Python >= 3.8
  except ImportError:  # pragma: no cover
    return ""
  for name in _TF_DISTRIBUTIONS:
    try:
      return metadata.version(name)
    except metadata.PackageNotFoundError:
      continue
  return ""


def _major_minor(release: str):
  match = re.match(r"(\d+)\.(\d+)", release)
  return (int(match.group(1)), int(match.group(2))) if match else None


def installed_tensorflow_version():
  """(major, minor) of the installed TensorFlow without importing it; None if not found."""
  return _major_minor(installed_tensorflow())


def _add_flag(variable: str, flag: str, replace_prefix: str = None) -> None:
  """Appends `flag` to a space-separated flag variable unless the user already set that flag."""
  current = os.environ.get(variable, "").split()
  key = replace_prefix or flag
  if not any(item.startswith(key) for item in current):
    os.environ[variable] = " ".join(current + [flag])


def _merge_json_options(variable: str, defaults: dict, required: dict) -> None:
  """Sets a JSON-object variable to `defaults`, then the user's own options, then `required`.

  A user's POPLAR_ENGINE_OPTIONS (e.g. "target.hostSyncTimeout") must survive --profile_dir; only the
  report folder is ours to decide.
  """
  raw = os.environ.get(variable, "").strip()
  try:
    current = json.loads(raw) if raw else {}
  except ValueError:
    current = None
  if not isinstance(current, dict):
    raise UserError("%s=%s is not a JSON object; --profile_dir adds its options to it (unset it or fix "
                    "it)" % (variable, raw))
  os.environ[variable] = json.dumps({**defaults, **current, **required})


def _make_dir(path: str, flag: str) -> str:
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as error:
    raise UserError("%s=%s cannot be created (%s%s)" % (flag, path, error.strerror,
                                                       cache_hint(path))) from None
  return os.path.abspath(path)


def ipu_variables(config: RunConfig) -> None:
  """Poplar's start-up variables (strategies/registry.py START_UP): IPU Model, synthetic data, the
  executable cache, profiling reports."""
  if config.ipu_model:
    _add_flag("TF_POPLAR_FLAGS", "--use_ipu_model")
  if config.synthetic_data:
    # Poplar then makes the infeed data on the device (no host transfer at all); "random" fills it
    # with random values. Both flags: PoplarXlaFlags (graphcore/tensorflow, compiler/plugin/poplar/
    # driver/tools/flags.h); the same pair as examples' vision/cnns/tensorflow2 --synthetic_data=ipu.
    _add_flag("TF_POPLAR_FLAGS", "--use_synthetic_data")
    _add_flag("TF_POPLAR_FLAGS", "--synthetic_data_initializer=random", "--synthetic_data_initializer=")
  # Under poprun, --executable-cache-path arrives as POPDIST_EXECUTABLE_CACHE_PATH, which TensorFlow
  # uses when --executable_cache_path is absent: let poprun's choice win.
  variable, prefix, launcher_variable = registry.EXECUTABLE_CACHES["ipu"]
  if config.cache_dir and not os.environ.get(launcher_variable):
    path = _make_dir(config.cache_dir, "--cache_dir")
    # Underscores: Poplar aborts the process on an unknown flag such as --executable-cache-path.
    _add_flag(variable, prefix + path, prefix)
  if config.profile_dir:
    path = _make_dir(config.profile_dir, "--profile_dir")
    # PopVision Graph Analyser (autoReport) and System Analyser (PVTI). Engine options are part of
    # the executable cache key, so a profiled run compiles afresh.
    _merge_json_options("POPLAR_ENGINE_OPTIONS", {
        "autoReport.all": "true", "autoReport.outputSerializedGraph": "false",
        "debug.allowOutOfMemory": "true"}, {"autoReport.directory": path})
    _merge_json_options("PVTI_OPTIONS", {"enable": "true"}, {"directory": path})


def cpu_variables(config: RunConfig) -> None:
  """oneDNN's CPU kernels wherever the installed stock TensorFlow would leave them off and they are
  known to work; a user's own TF_ENABLE_ONEDNN_OPTS is always kept.
  - TensorFlow >= 2.9 on Linux switches them on only for CPUs with VNNI, AVX-512 BF16 or AMX units
    (_ONEDNN_BY_DEFAULT_FLAGS), so an AVX2-only CPU gets its Eigen kernels. On an AVX2-only CPU the
    default job's float32 step ran 2.5x as fast with oneDNN's (docs/performance.md, "oneDNN on CPUs
    without VNNI or AMX").
  - Older TensorFlow carries them behind the variable: on Intel CPUs they are switched on (on
    TensorFlow 2.6.3, the Poplar SDK's version from PyPI, the float32 step took 0.64x the time with
    them). On AMD Zen 3 and Zen 4 CPUs that build's oneDNN ended every training process with SIGFPE
    (whatever ONEDNN_MAX_CPU_ISA), so AMD CPUs keep its Eigen kernels.
  Graphcore's wheels (versions "2.6.3+gc...") are left as built: their CPU work is an IPU run's host
  side, and their build was not measured."""
  del config  # the same for every CPU run
  release = installed_tensorflow()  # one metadata lookup for both questions
  version = _major_minor(release)
  if version is None or "+gc" in release:
    return
  fields = cpuinfo.first_processor()
  if version >= ONEDNN_DEFAULT_SINCE:
    flags = fields.get("flags")  # only x86 CPUs list them; ARM builds decide otherwise
    if flags is not None and not set(flags.split()) & set(_ONEDNN_BY_DEFAULT_FLAGS):
      os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    return
  vendor = fields.get("vendor_id", "")
  if vendor == "GenuineIntel":
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
  elif os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").lower() in ("1", "true"):
    # Kept, as the user chose it; but the crash it led to says nothing of its cause.
    logging.warning("TF_ENABLE_ONEDNN_OPTS=%s with TensorFlow %s on this %s CPU: on AMD Zen 3 and "
                    "Zen 4 CPUs this build's oneDNN ended every training process with a floating point "
                    "exception (SIGFPE); unset it if that happens here", os.environ["TF_ENABLE_ONEDNN_OPTS"],
                    release, vendor or "non-Intel")


def _xla_cache_variables(config: RunConfig) -> None:
  if not (config.jit_compile and config.cache_dir) or config.backend in registry.EXECUTABLE_CACHES:
    return  # a backend whose compiler keeps a cache of its own (IPUs: Poplar's)
  version = installed_tensorflow_version()
  if version is None or version < XLA_PERSISTENT_CACHE_SINCE:
    return
  path = _make_dir(os.path.join(config.cache_dir, "xla"), "--cache_dir")
  variable, prefix, _ = registry.XLA_CACHE
  _add_flag(variable, prefix + path, prefix)


# Packages that Keras imports when it starts if they are installed (only mlxtend's dependencies install
# them here), and what for; no part of this application uses those features:
# - pandas: so that tf-keras' fit() accepts DataFrames; it imports pyarrow too. About 0.45 s of every
#   start on 2 cores.
# - scipy: sparse inputs to TensorFlow's own TF 1 Keras training loop, and the random image transforms
#   of tf-keras' preprocessing.image. About 0.5 s of every start on 2 cores (numba, which also looks
#   for it, goes without).
UNUSED_BY_KERAS = ("pandas", "scipy")


def prepare(config: RunConfig) -> None:
  """Sets the start-up variables for this run; raises if TensorFlow is already loaded."""
  if "tensorflow" in sys.modules:
    raise RuntimeError("strategies.environment.prepare() must run before TensorFlow is imported")
  unsupported = cpuinfo.tensorflow_unsupported_reason()
  if unsupported:
    raise UserError(unsupported)
  # Keras 2 everywhere: Graphcore's SDK ships Keras 2.6, and on TensorFlow >= 2.16 this makes
  # `tf.keras` the tf-keras package instead of Keras 3 (which has no multi-worker support either).
  os.environ["TF_USE_LEGACY_KERAS"] = "1"
  # TensorFlow sets TF2_BEHAVIOR=1 itself, but only part-way through its own import. On TF 2.6 (the
  # Poplar SDK's version), in this application's import order, modules read it before that, and the
  # Keras functional model is then built eagerly: Flatten fails on the unknown batch size.
  os.environ["TF2_BEHAVIOR"] = "1"
  # None makes Keras' import of each fail as if the package were missing (UNUSED_BY_KERAS says why).
  for package in UNUSED_BY_KERAS:
    sys.modules.setdefault(package, None)
  # TensorFlow's C++ INFO lines (oneDNN notices, CPU feature banners) bury the progress output.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  for kind, function in registry.START_UP.items():  # a backend's own start-up variables, by name
    if config.backend in (kind, "auto"):
      globals()[function](config)
  _xla_cache_variables(config)
  atexit.register(remove_autograph_bytecode)


def remove_autograph_bytecode() -> None:
  """Removes the bytecode files that Python's import wrote for AutoGraph's generated modules, and their
  __pycache__ folder in the temporary folder if that is then empty (another process's files stay).

  AutoGraph writes each function it converts (Keras' train and test steps among them) as a module
  file into the temporary folder, imports it, and removes the file at exit. The import caches its
  bytecode beside it, which AutoGraph leaves: each `make run` would leave four files in
  $TMPDIR/__pycache__ on a machine that writes bytecode (without PYTHONDONTWRITEBYTECODE).
  Run at exit (`prepare` registers it); the modules are found by where their source was.
  """
  temporary = os.path.realpath(tempfile.gettempdir())
  # Each folder resolved once: TensorFlow's 3,300 modules lie in 750 folders, and a realpath per module
  # would take 0.15 s of every exit on 2 cores (0.03 s this way).
  real_folder = functools.lru_cache(maxsize=None)(os.path.realpath)
  folders = set()
  for module in list(sys.modules.values()):
    spec = getattr(module, "__spec__", None)
    origin, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
    if not (isinstance(origin, str) and isinstance(cached, str)):
      continue
    if real_folder(os.path.dirname(origin)) == temporary:
      with contextlib.suppress(OSError):
        os.remove(cached)
      folders.add(os.path.dirname(cached))
  for folder in folders:
    with contextlib.suppress(OSError):
      os.rmdir(folder)


# What TensorFlow's CUDA probe writes to stderr, from C++, on a machine that has no NVIDIA driver: the
# "tensorflow-cpu" wheels load the CUDA stubs too. TF_CPP_MIN_LOG_LEVEL cannot hide the lines that come
# before absl's logging is initialised; among them is oneDNN's notice that it is on (it is, by default,
# on every x86 CPU), twice, which says nothing a CPU user can act on.
CUDA_PROBE_LINES = ("All log messages before absl::InitializeLog() is called are written to STDERR",
                    "Could not find cuda drivers on your machine", "failed call to cuInit",
                    "oneDNN custom operations are on")


def nvidia_device_nodes() -> list:
  """The NVIDIA device nodes of this machine (/dev/nvidia0, ...); none means no GPU can be used."""
  return glob.glob("/dev/nvidia[0-9]*")


@contextlib.contextmanager
def quiet_cuda_probe():
  """Runs the block (TensorFlow's import and device discovery) with the CUDA probe's lines dropped, and
  the import's objects kept from the garbage collector (`imports_kept_from_the_collector`).

  File descriptor 2 goes to a temporary file for the block; every other line is written back to
  stderr afterwards, in order, also when the block raises. On a machine with an NVIDIA device node the
  lines are kept, whatever the backend: there a failed cuInit is the message a user needs.
  Without one no GPU can be used, and the probe's failure says nothing (with --backend=gpu, the
  backend's own error says that there is no device).
  """
  with imports_kept_from_the_collector():
    if nvidia_device_nodes():
      yield
      return
    with DroppedLines(CUDA_PROBE_LINES):
      yield


@contextlib.contextmanager
def quiet_tensorflow_import():
  """Runs the block (a tool's import of TensorFlow) with TensorFlow's start-up INFO lines and its CUDA
  probe's lines dropped on any machine: for tools that only read and write files (TensorBoard), which
  never use a GPU, so no probe result is theirs to report."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  with DroppedLines(CUDA_PROBE_LINES), imports_kept_from_the_collector():
    yield


@contextlib.contextmanager
def imports_kept_from_the_collector():
  """Runs the block (the process's first import of TensorFlow) with Python's cyclic garbage collector
  paused, then moves every object alive after it out of the collector's reach (`gc.freeze`).

  TensorFlow's modules, classes and functions (about 660,000 objects with TensorFlow 2.21) live until
  the process ends; each full collection would walk them all, and so would the last ones at exit:
  about 1.5 s of a short run's 8 (0.5 s while importing, 1 s at exit), and the test suite starts a
  hundred such processes. Objects made later (models, datasets, writers) are collected as usual.
  Where TensorFlow is already imported (a test process, a second call) the block runs untouched.
  """
  if "tensorflow" in sys.modules or not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.freeze()
    gc.enable()


def executable_cache_dir(kind: str):
  """The executable cache folder in effect for a backend kind, read back from the environment."""
  variable, prefix, launcher_variable = registry.EXECUTABLE_CACHES.get(kind, registry.XLA_CACHE)
  for item in os.environ.get(variable, "").split():
    if item.startswith(prefix):
      return item[len(prefix):]
  return os.environ.get(launcher_variable) if launcher_variable else None
