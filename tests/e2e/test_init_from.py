"""--init_from starts a run from another run's network weights (with another replica count), which then
trains, checkpoints and resumes as its own; another network is one error line; --keep_checkpoints keeps
the best K epochs.

One tiny run (dev design, short epochs) is trained for the module and started from by the others.
"""

import os

import pytest
import yaml

from tests.support.helpers import assert_one_line_error, run_main

RUN_FLAGS = ("--model=neuron_inverter", "--backend=cpu", "--batch_size=16", "--precision=32.32",
             "--warmup_epochs=0", "--steps_per_epoch=2", "--eval_steps=1")


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, contiguous_data_file):
  """The run started from: 3 epochs, its best 2 kept."""
  logdir = str(tmp_path_factory.mktemp("runs") / "a")
  result = run_main(*RUN_FLAGS, "--design=dev", "--data_path=" + contiguous_data_file, "--logdir=" + logdir, "--epochs=3",
                    "--keep_checkpoints=2")
  assert result.returncode == 0, result.stderr[-3000:]
  return logdir


def read_summary(logdir):
  with open(os.path.join(logdir, "summary.yaml")) as f:
    return yaml.safe_load(f)


def test_keep_checkpoints_keeps_the_best_k_epochs(run_a):
  from training import checkpoints as checkpoints_lib  # pylint: disable=import-outside-toplevel
  best = os.path.join(run_a, "checkpoints", "best")
  listed = checkpoints_lib.best_checkpoints(run_a)
  assert len(listed) == 2 and len(checkpoints_lib.read_index(best)) == 2, listed
  summary = read_summary(run_a)
  # The lowest, the index's current checkpoint, is the best epoch: the one tested, predicted from, started from.
  assert listed[0]["val_loss"] == pytest.approx(summary["best_val_loss"])
  assert listed[0]["val_loss"] <= listed[1]["val_loss"]
  assert listed[0]["epoch"] == summary["best_val_epoch"]
  assert checkpoints_lib.best_or_last(run_a) == listed[0]["checkpoint"]
  names = [os.path.basename(entry["checkpoint"]) for entry in listed]
  assert sorted(os.listdir(best)) == sorted(["checkpoint"] + [name + suffix for name in names
                                                              for suffix in (".index", ".data-00000-of-00001")])


def test_a_run_starts_from_the_best_weights_of_another_then_resumes_as_its_own(run_a, contiguous_data_file, tmp_path):
  logdir = str(tmp_path / "b")
  result = run_main(*RUN_FLAGS, "--design=dev", "--data_path=" + contiguous_data_file, "--logdir=" + logdir, "--epochs=1",
                    "--replicas=2", "--init_from=" + run_a)
  assert result.returncode == 0, result.stderr[-3000:]
  started, summary_a = read_summary(logdir), read_summary(run_a)
  init = started["init_from"]
  assert init["run"] == run_a and init["epoch"] == summary_a["best_val_epoch"]
  assert init["checkpoint"] == os.path.join(run_a, "checkpoints", "best", "ckpt-%d" % init["epoch"])
  # The weights A tested (its best) are those B started from, on 2 replicas where A had 1.
  assert init["weights_sha256"] == summary_a["weights_sha256"]
  assert started["replicas"] == 2 and started["history"]["epoch"] == [1]
  assert os.path.exists(os.path.join(logdir, "checkpoints", "best", "ckpt-1.index"))

  resumed = run_main(*RUN_FLAGS, "--design=dev", "--data_path=" + contiguous_data_file, "--logdir=" + logdir, "--epochs=2",
                     "--replicas=2", "--resume")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert init["checkpoint"] in result.stderr and init["checkpoint"] not in resumed.stderr  # named at the start only
  resumed_summary = read_summary(logdir)
  assert resumed_summary["history"]["epoch"] == [1, 2] and resumed_summary["init_from"] == init


@pytest.mark.parametrize("other", ["design", "model"])
def test_another_network_is_one_error_line_naming_both(run_a, contiguous_data_file, tmp_path, other):
  logdir = str(tmp_path / "other")
  if other == "design":
    flags = (*RUN_FLAGS, "--design=ontra4", "--data_path=" + contiguous_data_file, "--init_from=" + run_a)
    fragments = ("--init_from: ", "(design=dev,", "(design=ontra4,", "--design")
  else:  # a checkpoint named by its path
    best = os.path.join(run_a, "checkpoints", "best")
    with open(os.path.join(best, "checkpoint")) as f:
      name = f.readline().split('"')[1]
    flags = ("--model=mnist", "--backend=cpu", "--steps_per_epoch=1", "--init_from=" + os.path.join(best, name))
    fragments = ("--init_from: " + os.path.join(best, name), "neuron_inverter (design=dev,", "mnist (10 outputs)",
                 "--model")
  result = run_main(*flags, "--epochs=1", "--logdir=" + logdir)
  assert result.returncode == 1
  assert_one_line_error(result, *fragments)
  assert not os.path.exists(os.path.join(logdir, "checkpoints"))
