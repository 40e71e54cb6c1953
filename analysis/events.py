"""Reading scalar series back from TensorBoard event files (for tools, plots and tests)."""

import logging

import numpy as np
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util


def read_scalars(folder: str) -> dict:
  """Returns {tag: [(step, value), ...]} for every scalar in the event files directly under `folder`.

  TF2 summaries are stored as rank-0 tensors rather than legacy scalar events; both are read. Non-numeric
  tensors (the model graph's JSON config, for instance) are skipped.
  """
  accumulator = event_accumulator.EventAccumulator(folder, size_guidance={"tensors": 0, "scalars": 0})
  # A resumed run's folder holds one graph per fit; the accumulator warns that it keeps the newest.
  # Only scalars are read here, so that warning says nothing to the reader.
  accumulator_log = event_accumulator.logger  # TensorBoard's own logger (tensorboard.util.tb_logging)
  level = accumulator_log.level
  accumulator_log.setLevel(logging.ERROR)
  try:
    accumulator.Reload()
  finally:
    accumulator_log.setLevel(level)
  series = {tag: [(e.step, float(e.value)) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}
  for tag in accumulator.Tags()["tensors"]:
    values = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)]
    numeric = [(step, float(v)) for step, v in values if v.ndim == 0 and np.issubdtype(v.dtype, np.number)]
    if numeric:
      series[tag] = numeric
  return series
