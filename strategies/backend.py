"""The `Backend` a run trains on: a distribution strategy plus what the rest of the code may ask of it."""

import dataclasses

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Backend:
  """A resolved backend. Code outside `strategies/` sees only these fields."""
  kind: str                                # "cpu", "gpu" or "ipu"
  strategy: tf.distribute.Strategy
  devices: tuple                           # device names the replicas run on

  @property
  def replicas(self) -> int:
    return self.strategy.num_replicas_in_sync

  @property
  def label(self) -> str:
    """Upper-case name used in banners, e.g. "CPU"."""
    return self.kind.upper()
