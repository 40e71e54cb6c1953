"""A model's own hyperparameters, declared beside the model: `Option` (plain data, no TensorFlow).

A model lists its options in its registry entry (`ModelInfo.options`, name -> Option). Each becomes a
flag of the same name (flags.py defines one per declared name, refused with the models that do not
declare it), a key of `RunConfig.model_options`, of run_config.yaml, of TensorBoard's HParams row and
of summary.yaml's `params`, and, where `identity` is set, part of what a checkpoint must match to be
resumed or to start another run (`--init_from`).

An option whose default is "auto" may name a `settle` function: `settle(hardware)` returns the value
the run uses on that hardware (strategies/backend.py `Hardware`, read by attribute), called once the
backend exists (`settled`).
"""

import dataclasses
from typing import Any, Callable, Optional

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Option:
  """One hyperparameter of a model: its default (its type is the flag's: str, int, float or bool), the
  flag's help, its choices (an enum flag; () for any value of the type) and bounds for numbers."""
  default: Any
  help: str
  choices: tuple = ()
  lower_bound: Optional[float] = None
  upper_bound: Optional[float] = None
  identity: bool = True     # part of a checkpoint's identity: another value builds other weights
  # A checkpoint written before its run recorded this option was made with this value.
  before_recorded: Any = None
  settle: Optional[Callable[[Any], Any]] = None  # "auto" -> the value on `hardware` (see above)


def values(declared: dict, given) -> dict:
  """Every declared option's value: `given`'s (a mapping, e.g. RunConfig.model_options) else the default.
  A name that is not declared is a KeyError naming it and the declared ones."""
  unknown = sorted(set(given) - set(declared))
  if unknown:
    raise KeyError("model options %s are not declared (declared: %s)" % (", ".join(unknown),
                                                                          ", ".join(sorted(declared)) or "none"))
  return {name: given.get(name, option.default) for name, option in declared.items()}


def settled(declared: dict, given, hardware) -> dict:
  """`values(declared, given)` with each "auto" whose option can settle it replaced by its value on
  `hardware`."""
  result = values(declared, given)
  for name, option in declared.items():
    if result[name] == AUTO and option.settle is not None:
      result[name] = option.settle(hardware)
  return result
