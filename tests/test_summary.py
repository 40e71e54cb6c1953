"""The closing report's next commands: the resume line repeats the run's own flags. The saved run
configuration that tools/predict.py reloads, and the output paths the tools check before their work."""

import os
import shlex

import pytest
import yaml

from errors import UserError
from run_config import RunConfig
from saved_config import load_run_config
from tests.support.helpers import assert_names, line_naming, work_in
from training import summary as summary_module
from training.summary import (RESUBMIT_VARIABLE, RUN_CONFIG_FILE, closing_report,
                              interrupted_report, python_command, resume_command,
                              resume_line, tool_command, write_run_config, write_yaml)


def test_resume_command_keeps_the_runs_flags_and_replaces_logdir_epochs_and_resume():
  argv = ["main.py", "--model=neuron_inverter", "--replicas=4", "--epochs", "3", "--logdir", "old",
          "--noresume", "-epochs=2", "--learning_rate=2e-3"]
  words = shlex.split(resume_command(argv, "logs/a b", 8))
  assert words == ["main.py", "--model=neuron_inverter", "--replicas=4", "--learning_rate=2e-3",
                   "--logdir=logs/a b", "--resume", "--epochs=8"]


def test_resume_command_names_the_script_relative_to_the_working_folder():
  script = os.path.join(os.getcwd(), "main.py")
  assert resume_command([script, "--model=mnist"], "r", 4).startswith("main.py --model=mnist ")
  assert resume_command(["/elsewhere/main.py"], "r", 4).startswith("/elsewhere/main.py ")


def _python_in(folder):
  folder.mkdir(parents=True)
  path = folder / "python3"
  path.write_text("#!/bin/sh\n")
  path.chmod(0o755)
  return str(path)


def test_the_reports_python_is_one_that_has_this_pythons_packages(tmp_path, monkeypatch):
  """Pasted commands must run with this Python: `python` on the PATH may be another one, or none."""
  work, environment, other = tmp_path / "work", tmp_path / "env" / "bin", tmp_path / "other" / "bin"
  work_in(work, monkeypatch)
  monkeypatch.setenv("PATH", str(environment))
  monkeypatch.setattr("sys.executable", _python_in(work / ".venv" / "bin"))   # make run's .venv
  assert python_command() == os.path.join(".venv", "bin", "python3")
  monkeypatch.setattr("sys.executable", _python_in(environment))              # an activated environment
  assert python_command() == "python3"
  monkeypatch.setattr("sys.executable", _python_in(other))                    # neither: the whole path
  assert python_command() == str(other / "python3")


def test_pasted_commands_quote_paths_with_spaces(tmp_path, monkeypatch):
  """A checkout or environment in a folder whose name has a space: each path stays one word."""
  work_in(tmp_path / "work", monkeypatch)
  monkeypatch.setenv("PATH", "")
  python = _python_in(tmp_path / "my env" / "bin")   # outside the working folder: its whole path
  monkeypatch.setattr("sys.executable", python)
  monkeypatch.setattr(summary_module, "_TOOLS", "/opt/my app/tools")
  assert shlex.split(python_command()) == [python]
  assert shlex.split(tool_command("predict.py", "runs/a b")) == [python, "/opt/my app/tools/predict.py",
                                                                  "--logdir", "runs/a b"]
  line = resume_line(["/opt/my app/main.py", "--model=mnist"], "runs/a b", 4)
  assert shlex.split(line) == [python, "/opt/my app/main.py", "--model=mnist", "--logdir=runs/a b", "--resume",
                               "--epochs=4"]


def test_commands_name_whole_paths_when_the_users_shell_is_in_another_folder(tmp_path, monkeypatch):
  """`make -C <clone> run` runs the application in the clone while the shell stays elsewhere: paths
  relative to the clone would not work there."""
  work = tmp_path / "clone"
  work_in(work, monkeypatch)
  monkeypatch.setenv("PATH", "")
  monkeypatch.setattr("sys.executable", _python_in(work / ".venv" / "bin"))
  monkeypatch.setattr(summary_module, "_TOOLS", str(work / "tools"))
  summary = {"model": "neuron_inverter", "epochs": 3, "best_val_loss": 0.2, "best_val_epoch": 3,
             "val_loss": 0.2}
  relative = closing_report(summary, "logs/run", [str(work / "main.py"), "--model=neuron_inverter"])
  assert shlex.split(line_naming(relative, "predict.py")) == [".venv/bin/python3", "tools/predict.py", "--logdir",
                                                              "logs/run"]
  assert shlex.split(line_naming(relative, "--resume"))[:5] == [
      ".venv/bin/python3", "main.py", "--model=neuron_inverter", "--logdir=logs/run", "--resume"]
  monkeypatch.setenv("PWD", str(tmp_path))   # the shell that ran `make -C clone run`
  whole = closing_report(summary, "logs/run", [str(work / "main.py"), "--model=neuron_inverter"])
  assert "Run finished: %s\n" % (work / "logs" / "run") in whole
  python, app = str(work / ".venv" / "bin" / "python3"), str(work)
  assert shlex.split(line_naming(whole, "predict.py")) == [python, app + "/tools/predict.py", "--logdir",
                                                           app + "/logs/run"]
  assert shlex.split(line_naming(whole, "--resume"))[:5] == [python, app + "/main.py", "--model=neuron_inverter",
                                                             "--logdir=%s/logs/run" % app, "--resume"]
  assert interrupted_report(["main.py"], "logs/run", 5).splitlines()[-1].split()[-5:] == [
      python, app + "/main.py", "--logdir=%s/logs/run" % app, "--resume", "--epochs=5"]


