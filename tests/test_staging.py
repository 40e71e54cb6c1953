"""Node-local staging (--stage_dir, data/staging.py): each process's rows copied once, checked, reused."""

import errno
import logging
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from data import cellspike, staging
from data.splits import BatchLayout
from errors import UserError
from run_config import RunConfig
from tests.support.cellspike_files import write_row_marked
from tests.support.helpers import assert_names, line_naming

KEYS = ("train_frames", "train_unitStar_par")


def _config(path, stage_dir, **kwargs):
  return RunConfig(model="neuron_inverter", data_path=str(path), batch_size=4, read_chunk=8,
                   shuffle_buffer=16, seed=1, stage_dir=str(stage_dir), **kwargs)


def _rows(split):
  return sorted(int(row) for frames, _ in split.dataset for row in frames.numpy()[:, 0, 0])


def _staged_files(stage_dir):
  return sorted(name for name in os.listdir(stage_dir) if name.endswith(".h5"))


def test_each_process_stages_only_its_rows_and_reads_the_same_batches(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  stage = tmp_path / "local"
  layout = BatchLayout(2, 4, first_shard=2, num_shards=4)   # the second of two processes
  staged = cellspike.load(_config(path, stage), layout)
  direct = cellspike.load(RunConfig(model="neuron_inverter", data_path=path, batch_size=4, read_chunk=8,
                                    shuffle_buffer=16, seed=1), layout)
  assert _rows(staged.train) == _rows(direct.train) == list(range(32, 64))
  names = _staged_files(stage)
  assert len(names) == 3 and any(".rows32-64." in name for name in names)  # train, val, test
  with h5py.File(os.path.join(stage, [n for n in names if ".rows32-64." in n][0]), "r") as copy:
    assert copy["train_frames"].shape[0] == 32 and copy["train_frames"][0, 0, 0] == 32


def test_a_later_run_reuses_the_copy_and_a_changed_source_is_staged_again(tmp_path, caplog):
  caplog.set_level(logging.INFO, logger="absl")
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  stage = str(tmp_path / "local")
  first = staging.stage_to(path, KEYS, 0, 32, stage)
  written = os.stat(first).st_mtime_ns
  assert "staged rows 0-32" in caplog.text and "MB/s" in caplog.text
  assert staging.stage_to(path, KEYS, 0, 32, stage) == first
  assert os.stat(first).st_mtime_ns == written
  assert "rows 0-32" in line_naming(caplog.text, "reusing")

  with h5py.File(path, "r+") as source:   # the source changes: new data (and modification time)
    source["train_frames"][5] = -1.0
  os.utime(path, ns=(written + 10**9, written + 10**9))
  caplog.clear()
  assert staging.stage_to(path, KEYS, 0, 32, stage) == first
  assert "source file changed" in line_naming(caplog.text, "staging again")
  with h5py.File(first, "r") as copy:
    assert copy["train_frames"][5, 0, 0] == -1.0


def test_a_changed_file_behind_an_external_link_is_staged_again(tmp_path, caplog):
  """The copy's stamp was the outer file's alone: replacing the linked file left training on old rows."""
  caplog.set_level(logging.INFO, logger="absl")
  inner = write_row_marked(str(tmp_path / "inner.h5"), n_train=64)
  with h5py.File(inner, "r") as source, h5py.File(str(tmp_path / "outer.h5"), "w") as outer:
    for key in source:
      outer[key] = h5py.ExternalLink("inner.h5", key)
  stage = str(tmp_path / "local")
  first = staging.stage_to(str(tmp_path / "outer.h5"), KEYS, 0, 32, stage)
  written = os.stat(inner).st_mtime_ns
  with h5py.File(inner, "r+") as source:
    source["train_frames"][5] = -1.0
  os.utime(inner, ns=(written + 10**9, written + 10**9))
  caplog.clear()
  assert staging.stage_to(str(tmp_path / "outer.h5"), KEYS, 0, 32, stage) == first
  assert "source file changed" in line_naming(caplog.text, "staging again")
  with h5py.File(first, "r") as copy:
    assert copy["train_frames"][5, 0, 0] == -1.0


def test_a_damaged_copy_is_detected_by_its_checksum_and_replaced(tmp_path, caplog):
  caplog.set_level(logging.INFO, logger="absl")
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  stage = str(tmp_path / "local")
  staged = staging.stage_to(path, KEYS, 0, 32, stage)
  with h5py.File(staged, "r+") as copy:
    copy["train_frames"][3] = 99.0
  staging.stage_to(path, KEYS, 0, 32, stage)
  assert "match its checksum" in caplog.text
  with h5py.File(staged, "r") as copy:
    np.testing.assert_array_equal(copy["train_frames"][3], np.full((16, 4), 3.0))
  assert not [name for name in os.listdir(stage) if name.endswith(".tmp")]  # nothing left over


def test_a_full_staging_disk_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  stage = tmp_path / "local"
  monkeypatch.setattr(staging, "_free_bytes", lambda folder: 1000)
  with pytest.raises(UserError) as caught:
    staging.stage_to(path, KEYS, 0, 32, str(stage))
  assert_names(caught.value, "needs 0.0 MB", "local has 0.0 MB free", "--stage_dir")
  assert os.listdir(stage) == []


def test_running_out_of_space_during_the_copy_is_one_clear_error(tmp_path, monkeypatch):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  stage = tmp_path / "local"

  def full_disk(*args):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(staging, "_copy_rows", full_disk)
  with pytest.raises(UserError) as caught:
    staging.stage_to(path, KEYS, 0, 32, str(stage))
  assert_names(caught.value, "ran out of space", "train_frames/train_unitStar_par")
  assert os.listdir(stage) == []


def test_an_unwritable_stage_dir_names_what_to_do(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(UserError) as caught:
    staging.stage_to(path, KEYS, 0, 32, str(blocker / "local"))
  assert_names(caught.value, "--stage_dir=", "a_file/local", "Not a directory", "process can write")


def test_temporary_copies_of_killed_processes_are_removed_by_the_next_run(tmp_path, monkeypatch, caplog):
  """SIGKILL skips atexit: the next run on the host removes the copies whose process is gone."""
  monkeypatch.setattr(staging.tempfile, "tempdir", str(tmp_path))
  path = write_row_marked(str(tmp_path / "chunked.h5"), 64, chunks=(8, 16, 4))
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  orphan = tmp_path / ("%s%d-abc" % (staging._host_prefix(), dead.pid))  # pylint: disable=protected-access
  live = tmp_path / ("%s%d-abc" % (staging._host_prefix(), os.getppid()))  # pylint: disable=protected-access
  other_host = tmp_path / ("cellspike-stage-elsewhere-%d-abc" % dead.pid)
  for folder in (orphan, live, other_host):
    folder.mkdir()
  with caplog.at_level(logging.INFO, logger="absl"):
    staged = staging.stage_rows(path, ("train_frames",), 0, 64)
  assert not orphan.exists() and live.exists() and other_host.exists()
  assert "process that was killed" in caplog.text
  own = "%s%d-" % (staging._host_prefix(), os.getpid())  # pylint: disable=protected-access
  assert os.path.dirname(os.path.dirname(staged)) == str(tmp_path)
  assert os.path.basename(os.path.dirname(staged)).startswith(own)


@pytest.mark.parametrize("code, cause", [(errno.EFBIG, "File too large"), (errno.EDQUOT, "Disk quota exceeded"),
                                         (errno.EROFS, "Read-only file system"), (errno.EIO, "Input/output error")])
def test_a_copy_that_cannot_be_written_is_one_line_with_its_cause(tmp_path, monkeypatch, code, cause):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  stage = tmp_path / "local"

  def failing(*args):
    raise OSError(code, os.strerror(code))
  monkeypatch.setattr(staging, "_copy_rows", failing)
  with pytest.raises(UserError) as caught:
    staging.stage_to(path, KEYS, 0, 32, str(stage))
  assert_names(caught.value, "local: ", "train_frames/train_unitStar_par", "rows.h5", "cannot write", "local/rows.",
               ".rows0-32.h5 (%s)" % cause)
  assert os.listdir(stage) == []


def test_a_copy_larger_than_the_file_size_limit_is_refused_before_copying(tmp_path, monkeypatch):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  stage = tmp_path / "local"
  monkeypatch.setattr(staging.hdf5_writes, "size_limit", lambda: 4096)
  with pytest.raises(UserError) as caught:
    staging.stage_to(path, KEYS, 0, 32, str(stage))
  assert_names(caught.value, "rows.h5: ", "train_frames/train_unitStar_par", "needs 1.1 MB", "at most 0.0 MB",
               "file-size limit")
  assert os.listdir(stage) == []


def test_the_staged_copy_is_read_from_the_source_checked(tmp_path):
  """The rows copied are those of the file the run checked and holds open, not of a file renamed over
  its name since."""
  from data import pinned_files  # pylint: disable=import-outside-toplevel
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  source = pinned_files.PinnedFile.open(path)
  os.replace(write_row_marked(str(tmp_path / "other.h5"), n_train=64), path)
  with pytest.raises(UserError, match="rows.h5 was replaced"):
    staging.stage_to(path, KEYS, 0, 32, str(tmp_path / "local"), source=source)
