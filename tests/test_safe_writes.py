"""Writes into run, cache, staging and output folders: never through a planted link, whole or not at all,
and a failed write one error naming the file (host/atomic_files.py and its users)."""

import errno
import logging as python_logging
import os
import re
import resource
import subprocess
import sys
import textwrap

import pytest
from absl import logging

from errors import UserError
from host import atomic_files
from tests.support.helpers import REPO_ROOT, assert_names
from training import logs, run_folder
from training import summary as summary_lib


@pytest.fixture
def victim(tmp_path):
  """A file of the user's outside the folder written to, which a planted link points at."""
  path = tmp_path / "outside" / "precious.txt"
  path.parent.mkdir()
  path.write_bytes(b"the user's own file\n")
  return path


def plant(link, target):
  link.parent.mkdir(parents=True, exist_ok=True)
  os.symlink(str(target), str(link))


def names(folder):
  return sorted(os.listdir(str(folder)))


# --- host/atomic_files.py ------------------------------------------------------------------------------

@pytest.mark.parametrize("write", [lambda path: atomic_files.write_text(path, "new"),
                                   lambda path: atomic_files.write_bytes(path, b"new"),
                                   lambda path: atomic_files.append_text(path, "new"),
                                   lambda path: os.close(atomic_files.open_lock_file(path)),
                                   lambda path: summary_lib.write_yaml(path, {"a": 1})])
def test_a_link_where_a_file_is_written_is_refused_and_its_target_untouched(tmp_path, victim, write):
  link = tmp_path / "run" / "file"
  plant(link, victim)
  with pytest.raises(atomic_files.LinkError,
                     match="^%s is a symbolic link" % re.escape(str(link))):
    write(str(link))
  assert victim.read_bytes() == b"the user's own file\n" and os.path.islink(str(link))
  assert names(link.parent) == ["file"]  # no temporary left


def test_a_dangling_link_is_refused_not_created_through(tmp_path):
  link, target = tmp_path / "log.txt", tmp_path / "elsewhere" / "made.txt"
  target.parent.mkdir()
  plant(link, target)
  for write in (atomic_files.append_text, atomic_files.write_text):
    with pytest.raises(atomic_files.LinkError):
      write(str(link), "x")
  assert not target.exists()


def test_a_fifo_where_a_log_is_appended_is_refused_without_blocking(tmp_path):
  fifo = tmp_path / "log.txt"
  os.mkfifo(str(fifo))
  with pytest.raises(atomic_files.LinkError, match="is a FIFO"):
    atomic_files.append_text(str(fifo), "x")


def test_a_replaced_file_appears_whole_under_fresh_temporary_names(tmp_path):
  path = tmp_path / "summary.yaml"
  path.write_text("old")
  first, second = atomic_files.temporary_name(str(path)), atomic_files.temporary_name(str(path))
  assert first != second and os.path.basename(first).startswith(".summary.yaml.")
  with atomic_files.replaced(str(path)) as handle:
    handle.write("new")
    assert path.read_text() == "old"  # nothing shows until the rename
    # A link planted at the temporary's name meanwhile changes nothing: its name was never used.
  assert path.read_text() == "new" and names(tmp_path) == ["summary.yaml"]


def test_a_block_that_fails_leaves_the_file_as_it_was(tmp_path):
  path = tmp_path / "sum_pred.yaml"
  path.write_text("old")
  with pytest.raises(KeyError):
    with atomic_files.replaced(str(path)) as handle:
      handle.write("half")
      raise KeyError("the writer's own bug")
  with pytest.raises(FileNotFoundError):  # a file the block reads: its own error, not a write's
    with atomic_files.replaced(str(path)):
      open(str(tmp_path / "missing"))
  assert path.read_text() == "old" and names(tmp_path) == ["sum_pred.yaml"]