def test_closing_report_prints_a_resume_line_without_placeholders():
  summary = {"model": "mnist", "epochs": 2, "test_loss": 0.1, "test_accuracy": 0.9}
  report = closing_report(summary, "logs/r", ["main.py", "--model=mnist", "--replicas=2"])
  line = report.splitlines()[-1]
  assert "<" not in line and ">" not in line
  assert shlex.split(line, comments=True)[1:] == ["main.py", "--model=mnist", "--replicas=2",
                                                  "--logdir=logs/r", "--resume", "--epochs=7"]


def test_closing_report_says_how_many_samples_the_test_loss_covers():
  summary = {"model": "neuron_inverter", "epochs": 3, "test_loss": 0.1632, "mean_predictor_val_loss": 0.3326,
             "mean_predictor_test_loss": 0.3336, "test_samples": 2048, "test_weights_epoch": 3,
             "best_val_loss": 0.1628, "best_val_epoch": 3, "val_loss": 0.1628}
  report = closing_report(summary, "logs/r")
  # Each split against its own baseline.
  assert_names(line_naming(report, "  test: loss"), "loss 0.1632", "(0.489 of", "baseline 0.3336", "2048 samples",
               "epoch 3)")
  assert_names(line_naming(report, "  validation: best"), "best 0.1628", "(0.489 of", "baseline 0.3326",
               "epoch 3;", "last epoch 0.1628")
  del summary["test_samples"]  # a summary.yaml of an earlier session
  assert "(weights of epoch 3)" in closing_report(summary, "logs/r")


def test_closing_report_lists_what_the_run_folder_holds_and_predict_only_for_regression(tmp_path):
  logdir = str(tmp_path)
  for folder in ("checkpoints/last", "train", "test"):
    os.makedirs(os.path.join(logdir, folder))
  open(os.path.join(logdir, "summary.yaml"), "w").close()
  mnist = closing_report({"model": "mnist", "epochs": 2}, logdir)
  outputs = line_naming(mnist, "  outputs: ")
  assert_names(outputs, "summary.yaml", "checkpoints/last,", "(train/, test/)")
  assert "validation/" not in outputs and "predict/" not in outputs
  assert "tools/predict.py" not in mnist  # its reports are per conductance: regression models only
  for folder in ("checkpoints/best", "validation", "predict"):
    os.makedirs(os.path.join(logdir, folder))
  open(os.path.join(logdir, "events.out.tfevents.1.host.2.v2"), "w").close()
  regression = closing_report({"model": "neuron_inverter", "epochs": 3}, logdir)
  assert_names(line_naming(regression, "  outputs: "), "summary.yaml", "checkpoints/{last,best}", "validation/",
               "HParams", "predict/", "sum_pred.yaml", "TensorBoard images")
  assert_names(line_naming(regression, "tools/predict.py"), "--logdir " + logdir)
  assert regression.endswith("# train on to epoch 8")
  two_workers = closing_report({"model": "neuron_inverter", "epochs": 3}, logdir, processes=2)
  assert_names(two_workers.splitlines()[-1].split("#")[-1], "epoch 8", "2 processes", "srun, poprun or TF_CONFIG")


def test_a_job_scripts_run_is_continued_by_submitting_the_job_again(monkeypatch):
  """tools/slurm's scripts set RESUBMIT_VARIABLE to their sbatch command and flags: both reports give
  that command (later flags win) instead of a python line, even for a run of several workers."""
  monkeypatch.setenv(RESUBMIT_VARIABLE, "sbatch ./tools/slurm/gpu.sbatch --epochs=2 --cell_name=a\\ b")
  argv = ["./main.py", "--model=neuron_inverter", "--backend=gpu", "--logdir=logs/j", "--epochs=2"]
  stopped = interrupted_report(argv, "logs/j", 2, processes=2).splitlines()
  job = ["sbatch", "./tools/slurm/gpu.sbatch", "--epochs=2", "--cell_name=a b", "--logdir=logs/j", "--resume"]
  assert len(stopped) == 3 and stopped[0] == "Continue with:", stopped
  assert shlex.split(stopped[1]) == job + ["--epochs=2"]
  assert "sbatch options" in stopped[2]
  finished = closing_report({"model": "neuron_inverter", "epochs": 2}, "logs/j", argv, processes=2)
  command, comment = finished.splitlines()[-1].split("#")
  assert shlex.split(command) == job + ["--epochs=7"]
  assert_names(comment, "epoch 7", "sbatch options")
  monkeypatch.delenv(RESUBMIT_VARIABLE)
  assert interrupted_report(argv, "logs/j", 2).splitlines()[1].split()[1:3] == ["main.py",
                                                                               "--model=neuron_inverter"]


