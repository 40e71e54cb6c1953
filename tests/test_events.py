"""Reading TensorBoard scalars back (analysis/events.py), as the plots and tools do."""

import logging

import tensorflow as tf

from analysis import events


def _write_fit(folder, first_step, values):
  """One fit's events: its graph and an `epoch_loss` scalar per step, as Keras' TensorBoard writes."""
  writer = tf.summary.create_file_writer(folder)
  graph = tf.function(lambda x: x * 2.0).get_concrete_function(tf.TensorSpec([], tf.float32)).graph
  with writer.as_default():
    tf.summary.graph(graph)
    for step, value in enumerate(values, start=first_step):
      tf.summary.scalar("epoch_loss", value, step=step)
  writer.close()


def test_a_resumed_runs_scalars_are_read_whole_without_the_graph_warning(tmp_path, caplog):
  folder = str(tmp_path / "train")
  _write_fit(folder, 0, [0.5, 0.4])   # the fit that was interrupted
  _write_fit(folder, 2, [0.3])        # the resumed fit: a second graph in the same run
  with caplog.at_level(logging.WARNING):
    series = events.read_scalars(folder)
  assert [(step, round(value, 4)) for step, value in series["epoch_loss"]] == [(0, 0.5), (1, 0.4), (2, 0.3)]
  assert not [r for r in caplog.records if "more than one graph event" in r.getMessage()]
  assert events.event_accumulator.logger.level != logging.ERROR  # the logger's level is restored


def test_scalars_come_back_in_step_order_whatever_the_files_names_sort_as(tmp_path):
  """Files of one second and one process differ by a counter, which sorts as text ('.10.' before '.9.'):
  here the resumed fit's file is named to sort first. A step written twice keeps its newest value."""
  folder = tmp_path / "train"
  _write_fit(str(folder), 0, [0.5, 0.4, 0.35])  # interrupted during step 2; its value there is stale
  _write_fit(str(folder), 2, [0.3])
  first, second = sorted(folder.iterdir(), key=lambda path: path.stat().st_mtime_ns)
  second.rename(folder / ("events.out.tfevents.0." + second.name))  # now the first in name order
  series = events.read_scalars(str(folder))
  assert [(step, round(value, 4)) for step, value in series["epoch_loss"]] == [(0, 0.5), (1, 0.4), (2, 0.3)]
  assert first.exists()
