"""Run and output folders under hostile conditions, as a user meets them: links planted at the names a run
or tools/predict.py writes, a full output folder or a file-size limit, and refused commands.

One tiny run (dev design, one short epoch) is trained for the module; each case runs main.py or
tools/predict.py on a copy of it in a subprocess and checks the exit status, the file named in the
one `error:` line and the files left, byte for byte.
"""

import os
import resource
import shutil
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT, assert_one_line_error, can_mount_tmpfs, run_main

RUN_FLAGS = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16", "--precision=32.32",
             "--warmup_epochs=0", "--steps_per_epoch=2", "--eval_steps=1")
VICTIM = b"a file of the user's, outside the run folder\n"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, contiguous_data_file):
  logdir = str(tmp_path_factory.mktemp("runs") / "run")
  result = run_main(*RUN_FLAGS, "--data_path=" + contiguous_data_file, "--logdir=" + logdir, "--epochs=1")
  assert result.returncode == 0, result.stderr[-3000:]
  return logdir


@pytest.fixture
def run(tmp_path, finished_run):
  """A private copy of the finished run (links copied as links)."""
  copy = str(tmp_path / "run")
  shutil.copytree(finished_run, copy, symlinks=True)
  return copy


@pytest.fixture
def victim(tmp_path):
  path = tmp_path / "outside" / "precious.txt"
  path.parent.mkdir()
  path.write_bytes(VICTIM)
  return str(path)


def snapshot(folder):
  """{relative path: content, 'folder' or the link's target} of everything under `folder`."""
  state = {}
  for root, dirs, files in os.walk(folder):
    for name in dirs + files:
      path = os.path.join(root, name)
      if os.path.islink(path):
        state[os.path.relpath(path, folder)] = "link to " + os.readlink(path)
      elif os.path.isdir(path):
        state[os.path.relpath(path, folder)] = "folder"
      else:
        with open(path, "rb") as f:
          state[os.path.relpath(path, folder)] = f.read()
  return state


def resume(run, contiguous_data_file, *flags):
  return run_main(*RUN_FLAGS, "--data_path=" + contiguous_data_file, "--logdir=" + run, "--resume", "--epochs=2",
                  *flags)


def predict(*args, limit=None, prefix=()):
  """tools/predict.py as a user runs it; with `limit`, under `ulimit -f` of that many bytes (-B: Python's
  own bytecode cache would be cut at the limit and left damaged)."""
  env = dict(os.environ)
  env.pop("TF_USE_LEGACY_KERAS", None)
  return subprocess.run(list(prefix) + [sys.executable, "-B", os.path.join(REPO_ROOT, "tools", "predict.py")]
                        + list(args), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                        preexec_fn=limit and (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))))


def test_a_finished_run_leaves_no_lock_file(finished_run):
  assert not os.path.lexists(os.path.join(finished_run, ".lock"))
  assert os.path.isfile(os.path.join(finished_run, "summary.yaml"))


@pytest.mark.parametrize("refusal", ["another_design", "damaged_index"])
def test_a_refused_resume_leaves_the_run_folder_byte_for_byte_as_it_was(run, contiguous_data_file, refusal):
  """The check that refuses the command comes after the lock is taken and the log started: neither may
  show in the folder. A killed run's `.lock` (its pid) stays as it was too."""
  with open(os.path.join(run, ".lock"), "w") as f:
    f.write("pid 999999 on another-node\n")
  flags = ()
  if refusal == "another_design":
    flags, named = ("--design=ontra4",), "design=dev"
  else:
    with open(os.path.join(run, "checkpoints", "last", "checkpoint"), "w") as f:
      f.write("garbage\n")  # names no checkpoint
    named = os.path.join(run, "checkpoints", "last")
  before = snapshot(run)
  result = resume(run, contiguous_data_file, *flags)
  assert_one_line_error(result, "--resume", named)
  assert snapshot(run) == before


@pytest.mark.parametrize("name", [".lock", "log.txt", "summary.yaml.tmp"])
def test_a_link_planted_in_a_run_folder_stops_a_resume_and_is_not_written_through(run, contiguous_data_file, victim, name):
  link = os.path.join(run, name)
  if os.path.lexists(link):
    os.remove(link)
  os.symlink(victim, link)
  before = snapshot(run)
  result = resume(run, contiguous_data_file)
  assert_one_line_error(result, link + " is a symbolic link")
  with open(victim, "rb") as f:
    assert f.read() == VICTIM
  assert snapshot(run) == before


def test_predict_refuses_a_link_planted_at_its_output_and_leaves_the_target(run, victim):
  os.mkdir(os.path.join(run, "predict"))
  link = os.path.join(run, "predict", "predictions.npz")
  os.symlink(victim, link)
  result = predict("--logdir=" + run)
  assert_one_line_error(result, link + " is a symbolic link")
  with open(victim, "rb") as f:
    assert f.read() == VICTIM
  assert os.listdir(os.path.join(run, "predict")) == ["predictions.npz"]


def test_predict_under_a_file_size_limit_is_one_line_and_keeps_the_earlier_report(run):
  """`ulimit -f` 100 kB: the figures are larger. The earlier report stays whole, nothing of the new one
  is left."""
  outdir = os.path.join(run, "predict")
  os.mkdir(outdir)
  for name in ("sum_pred.yaml", "truth_vs_pred.png"):
    with open(os.path.join(outdir, name), "w") as f:
      f.write("the earlier report's %s\n" % name)
  before = snapshot(outdir)
  result = predict("--logdir=" + run, limit=100 * 1000)
  assert_one_line_error(result, "cannot write %s/" % outdir, "(File too large)")
  assert snapshot(outdir) == before


def test_predict_on_a_full_output_folder_is_one_line_and_leaves_nothing_partial(run, tmp_path):
  """A 1 MB tmpfs, most of it taken: the report's first figure does not fit."""
  full = tmp_path / "full"
  full.mkdir()
  if not can_mount_tmpfs(str(full)):
    pytest.skip("mounting a tmpfs needs root (unshare -m)")
  left = tmp_path / "left.txt"
  script = ("mount -t tmpfs -o size=1m tmpfs '{full}' && head -c 800000 /dev/zero > '{full}/filler' && "
            "\"$@\"; status=$?; ls -A '{full}/report' > '{left}'; exit $status").format(full=full, left=left)
  result = predict("--logdir=" + run, "--outdir=%s/report" % full,
                   prefix=("unshare", "-m", "sh", "-c", script, "sh"))
  assert_one_line_error(result, "cannot write %s/report/" % full, "No space left")
  assert left.read_text() == ""  # the folder it made, empty: no partial file, no temporary
