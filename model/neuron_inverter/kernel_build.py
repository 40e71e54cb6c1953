"""The build of the Neuron-Inverter's C++ CPU kernel (kernels/conv_pool1d.cc beside this file) for this machine.

The first conv block of the Neuron-Inverter spends its time on memory with TensorFlow's ops (its
full-resolution output is written and read about five times a step); the kernel keeps that output in
registers. It is compiled against the TensorFlow that runs it (headers and flags from tf.sysconfig)
with AVX2 and FMA code, so the model's forms (cpu_forms.py) use it only on CPUs that have both.

The library goes to <KERNEL_CACHE>/<digest>/ (run_config.KERNEL_CACHE), the digest covering the
source, TensorFlow and the compiler command, so later runs load it (the build takes 6-13 s,
docs/performance.md, "The first conv block's C++ kernel"). Processes that start together (workers,
test runners) build it once: the first takes a lock on the folder, the others wait for it, and the
library appears whole, by a rename. Where it cannot be built or loaded (no C++ compiler, a TensorFlow
without headers), the run says why in one line and trains with TensorFlow's ops, which compute the
same function.
"""

import hashlib
import os
import shutil
import subprocess
import time

import tensorflow as tf
from absl import logging

from host import atomic_files
from model.neuron_inverter import conv_pool_op

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "conv_pool1d.cc")
# The CPU features the compiled code uses (_CODE_FLAGS): cpu_forms.fuses_first_block checks them.
CPU_FEATURES = ("avx2", "fma")
_CODE_FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-Wno-deprecated-declarations")
BUILD_SECONDS = 300  # a build that takes longer is stuck


def compiler() -> str:
  """The C++ compiler: $CXX, else g++ or c++ on the PATH ("" when there is none)."""
  for name in (os.environ.get("CXX"), "g++", "c++"):
    found = shutil.which(name) if name else None
    if found:
      return found
  return ""


def _command(cxx: str, output: str) -> list:
  compile_flags = tf.sysconfig.get_compile_flags()
  if not any("std=" in flag for flag in compile_flags):
    # TensorFlow 2.6 names no standard but was built as C++14; a newer compiler's default (C++17) would
    # turn Abseil's string_view into std::string_view and miss TensorFlow's symbols when loaded.
    compile_flags.append("-std=c++14")
  return [cxx, *_CODE_FLAGS, *compile_flags, SOURCE, "-o", output, *tf.sysconfig.get_link_flags()]


def library_path(cache_dir: str, cxx: str) -> str:
  """Where the library built by `cxx` for this TensorFlow is kept under `cache_dir`."""
  digest = hashlib.sha256()
  with open(SOURCE, "rb") as source:
    digest.update(source.read())
  digest.update(("\0".join([tf.__version__, tf.__file__] + _command(cxx, ""))).encode())
  return os.path.join(cache_dir, digest.hexdigest()[:16], "conv_pool1d.so")


def _build(cxx: str, path: str) -> None:
  """Compiles SOURCE into `path` (under a name of this process's, renamed into place); raises
  RuntimeError."""
  scratch = atomic_files.temporary_name(path)
  try:
    result = subprocess.run(_command(cxx, scratch), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, timeout=BUILD_SECONDS, check=False)
    if result.returncode != 0:
      errors = [line for line in result.stdout.splitlines() if "error" in line]
      raise RuntimeError("%s exited with %d: %s" % (os.path.basename(cxx), result.returncode,
                                                    (errors or result.stdout.splitlines() or ["no output"])[0]))
    os.replace(scratch, path)
  except (OSError, subprocess.TimeoutExpired) as error:
    raise RuntimeError(str(error)) from error
  finally:
    if os.path.exists(scratch):
      os.remove(scratch)


def _build_once(cxx: str, path: str) -> None:
  """Builds `path` unless another process has, one process at a time (atomic_files' lock, which also
  copes with file systems without locks)."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_files.one_writer_at_a_time(
        path, lambda: logging.info("Waiting for another process compiling %s", path)):
      if not os.path.exists(path):
        logging.info("Compiling the first conv block's CPU kernel into %s (once per TensorFlow)", path)
        start = time.monotonic()
        _build(cxx, path)
        logging.info("Compiled in %.1f s", time.monotonic() - start)
  except OSError as error:
    raise RuntimeError(str(error)) from error


def conv_pool_library(cache_dir: str) -> str:
  """The path of the compiled, loadable kernel library under `cache_dir`, building it if needed; ""
  (with a warning that says why) where it cannot be had."""
  cxx = compiler()
  if not cxx:
    logging.warning("No C++ compiler (g++, c++ or $CXX) to build %s: the first conv block runs on "
                    "TensorFlow's ops (the same function, slower)", SOURCE)
    return ""
  path = library_path(cache_dir, cxx)
  try:
    if not os.path.exists(path):
      _build_once(cxx, path)
    conv_pool_op.load(path)  # loaded here, once per process, so that a library that fails is said now
  except (RuntimeError, tf.errors.OpError) as error:
    logging.warning("Could not build or load %s (%s): the first conv block runs on TensorFlow's ops "
                    "(the same function, slower)", path, str(error).strip().splitlines()[0])
    return ""
  return path