def _in_a_limited_process(code, limit=20000):
  """Runs `code` in a Python whose files may grow to `limit` bytes (`ulimit -f`, as batch systems set);
  returns (exit status, stderr)."""
  # -B: Python's own bytecode cache, cut at the limit, would be left behind as a damaged .pyc.
  result = subprocess.run([sys.executable, "-B", "-c", textwrap.dedent(code)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
  return result.returncode, result.stderr


def test_a_file_size_limit_is_one_error_naming_the_file_with_nothing_partial_left(tmp_path):
  path = tmp_path / "predictions.npz"
  path.write_bytes(b"the earlier report")
  status, stderr = _in_a_limited_process("""
      import sys
      from host import atomic_files
      try:
        atomic_files.write_bytes(%r, b"x" * 100000)
      except atomic_files.WriteError as error:
        print("error: %%s" %% error, file=sys.stderr)
        sys.exit(3 if error.errno == %d and isinstance(error, OSError) else 4)
      """ % (str(path), errno.EFBIG))
  assert status == 3, stderr
  assert_names(stderr, "error: cannot write %s" % path, "File too large", "ulimit -f")
  assert path.read_bytes() == b"the earlier report" and names(tmp_path) == ["predictions.npz"]


def test_staged_files_appear_together_or_not_at_all(tmp_path, victim):
  folder = tmp_path / "predict"
  folder.mkdir()
  (folder / "a.yaml").write_text("old a")
  with pytest.raises(atomic_files.WriteError, match="^cannot write %s" % re.escape(str(folder / "b.png"))) as caught:
    with atomic_files.staged_files(str(folder)) as staging:
      atomic_files.write_text(os.path.join(staging, "a.yaml"), "new a")
      raise atomic_files.write_error(os.path.join(staging, "b.png"),
                                     OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
  assert_names(caught.value, "No space left")
  assert names(folder) == ["a.yaml"] and (folder / "a.yaml").read_text() == "old a"
  plant(folder / "b.png", victim)
  with pytest.raises(atomic_files.LinkError, match=re.escape(str(folder / "b.png"))):
    with atomic_files.staged_files(str(folder)) as staging:
      atomic_files.write_text(os.path.join(staging, "a.yaml"), "new a")
      atomic_files.write_text(os.path.join(staging, "b.png"), "new b")
  assert (folder / "a.yaml").read_text() == "old a" and victim.read_bytes() == b"the user's own file\n"
  os.remove(str(folder / "b.png"))
  with atomic_files.staged_files(str(folder)) as staging:
    atomic_files.write_text(os.path.join(staging, "a.yaml"), "new a")
    atomic_files.write_text(os.path.join(staging, "b.png"), "new b")
  assert names(folder) == ["a.yaml", "b.png"] and (folder / "a.yaml").read_text() == "new a"


def test_one_writer_at_a_time_refuses_a_link_at_its_lock_file(tmp_path, victim):
  plant(tmp_path / ".cellspike.h5.lock", victim)
  with pytest.raises(atomic_files.LinkError) as caught:
    with atomic_files.one_writer_at_a_time(str(tmp_path / "cellspike.h5"), on_wait=None):
      pass
  assert_names(caught.value, ".cellspike.h5.lock", "symbolic link")
  assert victim.read_bytes() == b"the user's own file\n"


def test_stale_temporaries_of_both_name_forms_are_removed(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  host = os.uname()[1]
  left = [".data.h5.%s.%d.tmp" % (host, dead.pid), ".data.h5.%s.%d.0badcafe.tmp" % (host, dead.pid)]
  for name in left:
    (tmp_path / name).write_text("partial")
  assert sorted(atomic_files.remove_stale(str(tmp_path / "data.h5"))) == sorted(left)
  assert names(tmp_path) == []


def test_the_logdir_probe_has_no_fixed_name_to_plant_a_link_at(tmp_path, victim):
  from training import loop  # pylint: disable=import-outside-toplevel
  plant(tmp_path / "run" / ".write_test", victim)
  loop.prepare_logdir(str(tmp_path / "run"))
  assert victim.read_bytes() == b"the user's own file\n" and names(tmp_path / "run") == [".write_test"]


# --- training/run_folder.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", run_folder.FIXED_FILES + run_folder.FIXED_FOLDERS
                         + (os.path.join("checkpoints", "last", "checkpoint"),))
def test_a_link_at_any_name_the_run_writes_is_refused_before_anything_is_written(tmp_path, victim, name):
  logdir = tmp_path / "run"
  logdir.mkdir()
  plant(logdir / name, victim.parent if name in run_folder.FIXED_FOLDERS else victim)
  before = {path: os.lstat(str(path)).st_mtime_ns for path in logdir.rglob("*")}
  with pytest.raises(UserError, match="^%s is a symbolic link" % re.escape(str(logdir / name))):
    run_folder.claim(str(logdir), resume=False)
  assert victim.read_bytes() == b"the user's own file\n" and names(victim.parent) == ["precious.txt"]
  assert {path: os.lstat(str(path)).st_mtime_ns for path in logdir.rglob("*")} == before


def test_a_lock_file_planted_after_the_check_is_not_written_through(tmp_path, victim):
  plant(tmp_path / run_folder.LOCK_FILE, victim)
  with pytest.raises(UserError, match=r"\.lock is a symbolic link"):
    run_folder.lock(str(tmp_path))
  assert victim.read_bytes() == b"the user's own file\n"


def test_a_refused_command_leaves_the_lock_file_as_it_was_and_a_finished_run_none(tmp_path):
  """A killed run's `.lock` (its pid) stays as it was after a refused command; a run that passed its
  checks removes it at its end, and one in a folder without it leaves none either way."""
  killed = b"pid 12345 on another-node\n"
  (tmp_path / run_folder.LOCK_FILE).write_bytes(killed)
  run_folder.lock(str(tmp_path))
  assert (tmp_path / run_folder.LOCK_FILE).read_text() == "pid %d on %s\n" % (os.getpid(), os.uname()[1])
  run_folder.release(str(tmp_path))  # refused: never accepted
  assert (tmp_path / run_folder.LOCK_FILE).read_bytes() == killed
  run_folder.lock(str(tmp_path))
  run_folder.accepted(str(tmp_path))
  run_folder.release(str(tmp_path))
  assert names(tmp_path) == []
  for accept in (False, True):
    run_folder.lock(str(tmp_path))
    if accept:
      run_folder.accepted(str(tmp_path))
    run_folder.release(str(tmp_path))
    assert names(tmp_path) == []


def test_a_lock_file_removed_by_a_finishing_run_is_not_the_one_locked(tmp_path, monkeypatch):
  """Between opening `.lock` and locking it, the run that held it may finish and remove it: locking the
  removed file would lock nothing another process can see, so it is opened again."""
  opened = []
  real_open = atomic_files.open_lock_file

  def open_then_lose_it(path):
    fd = real_open(path)
    if not opened:
      os.remove(path)  # as a finishing run does
    opened.append(path)
    return fd
  monkeypatch.setattr(atomic_files, "open_lock_file", open_then_lose_it)
  run_folder.lock(str(tmp_path))
  try:
    assert len(opened) == 2 and names(tmp_path) == [run_folder.LOCK_FILE]
  finally:
    run_folder.release(str(tmp_path))


# --- training/logs.py ----------------------------------------------------------------------------------

@pytest.fixture
def info_logged():
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.INFO)
  yield
  logging.set_verbosity(verbosity)


def test_the_log_file_is_written_only_once_the_run_is_accepted(tmp_path, info_logged):
  path = tmp_path / logs.LOG_FILE
  path.write_text("earlier-start-lines\n")
  with pytest.raises(UserError):
    with logs.copied_to_file(str(path)):
      logging.info("checking the checkpoint")
      raise UserError("--resume: the checkpoint was written with design=dev")
  assert path.read_text() == "earlier-start-lines\n"
  with pytest.raises(UserError):
    with logs.copied_to_file(str(path)):
      logging.info("checking the checkpoint")
      logs.start_file_copy()
      logging.info("training")
      raise UserError("disk full")
  lines = path.read_text().splitlines()
  assert lines[0] == "earlier-start-lines" and lines[1].startswith("# ")
  assert lines[2].endswith("] checking the checkpoint") and lines[3].endswith("] training")
  assert lines[4:] == ["error: disk full"]


def test_a_log_file_planted_as_a_link_before_the_run_is_accepted_is_refused(tmp_path, victim, info_logged):
  plant(tmp_path / logs.LOG_FILE, victim)
  with pytest.raises(atomic_files.LinkError) as caught:
    with logs.copied_to_file(str(tmp_path / logs.LOG_FILE)):
      logging.info("line")
      logs.start_file_copy()
  assert_names(caught.value, logs.LOG_FILE, "symbolic link")
  logs.append_to_file(str(tmp_path / logs.LOG_FILE), "Run finished")  # a warning, not a write
  assert victim.read_bytes() == b"the user's own file\n"


def test_a_log_file_that_fills_the_disk_stops_with_one_warning(tmp_path, info_logged, caplog, monkeypatch):
  path = tmp_path / logs.LOG_FILE
  with logs.copied_to_file(str(path)):
    logs.start_file_copy()
    handler = python_logging.getLogger("absl").handlers[-1]

    class Full:
      def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

      def close(self):
        pass
    monkeypatch.setattr(handler, "stream", Full())
    with caplog.at_level("INFO", logger="absl"):
      logging.info("a line")
      logging.info("another")
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1, warnings
  assert_names(warnings[0], "cannot write %s" % path, "No space left")


# --- analysis/plots.py ---------------------------------------------------------------------------------

def test_a_figure_is_not_written_through_a_link(tmp_path, victim):
  from analysis import plots  # pylint: disable=import-outside-toplevel
  tmp_path = tmp_path / "predict"
  plant(tmp_path / plots.TRAINING_CURVES_PNG, victim)
  history = {"epoch": [1, 2], "loss": [1.0, 0.5], "val_loss": [1.1, 0.6], "lr": [1e-3, 1e-3],
             "source": "summary.yaml"}
  with pytest.raises(atomic_files.LinkError, match=plots.TRAINING_CURVES_PNG):
    plots.plot_training_curves(history, str(tmp_path))
  assert victim.read_bytes() == b"the user's own file\n" and names(tmp_path) == [plots.TRAINING_CURVES_PNG]


# --- training/checkpoints.py ---------------------------------------------------------------------------

def test_the_checkpoint_sweep_removes_planted_links_without_following_them(tmp_path):
  """Leftovers of killed saves (`.saving-*`, `checkpoint.tmp*`) are deleted after each save: a link
  planted at such a name, or inside such a folder, is removed, and what it points at stays."""
  from training import checkpoints  # pylint: disable=import-outside-toplevel
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "results.txt").write_text("the user's own results")
  folder = tmp_path / "checkpoints" / "last"
  plant(folder / ".saving-ckpt-2.abc", outside)
  plant(folder / ".saving-ckpt-3.def" / "inside", outside)
  plant(folder / "checkpoint.tmp123", outside / "results.txt")
  checkpoints._sweep(str(folder), kept=[])  # pylint: disable=protected-access
  assert names(folder) == [] and names(outside) == ["results.txt"]
  assert (outside / "results.txt").read_text() == "the user's own results"
