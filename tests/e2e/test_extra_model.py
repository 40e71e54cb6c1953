"""A model registered from one file (tests/support/extra_model.py) trains through main.py's command line:
its own option is a flag, recorded in run_config.yaml and summary.yaml, and part of its checkpoints'
identity; no other file of the application names the model."""

import os
import subprocess
import sys

import yaml

from tests.support.helpers import REPO_ROOT, assert_one_line_error

SCRIPT = os.path.join(REPO_ROOT, "tests", "support", "extra_model.py")
RUN_FLAGS = ("--model=dense_mnist", "--backend=cpu", "--epochs=1", "--steps_per_epoch=4", "--eval_steps=2")


def _run(*args):
  environment = {key: value for key, value in os.environ.items()
                 if key not in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}  # the entry point sets them itself
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO_ROOT, env=environment, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, timeout=300)


def _yaml(path):
  with open(path) as stream:
    return yaml.safe_load(stream)


def test_a_model_from_one_file_trains_with_its_own_option_and_keeps_it(tmp_path):
  logdir = str(tmp_path / "run")
  result = _run(*RUN_FLAGS, "--hidden_units=24", "--logdir=" + logdir)
  assert result.returncode == 0, result.stderr[-3000:]
  run_config = _yaml(os.path.join(logdir, "run_config.yaml"))
  assert run_config["hidden_units"] == 24 and "--hidden_units=24" in run_config["command_line"]
  summary = _yaml(os.path.join(logdir, "summary.yaml"))
  assert summary["params"]["hidden_units"] == 24 and summary["params"]["model"] == "dense_mnist"
  # Another value of the option builds other weights: the run's checkpoint refuses it by name.
  refused = _run(*RUN_FLAGS, "--hidden_units=32", "--logdir=" + logdir, "--resume", "--epochs=2")
  assert refused.returncode == 1
  assert_one_line_error(refused, "--resume", "hidden_units=24", "hidden_units=32")


def test_its_option_is_refused_with_a_model_that_does_not_declare_it(tmp_path):
  result = _run("--model=mnist", "--backend=cpu", "--hidden_units=8", "--logdir=" + str(tmp_path / "run"))
  assert result.returncode != 0
  assert_one_line_error(result, "--hidden_units", "--model=dense_mnist")
