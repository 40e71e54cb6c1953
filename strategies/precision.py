"""`Precision`: what a `--precision` name means, "compute bits.weight bits" ("32.32", "16.32", "16.16").

The name is parsed here alone: `select.resolve` settles "auto" into a name, the run config and the YAML files
keep that name (run_config.yaml stays readable and resumable), and the `Backend` carries the `Precision`,
which code asks (`sixteen_bit`, `mixed`, `half_weights`) instead of comparing names. TensorFlow-free: which
16-bit type a backend computes in (float16 on IPUs and GPUs, bfloat16 on CPUs) is its own `POLICIES`.
"""

import dataclasses

AUTO = "auto"  # --precision=auto: the backend's module decides (strategies/select.py resolve_precision)


@dataclasses.dataclass(frozen=True)
class Precision:
  """A resolved --precision."""
  name: str            # as the flag and the YAML files spell it, e.g. "16.32"
  compute_bits: int    # the width the layers compute in
  weight_bits: int     # the width the weights are stored and updated in

  @property
  def sixteen_bit(self) -> bool:
    """Whether the layers compute in 16 bits (mixed or not)."""
    return self.compute_bits == 16

  @property
  def mixed(self) -> bool:
    """16-bit computation on 32-bit weights ("16.32")."""
    return self.compute_bits < self.weight_bits

  @property
  def half_weights(self) -> bool:
    """Whether the weights themselves are 16-bit ("16.16"): optimizer state may need float32 of its own."""
    return self.weight_bits == 16

  def __str__(self) -> str:
    return self.name


FLOAT32 = Precision("32.32", 32, 32)
MIXED = Precision("16.32", 16, 32)
HALF = Precision("16.16", 16, 16)
PRECISIONS = {precision.name: precision for precision in (FLOAT32, MIXED, HALF)}
NAMES = tuple(PRECISIONS)


def resolve(requested: str, has_16bit_units) -> Precision:
  """The Precision that --precision `requested` means on a backend: "auto" is mixed 16-bit where the
  processor has 16-bit arithmetic units (`has_16bit_units()`, asked only then), else float32."""
  if requested == AUTO:
    return MIXED if has_16bit_units() else FLOAT32
  return parse(requested)


def parse(value) -> Precision:
  """The Precision that a name ("16.32") stands for; a Precision is returned as it is, so that callers
  holding either (a config's name, a backend's value) ask the same way. A ValueError for anything else
  ("auto" included: it is resolved before anything asks what it means)."""
  if isinstance(value, Precision):
    return value
  try:
    return PRECISIONS[value]
  except (KeyError, TypeError):
    raise ValueError("precision %r is none of %s" % (value, ", ".join(NAMES))) from None
