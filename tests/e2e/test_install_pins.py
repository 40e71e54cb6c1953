"""The installs for the Poplar SDK's stack keep the SDK's packages, and pip settles them quickly.

Each install is resolved as a user's command would be, on Python 3.8 (the SDK's), by `pip install
--dry-run --ignore-installed --report`: nothing is installed, and the report names what pip would install.
Needs PyPI (the network). With a cold pip cache pip downloads each wheel it weighs, tensorflow-cpu's
178 MB among them (PyPI has no separate metadata for these older wheels); a warm cache only revalidates
the index pages.
"""

import glob
import json
import os
import subprocess
import time
import urllib.request

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.helpers import REPO_ROOT

CONSTRAINTS = os.path.join(REPO_ROOT, "requirements-sdk-constraints.txt")
# The pins of Graphcore's TensorFlow 2.6.3 wheel that an install must never move: REQUIRED_PACKAGES in
# graphcore/tensorflow tensorflow/tools/pip_package/setup.py (r2.6/sdk-release-2.6 to -3.4). numpy and
# h5py are those TensorFlow's binaries were built against; protobuf 3.20 and later break TensorFlow 2.6.
SDK_PINS = {"numpy": SpecifierSet("~=1.19.2"), "h5py": SpecifierSet("~=3.1.0"),
            "protobuf": SpecifierSet(">=3.9.2,<3.20")}
# Distributions that hold a TensorFlow (the `tensorflow` module) or Keras, whatever the build.
TENSORFLOWS = {"tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-aarch64",
               "tensorflow-macos", "tensorflow-rocm", "intel-tensorflow", "tf-nightly", "tf-nightly-cpu"}
# A resolution that takes longer is a backtracking search (one went on for over 20 minutes unbounded);
# these take 5 to 20 s on a 2-core machine, with pip's cache warm or cold.
RESOLVE_SECONDS = 180


def _python38():
  """Python 3.8 as `make install BACKEND=tf26` finds it, else pyenv's; None where there is none."""
  environment = {name: value for name, value in os.environ.items()
                 if name not in ("PYTHON", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # those of a calling make
  try:
    found = subprocess.run(["make", "-s", "-C", REPO_ROOT, "print-python", "BACKEND=tf26"], env=environment,
                           capture_output=True, text=True, timeout=60).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    found = ""
  for python in [found] + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8.*/bin/python"))):
    if python and subprocess.run([python, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 8))"],
                                 capture_output=True).returncode == 0:
      return python
  return None


@pytest.fixture(scope="module")
def python38():
  python = _python38()
  if python is None:
    pytest.skip("no Python 3.8 here (make print-python BACKEND=tf26 found none, nor ~/.pyenv/versions/3.8.*)")
  try:
    urllib.request.urlopen("https://pypi.org/simple/tensorflow-cpu/", timeout=20).close()
  except OSError as error:
    pytest.skip("PyPI cannot be reached from here: %s" % error)
  return python


def _venv(python, folder, pip):
  """A scratch venv of `python` with `pip` (a requirement on pip), as the install makes it; its python.
  The pip 23.0 that `python3.8 -m venv` brings, given an index that does not publish each release's
  Requires-Python (a local mirror, as on the machines this project is built on), picks releases for
  newer Pythons and backtracks for over 20 minutes; pip 24 does not."""
  subprocess.run([python, "-m", "venv", str(folder)], check=True, capture_output=True, timeout=120)
  python = str(folder / "bin" / "python")
  upgrade = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--upgrade", pip], capture_output=True, text=True, timeout=300)
  assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
  return python


def _resolve(python, tmp_path, *args):
  """What `pip install ARGS` would install (name: version), resolved from REPO_ROOT on `python`."""
  report, log = tmp_path / "report.json", tmp_path / "pip.log"
  command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report", str(report),
             "--progress-bar", "off", "--disable-pip-version-check"] + list(args)
  start = time.monotonic()
  with open(log, "w") as output:
    try:
      result = subprocess.run(command, cwd=REPO_ROOT, stdout=output,
                              stderr=subprocess.STDOUT, timeout=RESOLVE_SECONDS)
    except subprocess.TimeoutExpired:
      pytest.fail("pip had not resolved %s after %d s, a backtracking search; its last lines:\n%s"
                  % (" ".join(args), RESOLVE_SECONDS, _tail(log)))
  print("pip resolved %s in %.0f s" % (" ".join(args), time.monotonic() - start))
  assert result.returncode == 0, _tail(log)
  with open(report) as handle:
    return {canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"])
            for item in json.load(handle)["install"]}


def _tail(log, lines=15):
  with open(log) as handle:
    return "".join(handle.readlines()[-lines:])


def _assert_sdk_packages_kept(installs):
  for name, pin in SDK_PINS.items():
    assert name in installs and installs[name] in pin, (name, installs.get(name))
  with open(CONSTRAINTS) as handle:  # every package the SDK's wheel requires, in the wheel's range
    for line in handle:
      line = line.split("#")[0].strip()
      if line:
        requirement = Requirement(line)
        version = installs.get(canonicalize_name(requirement.name))
        assert version is None or version in requirement.specifier, (requirement, version)


def test_the_ipu_install_keeps_the_sdks_packages(python38, tmp_path):
  """`pip install -r requirements-ipu.txt` in the SDK's venv. The SDK's wheels are installed already, and
  pip does not read the requirements of installed packages it is not asked for: so here, as there,
  only requirements-ipu.txt's own -c line holds numpy, h5py and protobuf to the wheel's pins."""
  python = _venv(python38, tmp_path / "venv", "pip==24.0")  # docs/ipu.md: later pips refuse SDK wheels
  installs = _resolve(python, tmp_path, "-r", "requirements-ipu.txt")
  _assert_sdk_packages_kept(installs)
  assert not set(installs) & (TENSORFLOWS | {"keras", "tf-keras", "ipu-tensorflow-addons"})


def test_the_tf26_stand_in_resolves_to_the_sdks_versions(python38, tmp_path):
  """`make install BACKEND=tf26`: tensorflow-cpu 2.6.3 (PyPI's build of the SDK's TensorFlow release)
  with requirements.txt, which requirements-ipu.txt installs on IPU hosts, and the test tools."""
  python = _venv(python38, tmp_path / "venv", "pip<25")  # the Makefile's
  installs = _resolve(python, tmp_path, "-r", "requirements-tf26.txt", "-r", "requirements.txt",
                      "-r", "requirements-dev.txt")
  _assert_sdk_packages_kept(installs)
  assert {name: str(version) for name, version in installs.items() if name in TENSORFLOWS} == {
      "tensorflow-cpu": "2.6.3"}
