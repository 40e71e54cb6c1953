"""The Makefile's choice of Python for the virtual environment, run with a real `make` on a PATH that
holds only the Pythons each test puts there.

TensorFlow has wheels for a range of Python versions per backend (requirements-<backend>.txt): a
python3 outside it (Fedora 43's 3.14) must lead to a supported python3.X when there is one, and else to
one error line before any environment is made, instead of pip's page of versions.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT, assert_names, line_naming

MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")
# The backend whose TensorFlow has wheels for the Python running the tests (3.8: the Poplar SDK stack).
BACKEND = "tf26" if sys.version_info[:2] == (3, 8) else "cpu"
THIS_PYTHON = "python%d.%d" % sys.version_info[:2]


def _bin(tmp_path, pythons):
  """A folder for PATH with `make`, an unsupported `python3` (3.14) and links to this Python by name."""
  folder = tmp_path / "bin"
  folder.mkdir()
  (folder / "make").symlink_to(MAKE)
  python3 = folder / "python3"
  # Answers the version check as Python 3.14 does (not in any backend's list) and `-V`.
  python3.write_text('#!/bin/sh\n[ "$1" = "-V" ] && { echo "Python 3.14.0"; exit 0; }\nexit 1\n')
  python3.chmod(0o755)
  for name in pythons:
    (folder / name).symlink_to(sys.executable)
  return folder


def _link_tools(folder):
  """Links the programs the venv recipe calls besides Python into the PATH folder."""
  for tool in ("rm", "mktemp"):
    (folder / tool).symlink_to(shutil.which(tool))


def _make(tmp_path, folder, *args, **more_env):
  env = {"PATH": str(folder), "HOME": str(tmp_path), **more_env}  # HOME: no pyenv Pythons
  return subprocess.run(["make", "--no-print-directory", "-s", "BACKEND=" + BACKEND] + list(args),
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_supported_python3_x_is_chosen_over_an_unsupported_python3(tmp_path):
  result = _make(tmp_path, _bin(tmp_path, [THIS_PYTHON]), "print-python")
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == THIS_PYTHON


def test_no_supported_python_is_one_error_line_and_no_environment(tmp_path):
  venv = tmp_path / "venv"
  result = _make(tmp_path, _bin(tmp_path, []), "install", "VENV=" + str(venv))
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, result.stderr
  assert_names(errors[0], "requirements-%s.txt" % BACKEND, "python3", "Python 3.14.0")
  assert "%d.%d" % sys.version_info[:2] in errors[0]  # the list of supported versions
  assert not venv.exists()
  assert "pip" not in result.stdout + result.stderr


def test_an_unsupported_python_named_by_the_user_is_refused(tmp_path):
  folder = _bin(tmp_path, [THIS_PYTHON])
  result = _make(tmp_path, folder, "install", "VENV=" + str(tmp_path / "venv"), "PYTHON=" + str(folder / "python3"))
  assert result.returncode != 0
  assert_names(line_naming(result.stderr, "PYTHON=%s" % (folder / "python3")), "Python 3.14.0")
  assert not (tmp_path / "venv").exists()


def test_a_venv_that_fails_half_way_is_removed(tmp_path):
  """Debian's python3 without its python3.X-venv package: `-m venv` makes bin/python, then fails on
  ensurepip. Left there, the next make would skip the venv and fail in pip with "No module named pip"."""
  folder = _bin(tmp_path, [])
  without_ensurepip = folder / THIS_PYTHON
  without_ensurepip.write_text(
      '#!/bin/sh\nif [ "$1 $2" = "-m venv" ]; then\n  "%s" -m venv --without-pip "$3"\n'
      '  echo "The virtual environment was not created successfully because ensurepip is not available." >&2\n'
      '  exit 1\nfi\nexec "%s" "$@"\n' % (sys.executable, sys.executable))
  without_ensurepip.chmod(0o755)
  _link_tools(folder)
  venv = tmp_path / "venv"
  result = _make(tmp_path, folder, "install", "VENV=" + str(venv))
  assert result.returncode != 0
  assert "ensurepip" in result.stderr  # Python's own reason stays
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, result.stderr
  assert_names(errors[0], "partial %s" % venv, "removed")
  assert not venv.exists()
  assert "pip install" not in result.stdout


def test_making_a_venv_leaves_nothing_in_the_temporary_folder(tmp_path):
  """The ensurepip of Python 3.8 and 3.9 leaves a copy of pip's CA bundle in $TMPDIR at each `-m venv`
  (one per CI run, from make test-tf26); here a Python that does the same, then fails as ensurepip can,
  so that the test stops before pip."""
  folder = _bin(tmp_path, [])
  leaves_a_file = folder / THIS_PYTHON
  leaves_a_file.write_text(
      '#!/bin/sh\nif [ "$1 $2" = "-m venv" ]; then\n'
      '  echo "# Issuer: CN=GlobalSign Root CA" > "${TMPDIR:-/tmp}/tmpcabundle"\n'
      '  exit 1\nfi\nexec "%s" "$@"\n' % sys.executable)
  leaves_a_file.chmod(0o755)
  _link_tools(folder)
  temporary = tmp_path / "tmp"
  temporary.mkdir()
  result = _make(tmp_path, folder, "install", "VENV=" + str(tmp_path / "venv"), TMPDIR=str(temporary))
  assert result.returncode != 0 and "-m venv" in result.stdout, result.stderr
  assert os.listdir(temporary) == []


def test_make_alone_lists_the_targets_and_installs_nothing(tmp_path):
  venv = tmp_path / "venv"
  result = _make(tmp_path, _bin(tmp_path, [THIS_PYTHON]), "VENV=" + str(venv))
  assert result.returncode == 0, result.stderr
  targets = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("make ")]
  assert {"run", "test", "install", "test-tf26"} <= set(targets), result.stdout
  assert not venv.exists()


@pytest.mark.parametrize("backend, venv", [("cpu", ".venv"), ("gpu", ".venv-gpu"), ("tf26", ".venv-tf26")])
def test_each_backend_installs_into_its_own_environment(tmp_path, backend, venv):
  """`make run` then `BACKEND=gpu make run` must not put the CUDA build over the CPU one in one
  environment, and tf26 needs Python 3.8: each BACKEND's environment is its own folder."""
  result = subprocess.run(["make", "--no-print-directory", "-n", "-B", "install", "BACKEND=" + backend,
                           "PYTHON=" + sys.executable], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
  assert result.returncode == 0, result.stderr
  assert "touch %s/.installed-%s" % (venv, backend) in result.stdout.splitlines()


def test_an_environment_of_another_backend_is_refused_before_pip(tmp_path):
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  (venv / "bin" / "python").symlink_to(sys.executable)
  (venv / ".installed-gpu").touch()  # made by BACKEND=gpu make install VENV=...
  result = _make(tmp_path, _bin(tmp_path, [THIS_PYTHON]), "install", "VENV=" + str(venv))
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, result.stderr
  assert_names(errors[0], venv, "BACKEND=gpu", "BACKEND=%s" % BACKEND, "rm -rf %s" % venv, "VENV=")
  assert "pip install" not in result.stdout and not (venv / (".installed-" + BACKEND)).exists()


def _slow_installing_python(folder, log):
  """A Python whose `-m venv` takes a second and makes an environment of the same program, and whose
  `-m pip install` takes half a second, and `-m compileall` returns at once; each writes a line to `log`.
  Version checks go to this Python."""
  script = folder / THIS_PYTHON
  script.write_text(
      '#!/bin/sh\n'
      'if [ "$1 $2" = "-m venv" ]; then\n'
      '  echo "venv $3" >> "{log}"; {sleep} 1; {mkdir} -p "$3/bin"; {cp} "$0" "$3/bin/python"; exit 0\n'
      'elif [ "$1 $2 $3" = "-m pip install" ]; then\n'
      '  echo "pip start" >> "{log}"; {sleep} 0.5; echo "pip end" >> "{log}"; exit 0\n'
      'elif [ "$1 $2 $3 $4" = "-W ignore -m compileall" ]; then\n'
      '  echo "compile" >> "{log}"; exit 0\n'
      'fi\nexec "{python}" "$@"\n'.format(log=log, python=sys.executable, **{
          tool: shutil.which(tool) for tool in ("sleep", "mkdir", "cp")}))
  script.chmod(0o755)


def _bin_that_installs(tmp_path):
  """A PATH folder whose Python installs as _slow_installing_python does, with the tools of the install
  recipe (flock where it exists); and the install log."""
  folder = _bin(tmp_path, [])
  log = tmp_path / "install.log"
  _slow_installing_python(folder, log)
  _link_tools(folder)
  for tool in ("flock", "awk", "touch"):
    if shutil.which(tool):
      (folder / tool).symlink_to(shutil.which(tool))
  return folder, log


@pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) is not installed")
def test_two_makes_started_together_install_once(tmp_path):
  """`make run` and `make test` typed into two terminals of a fresh clone: both find no environment; the
  second waits for the first's install, rather than run `-m venv` and fail in pip on a half-made one,
  then finds it."""
  folder, log = _bin_that_installs(tmp_path)
  venv = tmp_path / "venv"
  env = {"PATH": str(folder), "HOME": str(tmp_path)}
  command = ["make", "--no-print-directory", "-s", "BACKEND=" + BACKEND, "install", "VENV=" + str(venv)]
  makes = [subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for _ in range(2)]
  outputs = [make.communicate(timeout=60) for make in makes]
  assert [make.returncode for make in makes] == [0, 0], outputs
  assert log.read_text().splitlines() == ["venv %s" % venv] + ["pip start", "pip end"] * 2 + ["compile"]
  waited = [out for out, _ in outputs if "the other make" in out and str(venv) in out]
  assert len(waited) == 1, outputs
  assert (venv / (".installed-" + BACKEND)).exists()