def _saved_run(tmp_path, drop=(), **edits):
  """A run folder whose run_config.yaml is a real one, with the keys `drop` removed and `edits` set."""
  logdir = str(tmp_path / "run")
  os.makedirs(logdir)
  path = write_run_config(logdir, RunConfig(model="neuron_inverter", model_options={"design": "dev"}, logdir=logdir),
                          command_line=["main.py", "--model=neuron_inverter", "--design=dev"])
  with open(path) as f:
    saved = yaml.safe_load(f)
  saved.update(edits)
  for key in drop:
    del saved[key]
  write_yaml(path, saved)
  return logdir, path


@pytest.mark.parametrize("text, found", [("42\n", "the single value 42"), ("", "nothing"),
                                         ("- model\n", "a list")])
def test_a_run_config_that_is_no_mapping_is_refused_not_skipped_for_summary_yaml(tmp_path, text, found):
  logdir, path = _saved_run(tmp_path)
  write_yaml(os.path.join(logdir, "summary.yaml"), {"params": {"model": "neuron_inverter"}})
  with open(path, "w") as f:
    f.write(text)
  with pytest.raises(UserError) as error:
    load_run_config(logdir)
  assert str(error.value).startswith("%s: " % path)
  assert_names(error.value, "holds " + found, "mapping of flag names")


@pytest.mark.parametrize("edit, said", [({"model": None}, "null"), ({"drop": ["model"]}, "missing")])
def test_a_run_config_without_its_model_is_refused(tmp_path, edit, said):
  """Not the command line's default model (mnist), which the evaluation then blamed for not being one."""
  logdir, path = _saved_run(tmp_path, **edit)
  with pytest.raises(UserError, match="^%s: model is %s" % (path, said)) as caught:
    load_run_config(logdir)
  assert_names(caught.value, "mnist|neuron_inverter")


def test_a_run_config_records_the_settled_options_and_the_command_as_typed(tmp_path, caplog):
  """Every option of the model, defaults included, and the arguments as typed, which is no setting."""
  logdir, path = _saved_run(tmp_path)
  with open(path) as f:
    saved = yaml.safe_load(f)
  assert saved["command_line"] == ["main.py", "--model=neuron_inverter", "--design=dev"]
  assert (saved["design"], saved["batch_norm_statistics"]) == ("dev", "auto")
  caplog.set_level("WARNING", logger="absl")
  assert load_run_config(logdir).model_options["design"] == "dev" and not caplog.records


def test_unknown_and_missing_keys_of_a_run_config_are_named_in_warnings(tmp_path, caplog):
  """Kept working for older and newer runs, but a typo (`desgin:`) says what it did."""
  logdir, path = _saved_run(tmp_path, drop=["design"], desgin="dev", seed=None)
  caplog.set_level("WARNING", logger="absl")
  config = load_run_config(logdir)
  assert config.model_options["design"] == "ontra4" and config.seed == 42
  ignored, defaulted = [record.getMessage() for record in caplog.records]
  assert ignored.startswith("%s: " % path) and defaulted.startswith("%s: " % path)
  assert_names(ignored, "ignoring desgin", "typo")
  assert_names(defaulted, "seed, design", "seed=42, design=ontra4")
  caplog.clear()
  logdir, _ = _saved_run(tmp_path / "intact")
  assert load_run_config(logdir).model_options["design"] == "dev" and not caplog.records  # a run's own file: no warning


def test_an_override_that_the_run_config_refuses_names_the_override(tmp_path):
  """predict.py --cell_name=synth on a run trained on a file: the message blamed run_config.yaml alone."""
  data_file = tmp_path / "cell.h5"
  data_file.write_bytes(b"")
  logdir, path = _saved_run(tmp_path, data_path=str(data_file))
  with pytest.raises(UserError, match="^%s with " % path) as caught:
    load_run_config(logdir, cell_name="synth", design="dev", seed=None)  # the same design: not named
  assert_names(caught.value, "--cell_name=synth", "cell_name=synth,", "data_path=", "--data_path folder")
  assert "design=" not in str(caught.value)


def test_a_tools_own_default_is_applied_but_not_named_as_the_users_change(tmp_path):
  """predict.py's --backend=auto, not typed, was listed beside the user's --cell_name as if typed."""
  data_file = tmp_path / "cell.h5"
  data_file.write_bytes(b"")
  logdir, path = _saved_run(tmp_path, data_path=str(data_file), backend="ipu")
  with pytest.raises(UserError, match="^%s with " % path) as caught:
    load_run_config(logdir, tool_defaults={"backend": "auto"}, cell_name="synth")
  assert_names(caught.value, "--cell_name=synth")
  config = load_run_config(logdir, tool_defaults={"backend": "auto"})
  assert config.backend == "auto"  # a run trained on IPUs is evaluated where the tool runs
  assert load_run_config(logdir, tool_defaults={"backend": "auto"}, backend="cpu").backend == "cpu"
