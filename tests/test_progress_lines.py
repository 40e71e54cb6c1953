"""Progress inside an epoch: the progress lines where Keras draws no bar (training/callbacks.py
ProgressLines), and the step-level TensorBoard scalars (EpochScalars' `batch_loss`, `batch_learning_rate`).

Real Keras fits of a tiny model with a fake clock; then one short main.py run, whose output and event files
are read back.
"""

import itertools
import logging as python_logging
import math
import os
import re

import pytest
import tensorflow as tf

from analysis import events
from tests.support.cellspike_files import write_contiguous_folder
from tests.support.helpers import run_main
from training.callbacks import EpochScalars, ProgressLines
from training.lr_schedule import CosineRate

STEPS = 10  # steps per epoch of the tiny fits


def _counting_clock():
  """A clock that advances one second at each reading (ProgressLines reads it once per batch end)."""
  ticks = itertools.count()
  return lambda: float(next(ticks))


def _fit(callbacks, epochs=2, initial_epoch=0, steps=STEPS, steps_per_execution=1, optimizer=None, net=None):
  """Fits a model whose loss at the global step k (from 0) is k squared: its output is 0 whatever its
  weights (which get zero gradients), and batch k's targets are k. Returns the model."""
  if net is None:
    inputs = tf.keras.Input((1,))
    outputs = tf.keras.layers.Lambda(lambda t: t * 0.0)(tf.keras.layers.Dense(1)(inputs))
    net = tf.keras.Model(inputs, outputs)
    net.compile(optimizer=optimizer or tf.keras.optimizers.SGD(0.05), loss="mse",
                steps_per_execution=steps_per_execution)
  data = tf.data.Dataset.range(10000).map(lambda k: (tf.zeros((2, 1)), tf.fill((2, 1), tf.cast(k, tf.float32))))
  net.fit(data.skip(initial_epoch * STEPS).repeat(), epochs=epochs, initial_epoch=initial_epoch, steps_per_epoch=steps,
          callbacks=callbacks, verbose=0)
  return net


def _lines(caplog, callbacks, **fit_args):
  with caplog.at_level(python_logging.INFO, logger="absl"):
    _fit(callbacks, **fit_args)
  return [record.getMessage() for record in caplog.records if ", step " in record.getMessage()]


def _steps_shown(lines):
  return [re.search(r"Epoch (\d+/\d+), step (\d+/\d+)", line).groups() for line in lines]


def test_a_line_every_interval_with_the_step_loss_rate_and_time_left_and_none_at_the_epochs_end(caplog):
  # The first batch end starts the interval; at 1 s a batch end, lines after 3 s: steps 4 and 7 of 10.
  progress = ProgressLines(epochs=2, steps_per_epoch=STEPS, every_seconds=2.5, samples_per_step=8,
                           clock=_counting_clock())
  lines = _lines(caplog, [progress])
  assert _steps_shown(lines) == [("1/2", "4/10"), ("1/2", "7/10"), ("2/2", "4/10"), ("2/2", "7/10")], lines
  loss = float(re.search(r"Loss: train=([0-9.]+)", lines[0]).group(1))
  assert loss == pytest.approx((0 + 1 + 4 + 9) / 4, rel=1e-4)  # Keras' running mean of the epoch
  assert "8 samples/s" in lines[0] and lines[0].endswith("6 s left in the epoch"), lines[0]


def test_steps_per_execution_and_a_resumed_epoch_count_the_epochs_steps(caplog):
  """Keras calls the batch hooks once per execution, `batch` being its last step: steps 3, 6, 9 and 10."""
  progress = ProgressLines(epochs=1, steps_per_epoch=STEPS, every_seconds=1.5, samples_per_step=8,
                           clock=_counting_clock())
  assert _steps_shown(_lines(caplog, [progress], epochs=1, steps_per_execution=3)) == [("1/1", "9/10")]
  caplog.clear()
  # The rest of epoch 2 after a checkpoint at its step 4 is a fit of its own, of 6 steps; then epoch 3.
  resumed = ProgressLines(epochs=3, steps_per_epoch=STEPS, every_seconds=1, samples_per_step=8, first_step=4,
                          clock=_counting_clock())
  with caplog.at_level(python_logging.INFO, logger="absl"):
    net = _fit([resumed], epochs=2, initial_epoch=1, steps=STEPS - 4)
    _fit([resumed], epochs=3, initial_epoch=2, net=net)
  shown = _steps_shown([record.getMessage() for record in caplog.records if ", step " in record.getMessage()])
  assert shown == [("2/3", "%d/10" % step) for step in range(6, 10)] + [("3/3", "%d/10" % step)
                                                                         for step in range(2, 10)], shown
  assert ProgressLines(1, STEPS, 0, 8)._implements_train_batch_hooks() is False  # 0: no lines, no hooks