def test_a_venv_left_without_pip_by_a_stopped_make_is_made_again(tmp_path):
  """Ctrl-C during `-m venv` (seconds, in ensurepip) leaves bin/python and no pip, and the removal on
  failure does not run: the next make took the venv for made and failed with "No module named pip"."""
  folder, log = _bin_that_installs(tmp_path)
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  (venv / "bin" / "python").write_text('#!/bin/sh\n[ "$1 $2" = "-m pip" ] && { echo "No module named pip" >&2; '
                                       'exit 1; }\nexec "%s" "$@"\n' % sys.executable)
  (venv / "bin" / "python").chmod(0o755)
  result = _make(tmp_path, folder, "install", "VENV=" + str(venv))
  assert result.returncode == 0, result.stdout + result.stderr
  assert_names(line_naming(result.stdout, "%s has no pip" % venv), "removing it")
  assert log.read_text().splitlines() == ["venv %s" % venv, "pip start", "pip end", "pip start", "pip end",
                                          "compile"]
  # pip runs --quiet for a minute or more on a fresh machine: a line before it says so and for how long.
  lines = result.stdout.splitlines()
  requirements = [i for i, line in enumerate(lines)
                  if all(name in line for name in ("pip install", "--quiet", "--no-compile", "-r requirements-"))]
  assert len(requirements) == 1, result.stdout
  assert_names(lines[requirements[0] - 1], "pip installs", "quietly", "1-2 minutes")


