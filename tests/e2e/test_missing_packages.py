"""The README's first command run by a Python without the application's packages: one line saying
which package is missing and which Python has it, not an import traceback (errors.report_missing_packages)."""

import os
import subprocess
import sys

import pytest

import errors
from tests.support.helpers import REPO_ROOT, assert_names, assert_one_line_error, work_in

# Runs a program with tensorflow (alone) unimportable, as in a venv where only requirements.txt went in.
_WITHOUT_TENSORFLOW = """
import runpy, sys
class NoTensorFlow:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] == "tensorflow":
      raise ModuleNotFoundError("No module named %r" % name, name=name)
sys.meta_path.insert(0, NoTensorFlow())
sys.argv = sys.argv[1:]
sys.path.insert(0, ".")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
  """A real Python with nothing installed: a venv made without even pip."""
  folder = tmp_path_factory.mktemp("bare") / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
  return str(folder / "bin" / "python")


APPLICATION_VENVS = (".venv", ".venv-gpu", ".venv-tf26")  # make's, for BACKEND=cpu, gpu and tf26


def _advice(prefix, otherwise="`make install`"):
  """What the line advises a Python whose sys.prefix is `prefix`, given what this checkout holds: the
  first environment `make` built, if there is one and `prefix` is none of them."""
  venvs = [os.path.join(REPO_ROOT, folder) for folder in APPLICATION_VENVS]
  if os.path.realpath(prefix) not in [os.path.realpath(venv) for venv in venvs]:
    for folder, venv in zip(APPLICATION_VENVS, venvs):
      if os.path.exists(os.path.join(venv, "bin", "python")):
        return "%s/bin/python" % folder
  return otherwise


@pytest.mark.parametrize("program", ["main.py", "tools/predict.py", "tools/scan.py"])
def test_a_python_without_the_packages_is_told_which_to_use(bare_python, program):
  result = subprocess.run([bare_python, program, "--model=mnist"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 1, result.stderr
  assert_one_line_error(result, "has no module", "which %s needs" % program, bare_python,
                        _advice(os.path.dirname(os.path.dirname(bare_python))))


def test_the_reference_tools_name_their_own_environment(bare_python):
  # Arguments it accepts: it parses them before its imports, so that --help needs no PyTorch.
  result = subprocess.run([bare_python, "tools/reference_train.py", "--data_path=README.md"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
  assert_one_line_error(result, "has no module", "reference_train.py needs", ".venv-torch")


def test_tensorflow_missing_when_imported_late_is_one_line_too():
  """main.py imports TensorFlow inside absl's app.run, after the flags: the line must survive that."""
  result = subprocess.run([sys.executable, "-c", _WITHOUT_TENSORFLOW, "main.py", "--model=mnist"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1, result.stderr
  assert_one_line_error(result, "has no module", "'tensorflow'", _advice(sys.prefix, otherwise="Poplar SDK"))


def test_our_own_missing_module_keeps_its_traceback(monkeypatch, capsys):
  """A module of this repository that cannot be imported is a bug, not an installation problem."""
  seen = []
  monkeypatch.setattr(sys, "excepthook", lambda *exc_info: seen.append(exc_info[1]))
  errors.report_missing_packages()
  own = ModuleNotFoundError("No module named 'training.nothing'", name="training.nothing")
  sys.excepthook(ModuleNotFoundError, own, None)
  assert seen == [own] and capsys.readouterr().err == ""
  sys.excepthook(ModuleNotFoundError, ModuleNotFoundError("x", name="h5py"), None)
  assert seen == [own] and "has no module 'h5py'" in capsys.readouterr().err


def test_the_line_names_the_environment_of_another_backend(tmp_path, monkeypatch):
  """Each BACKEND has its own environment: a checkout with only .venv-gpu (BACKEND=gpu make install)
  is sent there, not told to create .venv."""
  python = tmp_path / ".venv-gpu" / "bin" / "python"
  python.parent.mkdir(parents=True)
  python.write_text("")
  monkeypatch.setattr(errors, "_REPO_ROOT", str(tmp_path))
  work_in(tmp_path, monkeypatch)
  message = errors.missing_package_message("absl.flags")
  assert_names(message, "has no module 'absl'", "%s needs" % errors.shown_path(os.path.abspath(sys.argv[0])),
               ".venv-gpu/bin/python", "BACKEND=gpu make install")
  monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv-gpu"))  # that environment itself lacks it
  assert_names(errors.missing_package_message("absl"), "`make install`", ".venv", "TensorFlow")
