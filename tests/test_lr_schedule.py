"""The learning-rate schedules: warm-up + reduce-on-plateau (checked against PyTorch's ReduceLROnPlateau
semantics) and warm-up + per-step cosine decay."""

import math

import pytest
import tensorflow as tf

from training.loop import end_interrupted_fit
from training.lr_schedule import Cosine, PlateauState, LearningRateSchedule, cosine_lr, warmup_lr


def test_linear_warmup_per_epoch():
  assert [warmup_lr(1e-3, 4, e) for e in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
  assert warmup_lr(1e-3, 4, 4) is None and warmup_lr(1e-3, 0, 0) is None


def test_plateau_reduces_after_patience_then_cools_down():
  state = PlateauState(1.0, factor=0.1, patience=2, cooldown=2)
  losses = [1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
  lrs = []
  for loss in losses:
    state.step(loss)
    lrs.append(state.lr)
  # best at epoch 2 (0.9); bad epochs 1,2,3 -> reduce on the 3rd (> patience); 2 cooldown epochs reset
  # the count; then 3 more bad epochs -> reduce again.
  assert lrs == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.01])


def test_relative_threshold_ignores_tiny_improvements():
  state = PlateauState(1.0, factor=0.5, patience=0, cooldown=0)
  assert not state.step(1.0)
  assert not state.step(0.99)          # 1% better: an improvement, no reduction
  assert state.step(0.99 - 1e-6)       # not better by 1e-4 relative: a bad epoch; patience 0 -> reduce
  assert state.lr == 0.5


def test_state_round_trips():
  state = PlateauState(1e-3, 0.11, 8, 2)
  for loss in (0.5, 0.4, 0.45):
    state.step(loss)
  copy = PlateauState(1e-3, 0.11, 8, 2)
  copy.load(state.to_dict())
  assert copy.to_dict() == state.to_dict()


def _cosine_rates(epochs, steps, warmup, resumed_epoch=None, resumed_step=0, run=None):
  """The rate the schedule sets before each step of a fit over `run` = [(epoch, first step), ...]."""
  net = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
  net.compile(optimizer=tf.keras.optimizers.Adam(1.0), loss="mse")
  schedule = LearningRateSchedule(1.0, warmup, 0.5, 0, 0, cosine=Cosine(epochs, steps, resumed_epoch,
                                                                           resumed_step))
  schedule.set_model(net)
  rates = []
  for epoch, first in run or [(e, 0) for e in range(epochs)]:
    schedule.on_epoch_begin(epoch)
    for batch in range(steps - first):
      schedule.on_train_batch_begin(batch)
      rates.append(float(tf.keras.backend.get_value(net.optimizer.lr)))
    schedule.on_epoch_end(epoch, {"val_loss": 1.0})
  return rates


def test_cosine_decays_per_step_from_the_end_of_warmup_to_zero():
  rates = _cosine_rates(epochs=3, steps=4, warmup=1)
  assert rates[:4] == [1.0] * 4                              # warm-up epoch (1 epoch: the full rate)
  assert rates[4] == pytest.approx(cosine_lr(1.0, 0.0)) == pytest.approx(1.0)
  assert rates[6] == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 8)))
  assert all(a > b for a, b in zip(rates[4:], rates[5:]))    # strictly falling, never plateau-driven
  assert rates[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_cosine_after_a_mid_epoch_resume_continues_the_same_curve():
  whole = _cosine_rates(epochs=3, steps=4, warmup=0)
  resumed = _cosine_rates(epochs=3, steps=4, warmup=0, resumed_epoch=1, resumed_step=3,
                          run=[(1, 3), (2, 0)])
  assert resumed == pytest.approx(whole[7:])


def test_a_plateau_reduction_is_logged_after_the_epoch_not_inside_its_progress_bar(caplog):
  """on_epoch_end runs before Keras' bar writes its last update (its line still open), so the line
  comes at the next epoch's start, or at the end of training after the last epoch."""
  model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
  model.compile(tf.keras.optimizers.SGD(1.0), "mse")
  schedule = LearningRateSchedule(1.0, warmup_epochs=0, factor=0.5, patience=0, cooldown=0)
  schedule.set_model(model)
  caplog.set_level("INFO")
  for epoch, loss in enumerate((1.0, 1.0, 1.0)):   # no improvement: a reduction after epochs 2 and 3
    schedule.on_epoch_begin(epoch)
    schedule.on_epoch_end(epoch, {"val_loss": loss})
    if epoch == 1:
      assert "plateaued" not in caplog.text       # not yet: the bar's line is open
  assert caplog.text.count("plateaued") == 1 and "Epoch 2: val_loss plateaued" in caplog.text
  schedule.on_train_end()
  assert "Epoch 3: val_loss plateaued, learning rate reduced to 0.25" in caplog.text


def test_a_reduction_just_before_a_stop_is_logged_when_the_interrupted_fit_is_ended(caplog, tmp_path):
  """A graceful stop at an epoch's end raises out of fit, which then calls no on_train_end: the loop
  ends the callbacks itself (training/loop.py end_interrupted_fit), writers and schedule alike."""
  model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
  model.compile(tf.keras.optimizers.SGD(1.0), "mse")
  schedule = LearningRateSchedule(1.0, warmup_epochs=0, factor=0.5, patience=0, cooldown=0)
  board = tf.keras.callbacks.TensorBoard(str(tmp_path))
  for callback in (schedule, board):
    callback.set_model(model)
  caplog.set_level("INFO")
  for epoch in range(2):
    schedule.on_epoch_begin(epoch)
    schedule.on_epoch_end(epoch, {"val_loss": 1.0})
  assert "Epoch 2: val_loss plateaued" not in caplog.text
  end_interrupted_fit([schedule, board])
  assert "Epoch 2: val_loss plateaued, learning rate reduced to 0.5" in caplog.text
