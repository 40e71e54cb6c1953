"""What /proc/cpuinfo says about the host processor, read without TensorFlow.

Without TensorFlow because its import is itself what fails on a CPU it was not built for: the x86-64
TensorFlow wheels (PyPI's since TF 1.6, the Poplar SDK's for their host CPUs) use AVX instructions
throughout, and TensorFlow's start-up check (`cpu_feature_guard.cc`) ends the process with SIGABRT
when the CPU lacks them. Virtual machines show this more often than old hardware: a hypervisor's
generic CPU models (QEMU's `qemu64` and `kvm64`) offer no AVX even on a host that has it.
"""

from typing import Optional


def first_processor() -> dict:
  """The fields of the first processor's block of /proc/cpuinfo (empty where there is none: not
  Linux), e.g. {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu ... avx512f ..."}."""
  fields = {}
  try:
    with open("/proc/cpuinfo") as cpuinfo:
      for line in cpuinfo:
        if not line.strip():
          break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
  except OSError:
    pass
  return fields


def tensorflow_unsupported_reason(fields: Optional[dict] = None) -> Optional[str]:
  """Why TensorFlow cannot start on this CPU (one line), or None. Only x86 processors list `flags`;
  elsewhere (ARM lists `Features`) nothing is known and nothing is refused."""
  fields = first_processor() if fields is None else fields
  flags = fields.get("flags")
  if flags is None or "avx" in flags.split():
    return None
  return ("this CPU (%s) lacks AVX, which TensorFlow's x86 builds need: importing TensorFlow would "
          "abort the process. On a virtual machine, give the guest the host's CPU model (QEMU/KVM: "
          "-cpu host; libvirt: host-passthrough)" % fields.get("model name", "model unknown"))
