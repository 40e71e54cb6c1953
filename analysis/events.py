"""TensorBoard event files: scalar series and run settings read back (for tools, plots and tests), and the
prediction report written for TensorBoard's Images and Text dashboards."""

import glob
import logging
import os

import numpy as np
from google.protobuf import json_format
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.util import tensor_util

from stderr_lines import DroppedLines
from training.logs import ONE_OFF_NATIVE_LINES


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
  series = {tag: _by_step([(e.wall_time, e.step, float(e.value)) for e in accumulator.Scalars(tag)])
            for tag in accumulator.Tags()["scalars"]}
  for tag in accumulator.Tags()["tensors"]:
    values = [(e.wall_time, e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)]
    numeric = [(time, step, float(v)) for time, step, v in values
               if v.ndim == 0 and np.issubdtype(v.dtype, np.number)]
    if numeric:
      series[tag] = _by_step(numeric)
  return series


def _by_step(events) -> list:
  """(step, value) in step order, the newest value of a step written twice (a resume repeats the epoch
  it stopped in). The accumulator reads a folder's files in name order, and names sort by their
  counter as text ('.10.' before '.9.'), so a resumed run's files can come back in either order."""
  newest = {}
  for _, step, value in sorted(events, key=lambda event: event[0]):
    newest[step] = value
  return sorted(newest.items())


def read_hparams(folder: str):
  """(trial id, {setting: value}) of the run settings in `folder`'s event files, as TensorBoard's HParams
  dashboard reads them (training/hparams.py writes them); numbers come back as floats."""
  accumulator = event_accumulator.EventAccumulator(folder)
  accumulator.Reload()
  content = accumulator.PluginTagToContent(hparams_metadata.PLUGIN_NAME)[hparams_metadata.SESSION_START_INFO_TAG]
  info = hparams_metadata.parse_session_start_info_plugin_data(content)
  return info.group_name, json_format.MessageToDict(info)["hparams"]


def write_prediction_events(outdir: str, figures: list, table: str, split: str, mse: float, step: int) -> str:
  """Writes the prediction report into an event file in `outdir`: each PNG of `figures` as an image,
  `table` (the per-parameter text) as text, and the split's MSE as a scalar, at `step` (the epoch of the
  weights). `tensorboard --logdir <run>` then shows them as the run folder's `predict` run. Returns
  the event file's path."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (reading needs only tensorboard)
  writer = tf.summary.create_file_writer(outdir)
  with writer.as_default():
    for path in figures:
      with DroppedLines(ONE_OFF_NATIVE_LINES):
        image = tf.image.decode_png(tf.io.read_file(path), channels=4)
      tf.summary.image("prediction/" + os.path.splitext(os.path.basename(path))[0], image[None], step=step)
    # Indented lines are a preformatted block in TensorBoard's markdown: the columns stay aligned.
    tf.summary.text("prediction/parameters", "\n".join("    " + line for line in table.splitlines()),
                    step=step)
    tf.summary.scalar("prediction/%s_mse" % split, mse, step=step)
  writer.close()
  return max(glob.glob(os.path.join(outdir, "events.out.tfevents.*")), key=os.path.getmtime)