def test_make_run_from_another_folder_tells_main_py_where_the_shell_is(tmp_path):
  """`make -C <clone> run` leaves the user's shell in its own folder: main.py is given it as PWD (which
  bash, the recipes' shell, would set to the clone), so that the commands it prints at its end name
  whole paths (errors.shown_path). Run in the clone itself, PWD is the clone."""
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  # A Python script, not sh: sh, too, would set PWD to its working folder.
  (venv / "bin" / "python").write_text('#!%s\nimport os\nprint("main.py started from " + os.environ["PWD"])\n'
                                       % sys.executable)
  (venv / "bin" / "python").chmod(0o755)
  (venv / (".installed-" + BACKEND)).touch()  # newer than the requirements files: nothing to install
  quoted = tmp_path / "Bob's runs"  # a quote and a space, which the shell line must keep
  quoted.mkdir()
  for shell_folder in (quoted, REPO_ROOT):
    # --no-print-directory: under another make (make test-tf26), -C would print "Entering directory".
    result = subprocess.run(["make", "-s", "--no-print-directory", "-C", REPO_ROOT, "run", "BACKEND=" + BACKEND,
                             "VENV=" + str(venv)], cwd=shell_folder, env={**os.environ, "PWD": str(shell_folder)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    started = [line for line in result.stdout.splitlines() if line.startswith("main.py started from ")]
    assert len(started) == 1, result.stdout
    assert os.path.samefile(started[0].split(" from ", 1)[1], shell_folder), result.stdout


@pytest.mark.skipif(not os.path.exists(os.path.join(sys.prefix, ".installed-" + BACKEND)),
                    reason="the tests do not run in an environment that `make install` made")
def test_the_environment_make_installed_has_the_bytecode_of_modules_no_process_imported_yet():
  """pip installs with --no-compile and compileall compiles after it on every core: the modules of Keras
  (a TensorFlow dependency in every backend), most of which no test imports, have their bytecode."""
  folder = importlib.util.find_spec("keras").submodule_search_locations[0]  # found, not imported
  sources = [os.path.join(parent, name) for parent, _, names in os.walk(folder) for name in names
             if name.endswith(".py")]
  missing = [path for path in sources if not os.path.exists(importlib.util.cache_from_source(path))]
  assert len(sources) > 200 and not missing, (len(sources), missing[:5])