def _expected_loss(first, last):
  """The mean of the losses k**2 of the global steps first..last (from 0)."""
  return sum(k * k for k in range(first, last + 1)) / (last - first + 1)


def test_step_scalars_at_the_update_count_with_the_loss_since_the_previous_point(tmp_path):
  """Points at the first batch end at or after each multiple of 4 updates: with 3 steps an execution,
  updates 6, 9, 13 (the epoch's last step carried into it), 16 and 20; a second fit (a resume) goes on
  from the optimizer's count: 26, 29. The learning rate is that of the update that reached the step."""
  schedule = CosineRate(0.1, 0, 3, STEPS)
  scalars = EpochScalars(log_dir=str(tmp_path), profile_batch=0, write_graph=False, every_n_steps=4)
  net = _fit([scalars], epochs=2, steps_per_execution=3, optimizer=tf.keras.optimizers.SGD(schedule))
  _fit([scalars], epochs=3, initial_epoch=2, net=net)
  series = events.read_scalars(str(tmp_path / "train"))
  points = [6, 9, 13, 16, 20, 26, 29]
  assert [step for step, _ in series["batch_loss"]] == points
  assert [step for step, _ in series["batch_learning_rate"]] == points
  assert [step for step, _ in series["epoch_loss"]] == [0, 1, 2]  # Keras' own, as before
  expected = [_expected_loss(first, last - 1) for first, last in zip([0] + points[:-1], points)]
  assert [value for _, value in series["batch_loss"]] == pytest.approx(expected, rel=1e-4)
  rates = [float(schedule(step - 1)) for step in points]
  assert [value for _, value in series["batch_learning_rate"]] == pytest.approx(rates, rel=1e-5)
  assert "epoch_learning_rate" not in series


def test_a_constant_rate_and_no_points_without_every_n_steps(tmp_path):
  scalars = EpochScalars(log_dir=str(tmp_path / "on"), profile_batch=0, write_graph=False, every_n_steps=5)
  _fit([scalars], epochs=1, optimizer=tf.keras.optimizers.SGD(0.05))
  series = events.read_scalars(str(tmp_path / "on" / "train"))
  assert series["batch_learning_rate"] == [(5, pytest.approx(0.05)), (10, pytest.approx(0.05))]
  assert [value for _, value in series["batch_loss"]] == pytest.approx([_expected_loss(0, 4), _expected_loss(5, 9)])
  _fit([EpochScalars(log_dir=str(tmp_path / "off"), profile_batch=0, write_graph=False)], epochs=1)
  assert not [tag for tag in events.read_scalars(str(tmp_path / "off" / "train")) if tag.startswith("batch_")]


RUN_FLAGS = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16", "--precision=32.32",
             "--warmup_epochs=0", "--steps_per_epoch=4", "--eval_steps=1", "--epochs=2", "--progress=epoch")


def test_a_run_without_the_bar_shows_progress_lines_and_writes_step_scalars(tmp_path):
  data_file = write_contiguous_folder(str(tmp_path))
  logdir = str(tmp_path / "run")
  result = run_main(*RUN_FLAGS, "--data_path=" + data_file, "--logdir=" + logdir, "--log_every=0.001",
                    "--log_every_n_steps=2", one_stream=True)
  assert result.returncode == 0, result.stdout[-3000:]
  shown = _steps_shown([line for line in result.stdout.splitlines() if re.search(r"Epoch \d+/\d+, step ", line)])
  # The first batch end of an epoch starts its interval; none at its last step.
  assert shown == [("1/2", "2/4"), ("1/2", "3/4"), ("2/2", "2/4"), ("2/2", "3/4")], result.stdout[-3000:]
  series = events.read_scalars(os.path.join(logdir, "train"))
  for tag in ("batch_loss", "batch_learning_rate"):
    assert [step for step, _ in series[tag]] == [2, 4, 6, 8], series[tag]
    assert all(math.isfinite(value) and value > 0 for _, value in series[tag])
  assert sorted(tag for tag in series if tag.startswith("batch_")) == ["batch_learning_rate", "batch_loss"]
  epoch_tags = [tag for tag in series if tag.startswith("epoch_")]
  assert "epoch_loss" in epoch_tags and "epoch_lr" in epoch_tags and "epoch_learning_rate" not in epoch_tags
  assert all([step for step, _ in series[tag]] == [0, 1] for tag in epoch_tags), epoch_tags
