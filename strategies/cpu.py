"""CPU backend: one device, or N logical CPU devices for `--replicas=N`.

Splitting the host CPU into logical devices lets a data-parallel command run unchanged on a laptop:
each replica gets its own slice of the global batch and computes on its own device, and the gradients
are summed as on GPUs. The N devices share one memory, so the variables are kept once, on the host
(CentralStorageStrategy), not copied to each device and updated N times (MirroredStrategy).
"""

import os
from typing import Optional, Tuple

import tensorflow as tf
from absl import logging

from errors import UserError
from host import cpuinfo
from run_config import RunConfig
from strategies import device_pipelines, multiworker, ordered_reduction
from strategies import precision as precision_lib
from strategies.backend import Backend, Hardware, options_from_config
import tf_workarounds

# Keras policies per --precision: this CPU family computes 16-bit in bfloat16 (AVX-512 BF16 / AMX) and
# has no fast float16.
POLICIES = {"32.32": "float32", "16.32": "mixed_bfloat16", "16.16": "bfloat16"}


def present() -> bool:
  return True  # every machine has one: --backend=auto's last resort


# oneDNN's `ONEDNN_MAX_CPU_ISA` values (`DNNL_MAX_CPU_ISA` in the oneDNN 2.x of TF 2.6) that hide
# feature families from its kernels, and the /proc/cpuinfo flag prefixes each one hides. Names from
# oneDNN's docs/advanced/cpu_isa_hints and src/cpu/x64/cpu_isa_traits.cpp; unknown values hide nothing.
_NO_AVX512 = ("avx512", "amx")
_ISA_CAP_HIDES = {
    "SSE41": _NO_AVX512, "AVX": _NO_AVX512, "AVX2": _NO_AVX512, "AVX2_VNNI": _NO_AVX512,
    "AVX2_VNNI_2": _NO_AVX512, "AVX512_CORE": ("avx512_bf16", "avx512_fp16", "amx"),
    "AVX512_CORE_VNNI": ("avx512_bf16", "avx512_fp16", "amx"), "AVX512_CORE_BF16": ("amx",),
    "AVX512_CORE_FP16": ("amx",), "AVX10_1_512": ("amx",),
}


