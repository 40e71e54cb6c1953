"""The forms of the Neuron-Inverter's conv blocks for the hardware it runs on, each choice measured.

Every form computes the same function with the same weights (conv_layers.py, conv_pool_op.py); which
one runs fastest depends on the processor's kernels (docs/performance.md, "Convolution forms and
--autotune"). `forms(hardware)` is the network module's `forms` of the registry's contract
(model.layer_forms): option dicts of the builder (network.build's keyword options, the names of
designs.CONV_OPTION_DEFAULTS), the built-in choice first, then the other forms worth timing on this
machine (training/autotune.py, --autotune). Where the first block runs as the compiled op, the op's
library is built here (kernel_build.py).

`hardware` is read by attribute, as strategies/backend.py `Hardware` holds it (the model imports
nothing of strategies/): `device` ("cpu", "gpu" or "ipu"), `precision.sixteen_bit`, `cpu_features`
(the CPU features oneDNN's kernels may use, after any ONEDNN_MAX_CPU_ISA cap) and `cpu_generation`
((vendor, family) of the CPU).
"""

from model.neuron_inverter import kernel_build
from model.neuron_inverter.designs import CONV_OPTION_DEFAULTS
from run_config import KERNEL_CACHE

# Where float32 pooled by elementwise maxima, and by phases in the first block, was measured faster
# than MaxPool: AMD's family 23 (Zen 1 and 2), 1.2x per step on TensorFlow's Eigen kernels
# (strategies/environment.py cpu_variables switches oneDNN's on there, so --autotune times both forms). On
# family 25 (Zen 3 and 4) MaxPool was as fast or faster (docs/performance.md, "Convolution forms and
# --autotune").
_MAXIMA_POOLING_CPUS = (("AuthenticAMD", 23),)
# The two pooling forms as builder options: elementwise maxima go with phases in the first block (the
# 4-probe input), MaxPool with none.
_MAXIMA = {"pooling": "maximum", "phases_max_in_channels": 8}
_MAXPOOL = {"pooling": "max_pool", "phases_max_in_channels": 0}


def forms(hardware) -> tuple:
  """The builder's options for `hardware`: the built-in choice first, then the other forms worth timing
  there; the builder's defaults alone off CPUs (GPUs and IPUs: nothing was measured there)."""
  if hardware.device != "cpu":
    return (dict(CONV_OPTION_DEFAULTS),)
  chosen = cpu_options(hardware)
  if fuses_first_block(hardware):
    chosen["first_block_library"] = kernel_build.conv_pool_library(KERNEL_CACHE)
  return alternatives(hardware, chosen) or (chosen,)


def cpu_options(hardware) -> dict:
  """The builder's options for oneDNN's convolutions on `hardware`'s CPU, each chosen by a measurement
  (docs/performance.md, "Convolution forms and --autotune"), TensorFlow's ops for the first block.

  - In bfloat16 on AVX-512 CPUs (Intel's and AMD's) oneDNN's backward-data convolution ran 3-4x slower
    than its forward one at the Neuron-Inverter's shapes, so the input gradient is a forward conv
    there. In float32 the backward-data kernel was the faster one (the whole step, 1.04-1.07x).
  - With AVX2 code, oneDNN's backward-filter kernel ran 1.1-1.7x slower than one im2col matmul; with
    AVX-512 it was the faster one.
  - AMX bfloat16 kernels take their fast path only for channel counts that are multiples of 32
    (float32 gained nothing from padding).
  - Pooling: MaxPool, except in float32 on the CPUs of _MAXIMA_POOLING_CPUS, where MaxPoolGrad is
    slow (memory-bound) and elementwise maxima, by phases in the first block, were faster.
  """
  features = hardware.cpu_features
  sixteen_bit = hardware.precision.sixteen_bit
  maxima = not sixteen_bit and tuple(hardware.cpu_generation) in _MAXIMA_POOLING_CPUS
  return dict(CONV_OPTION_DEFAULTS, channel_multiple=32 if sixteen_bit else 1,
              input_grad_by_forward_conv=sixteen_bit and "avx512f" in features,
              kernel_grad_by_matmul="avx512f" not in features, **(_MAXIMA if maxima else _MAXPOOL))


def fuses_first_block(hardware) -> bool:
  """Whether the first conv block runs as the compiled ConvPool1D op (kernel_build.py): in float32 (the
  op's only type) on CPUs with the features its code uses. On an AVX2-only CPU a replica's step of the
  default job (batch 48, one thread) took 1.10x less time with it (tools/benchmark_forms.py;
  docs/performance.md, "The first conv block's C++ kernel"). Measured on one CPU kind alone, so
  --autotune times the step without it too (alternatives)."""
  return not hardware.precision.sixteen_bit and set(kernel_build.CPU_FEATURES) <= set(hardware.cpu_features)


# The choices above whose measurements came from some CPUs and not others: on a CPU that computes in
# float32 the run may time the other forms of these for a few steps and keep the fastest
# (training/autotune.py; docs/performance.md, "Convolution forms and --autotune"). Everywhere: the
# kernel gradient as a matmul, decided on one CPU under an AVX2 cap only. With AVX2 code: MaxPool
# against maxima, decided on one CPU kind at 1 x 192 only (with AVX-512 MaxPool won on both CPUs that
# had it). With AVX-512: the input gradient's form,
# which went one way in bfloat16 and the other in float32 on the CPUs that measured it. And the compiled
# first block (fuses_first_block), measured on one AVX2 CPU only: where it is chosen, the built-in
# forms on TensorFlow's ops are timed too, one more form rather than twice as many.
def alternatives(hardware, chosen: dict) -> tuple:
  """The forms worth timing on `hardware`, each the built-in `chosen` (cpu_options', with the compiled
  first block where its library was built) with some options changed, `chosen` first; () where the
  choice was measured on the CPUs it applies to (16-bit: Intel's with AMX and AMD's with AVX-512 BF16
  both chose these forms)."""
  if hardware.precision.sixteen_bit:
    return ()
  if "avx512f" in hardware.cpu_features:
    uncertain = _both_ways("input_grad_by_forward_conv", chosen)
  else:
    uncertain = (_MAXPOOL, _MAXIMA) if chosen["pooling"] == "max_pool" else (_MAXIMA, _MAXPOOL)
  found = tuple(dict(chosen, **outer, **inner)
                for outer in uncertain for inner in _both_ways("kernel_grad_by_matmul", chosen))
  if chosen["first_block_library"]:
    found += (dict(found[0], first_block_library=""),)
  return found


def _both_ways(option: str, chosen: dict) -> tuple:
  """The two settings of a boolean option, `chosen`'s first."""
  return {option: chosen[option]}, {option: not chosen[option]}
