"""The warm-up + reduce-on-plateau schedule, checked against PyTorch's ReduceLROnPlateau semantics."""

import pytest

from training.lr_schedule import PlateauState, warmup_lr


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
