"""Training that ends before --epochs: --early_stopping_patience (continued across --resume) and
--target_loss (with its time to target in summary.yaml and the closing report), on a tiny real run."""

import os

import pytest
import yaml

from tests.support.helpers import assert_names, line_naming, run_main

RUN_FLAGS = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16", "--precision=32.32",
             "--warmup_epochs=0", "--steps_per_epoch=2", "--eval_steps=1")
# Adam's step is about the learning rate whatever the gradient: 1e-12 leaves float32 weights as they
# are, and each batch's own normalisation statistics leave no moving ones to change, so the validation
# loss repeats exactly and never improves after the first epoch.
FROZEN = ("--optimizer=adam", "--learning_rate=1e-12", "--batch_norm_statistics=batch")


def _summary(logdir):
  with open(os.path.join(logdir, "summary.yaml")) as f:
    return yaml.safe_load(f)


def _train(contiguous_data_file, logdir, *flags):
  result = run_main(*RUN_FLAGS, "--data_path=" + contiguous_data_file, "--logdir=" + logdir, *flags)
  assert result.returncode == 0, result.stderr[-3000:]
  return result, _summary(logdir)


def test_early_stopping_ends_training_and_counts_on_across_a_resume(contiguous_data_file, tmp_path):
  logdir = str(tmp_path / "run")
  result, summary = _train(contiguous_data_file, logdir, *FROZEN, "--epochs=6", "--early_stopping_patience=2")
  assert summary["stopped_early"] == {"after_epoch": 3, "reason": "early_stopping"}
  assert summary["history"]["epoch"] == [1, 2, 3] and summary["best_val_epoch"] == 1
  assert "epoch 3" in line_naming(result.stdout, "stopped early")
  # The resumed run has waited 2 epochs already: one more without improvement stops it.
  _, resumed = _train(contiguous_data_file, logdir, *FROZEN, "--epochs=6", "--early_stopping_patience=2", "--resume")
  assert resumed["stopped_early"] == {"after_epoch": 4, "reason": "early_stopping"}
  assert resumed["history"]["epoch"] == [1, 2, 3, 4]


def test_target_loss_stops_at_the_first_validation_that_reaches_it(contiguous_data_file, tmp_path):
  logdir = str(tmp_path / "run")
  result, summary = _train(contiguous_data_file, logdir, "--epochs=3", "--target_loss=100")
  assert summary["stopped_early"] == {"after_epoch": 1, "reason": "target_loss"}
  assert summary["target_epoch"] == 1 and summary["history"]["epoch"] == [1]
  assert 0 < summary["time_to_target_training_seconds"] < summary["time_to_target_seconds"]
  assert summary["time_to_target_seconds"] <= summary["total_seconds"]
  assert summary["params"]["target_loss"] == 100
  assert_names(line_naming(result.stdout, "target: "), "at or below 100", "epoch 1")
  with open(os.path.join(logdir, "history.csv")) as f:
    assert len(f.read().splitlines()) == 2  # the header and epoch 1


def test_a_target_not_reached_trains_every_epoch_and_says_so(contiguous_data_file, tmp_path):
  logdir = str(tmp_path / "run")
  result, summary = _train(contiguous_data_file, logdir, "--epochs=2", "--target_loss=1e-9")
  assert summary["stopped_early"] is None and summary["time_to_target_seconds"] is None
  assert summary["history"]["epoch"] == [1, 2]
  assert "not reached" in result.stdout