def _isa_cap(environ=None) -> str:
  """The ISA cap set for oneDNN (e.g. "AVX2"), or ""."""
  environ = os.environ if environ is None else environ
  return (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").strip()


def _cpu_flags(proc_flags=None, environ=None) -> set:
  """The CPU features oneDNN's kernels may use: /proc/cpuinfo's, minus what a `ONEDNN_MAX_CPU_ISA` cap
  hides. A capped run (e.g. AVX2 on an AVX-512 machine, to see what an older CPU would run) then
  makes the choices of the CPU it imitates: float32 for `auto`, and the forms a model picks for that CPU
  (its Hardware's `cpu_features`)."""
  flags = set(cpuinfo.first_processor().get("flags", "").split() if proc_flags is None else proc_flags)
  hidden = _ISA_CAP_HIDES.get(_isa_cap(environ).upper(), ())
  return {flag for flag in flags if not flag.startswith(hidden)} if hidden else flags


def cpu_features() -> frozenset:
  """The CPU features oneDNN's kernels may use on this machine (`_cpu_flags`: after any ISA cap)."""
  return frozenset(_cpu_flags())


def hardware(precision) -> Hardware:
  """This CPU as a model may ask of it (strategies/backend.py `Hardware`) at `precision` (a Precision)."""
  return Hardware(device="cpu", precision=precision, cpu_features=cpu_features(),
                  cpu_generation=cpuinfo.generation(), signature=machine_signature())


def has_bfloat16_units() -> bool:
  """Whether this CPU does bfloat16 arithmetic natively (AMX or AVX-512 BF16), from /proc/cpuinfo."""
  flags = _cpu_flags()
  return "amx_bf16" in flags or "avx512_bf16" in flags


# Where training in mixed bfloat16 was measured faster than in float32 (docs/performance.md, "Mixed
# bfloat16 on CPUs"): with AMX, and with AMD's AVX-512 BF16. Intel's AVX-512 BF16 without AMX trained
# the main job slower (0.70-0.74x).
def bfloat16_outruns_float32(cpu_flags=None, vendor=None) -> bool:
  """Whether this CPU trains faster in mixed bfloat16 than in float32 (`cpu_flags` and `vendor`
  default to this machine's)."""
  flags = _cpu_flags() if cpu_flags is None else set(cpu_flags)
  vendor = cpuinfo.generation()[0] if vendor is None else vendor
  return "amx_bf16" in flags or ("avx512_bf16" in flags and vendor == "AuthenticAMD")


def has_16bit_units() -> bool:
  """Whether --precision=auto means mixed bfloat16 here: bfloat16 units that outrun float32, and
  TensorFlow kernels for them."""
  return bfloat16_outruns_float32() and bfloat16_kernels_available()


def bfloat16_kernels_available() -> bool:
  """Whether this TensorFlow has CPU bfloat16 training kernels (oneDNN, on by default from TF 2.9).

  TF 2.6 (the Poplar SDK's version) has no bfloat16 Conv1D on the CPU: training fails inside the
  first step with "Missing 0-th output from node conv1d".
  """
  major, minor = (int(part) for part in tf.__version__.split(".")[:2])
  return (major, minor) >= (2, 9)


def check_precision(precision) -> None:
  """A UserError for 16-bit precision (a Precision or its name) where this TensorFlow cannot train in
  bfloat16 on the CPU, or where an ISA cap hides the bfloat16 units from oneDNN; a warning where the CPU
  has none."""
  precision = precision_lib.parse(precision)
  if not precision.sixteen_bit:
    return
  if not bfloat16_kernels_available():
    raise UserError("--precision=%s on the CPU needs TensorFlow >= 2.9 (bfloat16 kernels); this is "
                    "TensorFlow %s: use --precision=32.32" % (precision, tf.__version__))
  if has_bfloat16_units():
    if not bfloat16_outruns_float32():
      logging.warning("--precision=%s: this CPU's bfloat16 units (AVX-512 BF16 without AMX) trained slower "
                      "than float32 on a CPU of its kind (0.7x); --precision=auto picks 32.32 here",
                      precision)
    return
  uncapped = _cpu_flags(environ={})
  if "amx_bf16" in uncapped or "avx512_bf16" in uncapped:
    # TensorFlow reads the CPU's features itself and sends bfloat16 ops to oneDNN, which the cap
    # forbids them: the first step dies with "could not create a primitive descriptor" (seen on an
    # AVX-512 BF16 CPU under ONEDNN_MAX_CPU_ISA=AVX2).
    raise UserError("--precision=%s: ONEDNN_MAX_CPU_ISA=%s hides this CPU's bfloat16 units from oneDNN, "
                    "whose bfloat16 kernels then fail; use --precision=32.32, or unset ONEDNN_MAX_CPU_ISA"
                    % (precision, _isa_cap()))
  logging.warning("--precision=%s: this CPU has no bfloat16 units (AMX or AVX-512 BF16), so TensorFlow "
                  "emulates bfloat16 and trains slower than --precision=32.32 (what --precision=auto "
                  "picks here)", precision)


def machine_signature() -> str:
  """What identifies this CPU to oneDNN, for caching timings: vendor, family, model, name, the
  feature flags its kernels may use (after any ONEDNN_MAX_CPU_ISA cap) and the cores this process
  may run on; and TF_ENABLE_ONEDNN_OPTS where it is set (by the user, or by
  environment.cpu_variables where TensorFlow would leave oneDNN off), which chooses between
  TensorFlow's oneDNN and Eigen kernels."""
  fields = cpuinfo.first_processor()
  features = sorted(flag for flag in _cpu_flags() if flag.startswith(("avx", "amx", "fma", "f16c")))
  cores = cpuinfo.usable_cores()
  onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
  return "%s family %s model %s (%s); %d cores; %s%s" % (
      fields.get("vendor_id", "?"), fields.get("cpu family", "?"), fields.get("model", "?"),
      fields.get("model name", "?"), cores or 0, " ".join(features),
      "" if onednn is None else "; TF_ENABLE_ONEDNN_OPTS=" + onednn)


_THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def side_by_side_threads(replicas: int, cores: int, environ) -> Optional[Tuple[int, int]]:
  """(intra-op, inter-op) threads for `replicas` CPU replicas on `cores` cores, or None for TensorFlow's
  default (every op split over all cores, so the replicas' small ops take turns).

  With at least as many replicas as cores (and more than one), each op runs on one thread and the
  replicas' ops side by side. On 2 cores the 4 x 48 main job trained about 5 % faster so, in float32
  and in mixed bfloat16 (docs/performance.md, "Threads and replicas"). Thread counts the user set
  (TF_NUM_INTRAOP_THREADS, TF_NUM_INTEROP_THREADS) stand."""
  if replicas < max(cores, 2) or any(environ.get(name) for name in _THREAD_VARIABLES):
    return None
  return 1, replicas


def _set_threads(replicas: int) -> None:
  cores = cpuinfo.usable_cores()
  threads = side_by_side_threads(replicas, cores, os.environ)
  if threads is None:
    return
  try:
    tf.config.threading.set_intra_op_parallelism_threads(threads[0])
    tf.config.threading.set_inter_op_parallelism_threads(threads[1])
  except RuntimeError:
    return  # TensorFlow started already in this process (a second run in one test session)
  logging.info("%d replicas on %d core%s: each op on one thread, the replicas' ops side by side "
               "(set TF_NUM_INTRAOP_THREADS to choose otherwise)", replicas, cores, "" if cores == 1 else "s")


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


def _replicated_strategy(devices: list, gradient_accumulation: int):
  """The strategy of `devices`, logical CPUs of one memory: one copy of the variables, on the host,
  where MirroredStrategy would keep one per device and apply the optimizer to each. The default job
  (4 x 48) trained up to 1.2x as fast so, in float32 and in mixed bfloat16 (docs/performance.md,
  "Threads and replicas"), with the same losses to four digits.

  Gradient accumulation keeps MirroredStrategy: its micro-batch loop updates Keras' loss metric and
  BatchNorm's moving statistics inside a tf.while_loop, and a variable kept on the host is updated
  there through merge_call, which TensorFlow refuses inside control flow (both were seen)."""
  if gradient_accumulation == 1:
    strategy = tf.distribute.experimental.CentralStorageStrategy(compute_devices=devices,
                                                                parameter_device=devices[0])
    # Its own reduction replaced by one that sums in a fixed order (strategies/ordered_reduction.py); in a
    # TensorFlow that keeps it elsewhere the replicas' sum stays AddN's, said once.
    if not tf_workarounds.replace_central_storage_reduction(strategy, ordered_reduction.reduction_to_one_device):
      logging.warning("This TensorFlow's CentralStorageStrategy has no ReductionToOneDevice to replace; "
                      "the replicas' gradient sum keeps AddN's order (strategies/ordered_reduction.py)")
    return strategy
  # NCCL does not exist on CPU; reducing through one device is the CPU all-reduce.
  return tf.distribute.MirroredStrategy(devices=devices,
                                        cross_device_ops=ordered_reduction.reduction_to_one_device())


def create(config: RunConfig) -> Backend:
  """Returns a CPU backend with `config.replicas` data-parallel replicas (in this process), or one
  worker's share of a multi-worker run when this process is one of several."""
  try:
    tf.config.set_visible_devices([], "GPU")  # A CPU run must not grab GPU memory or place ops there.
  except RuntimeError:
    pass
  device_pipelines.apply()
  precision = precision_lib.resolve(config.precision, has_16bit_units)
  fields = dict(options_from_config(config), hardware=hardware(precision))
  source = multiworker.cluster_source()
  if source:
    return multiworker.create(config, "cpu", "CPU", source, **fields)
  if config.replicas == 1:
    # The default strategy, not OneDeviceStrategy: Keras' fit ran the same ontra4 step 1.35x slower
    # under OneDeviceStrategy (and under a one-device MirroredStrategy), every kernel stretched alike
    # (docs/performance.md, "Threads and replicas"); one CPU has nothing to distribute.
    return Backend("cpu", tf.distribute.get_strategy(), ("/cpu:0",), **fields)
  if config.jit_compile:
    # XLA compiles each replica's step for one device and cannot reach the variables that
    # MirroredStrategy keeps on the other logical CPU devices ("Trying to access resource
    # conv1/kernel/replica_1 ... located in device CPU:1 from device CPU:0"; TensorFlow's XLA known
    # issues, tfvariable_on_a_different_device).
    raise UserError("--jit_compile trains on one CPU replica only (XLA cannot reach the other replicas' "
                    "variables on their logical CPU devices); use --replicas=1 or leave --jit_compile off")
  problem = cpuinfo.cpu_replicas_problem(config.replicas)  # before any thread or device is made
  if problem:
    raise UserError(problem)
  _set_threads(config.replicas)
  devices = _ensure_logical_cpus(config.replicas)
  strategy = _replicated_strategy(devices, config.gradient_accumulation)
  tf_workarounds.close_pools_at_exit(strategy)
  return Backend("cpu", strategy, tuple(devices), **fields)
