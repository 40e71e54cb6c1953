"""The learning-rate schedules: warm-up + reduce-on-plateau (checked against PyTorch's ReduceLROnPlateau
semantics) and warm-up + per-step cosine decay."""

import math

import pytest
import tensorflow as tf

from tests.support.helpers import assert_names, line_naming
from training.loop import end_interrupted_fit
from training.lr_schedule import CosineRate, PlateauState, LearningRateSchedule, warmup_lr, warmup_problem


def test_linear_warmup_per_epoch():
  assert [warmup_lr(1e-3, 4, e) for e in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
  assert warmup_lr(1e-3, 4, 4) is None and warmup_lr(1e-3, 0, 0) is None


def test_a_warmup_as_long_as_the_run_is_warned_about():
  assert warmup_problem(0, 3, "cosine") is None and warmup_problem(2, 3, "cosine") is None
  assert_names(warmup_problem(6, 3, "plateau"), "--warmup_epochs=6", "whole run of 3 epochs", "plateau",
               "lower --warmup_epochs", "raise --epochs")
  assert "run of 1 epoch:" in warmup_problem(1, 1, "cosine")


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


# The optimizer family the application trains with (training/optimizers.py): OptimizerV2, whose
# update kernels can be watched; TF 2.6 has no `legacy` module, its SGD is that class.
LEGACY_SGD = getattr(tf.keras.optimizers, "legacy", tf.keras.optimizers).SGD


def _cosine(progress):
  return 0.5 * (1 + math.cos(math.pi * progress))


def _trained_rates(epochs, steps, warmup, stop_after=None):
  """The rate of every update of a fit of `epochs` x `steps` updates with the optimizer's CosineRate,
  read in the training step itself (steps_per_execution = a whole epoch, as on IPUs, where callbacks
  see only its ends); with `stop_after`, the fit stops after that many updates and a new optimizer
  with the saved update count trains on, as a resumed run does."""
  rates = []

  class Recorder(LEGACY_SGD):
    def _resource_apply_dense(self, grad, var, apply_state=None):  # pylint: disable=arguments-differ
      rates.append(self._decayed_lr(tf.float32))  # the step runs eagerly (run_eagerly=True)
      return super()._resource_apply_dense(grad, var, apply_state)

  def fit(count, first_update):
    net = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1, use_bias=False)])
    optimizer = Recorder(CosineRate(1.0, warmup, epochs, steps))
    net.compile(optimizer, "mse", steps_per_execution=steps, run_eagerly=True)
    optimizer.iterations.assign(first_update)
    net.fit(tf.ones((count, 1)), tf.ones((count, 1)), batch_size=1, epochs=1, verbose=0, shuffle=False)

  total = epochs * steps
  if stop_after is None:
    fit(total, 0)
  else:
    fit(stop_after, 0)
    fit(total - stop_after, stop_after)
  return [float(rate) for rate in rates]


def test_cosine_changes_the_rate_at_every_update_inside_one_execution():
  rates = _trained_rates(epochs=3, steps=4, warmup=1)
  assert rates[:4] == [1.0] * 4                              # warm-up epoch (1 epoch: the full rate)
  assert rates[4] == pytest.approx(1.0)                      # the decay starts at the full rate
  assert rates[6] == pytest.approx(_cosine(2 / 8), abs=1e-6)
  assert all(a > b for a, b in zip(rates[4:], rates[5:]))    # strictly falling, never plateau-driven
  assert rates[-1] == pytest.approx(_cosine(7 / 8), abs=1e-6)


def test_cosine_warms_up_per_epoch_then_decays_to_zero_at_the_end():
  schedule = CosineRate(2.0, warmup_epochs=2, epochs=4, updates_per_epoch=5)
  assert [float(schedule(k)) for k in (0, 4, 5, 9)] == pytest.approx([1.0, 1.0, 2.0, 2.0])
  assert [float(schedule(k)) for k in (10, 15, 20, 99)] == pytest.approx([2.0, 2 * _cosine(0.5), 0.0, 0.0])
  assert CosineRate(1.0, 0, 3, 4).get_config() == {"initial_lr": 1.0, "warmup_epochs": 0, "epochs": 3,
                                                    "updates_per_epoch": 4}


def test_cosine_after_a_resume_continues_the_same_curve_from_the_update_count():
  whole = _trained_rates(epochs=3, steps=4, warmup=0)
  assert _trained_rates(epochs=3, steps=4, warmup=0, stop_after=7) == pytest.approx(whole)


def test_the_callback_logs_the_rate_of_each_epochs_last_update_and_sets_none_with_cosine():
  net = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
  rate = CosineRate(1.0, 0, 2, 4)
  net.compile(LEGACY_SGD(rate), "mse")
  schedule = LearningRateSchedule(1.0, 0, 0.5, 0, 0, cosine=rate)
  schedule.set_model(net)
  logs = {"val_loss": 1.0}
  schedule.on_epoch_begin(0)
  schedule.on_epoch_end(0, logs)
  assert logs["lr"] == pytest.approx(_cosine(3 / 8), abs=1e-6)
  assert net.optimizer._get_hyper("learning_rate") is rate   # pylint: disable=protected-access


def test_a_plateau_reduction_is_logged_after_the_epoch_not_inside_its_progress_bar(caplog):
  """on_epoch_end runs before Keras' bar writes its last update (its line still open), so the line
  comes at the next epoch's start, or at the end of training after the last epoch."""
  model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
  model.compile(tf.keras.optimizers.SGD(1.0), "mse")
  schedule = LearningRateSchedule(1.0, warmup_epochs=0, factor=0.5, patience=0, cooldown=0)
  schedule.set_model(model)
  caplog.set_level("INFO", logger="absl")
  for epoch, loss in enumerate((1.0, 1.0, 1.0)):   # no improvement: a reduction after epochs 2 and 3
    schedule.on_epoch_begin(epoch)
    schedule.on_epoch_end(epoch, {"val_loss": loss})
    if epoch == 1:
      assert "plateaued" not in caplog.text       # not yet: the bar's line is open
  assert caplog.text.count("plateaued") == 1 and "Epoch 2: val_loss" in line_naming(caplog.text, "plateaued")
  schedule.on_train_end()
  assert_names([line for line in caplog.text.splitlines() if "plateaued" in line][-1], "Epoch 3: val_loss", "0.25")


def test_a_reduction_just_before_a_stop_is_logged_when_the_interrupted_fit_is_ended(caplog, tmp_path):
  """A graceful stop at an epoch's end raises out of fit, which then calls no on_train_end: the loop
  ends the callbacks itself (training/loop.py end_interrupted_fit), writers and schedule alike."""
  model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
  model.compile(tf.keras.optimizers.SGD(1.0), "mse")
  schedule = LearningRateSchedule(1.0, warmup_epochs=0, factor=0.5, patience=0, cooldown=0)
  board = tf.keras.callbacks.TensorBoard(str(tmp_path))
  for callback in (schedule, board):
    callback.set_model(model)
  caplog.set_level("INFO", logger="absl")
  for epoch in range(2):
    schedule.on_epoch_begin(epoch)
    schedule.on_epoch_end(epoch, {"val_loss": 1.0})
  assert "plateaued" not in caplog.text
  end_interrupted_fit([schedule, board])
  assert_names(line_naming(caplog.text, "plateaued"), "Epoch 2: val_loss", "0.5")
