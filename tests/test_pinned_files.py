"""Input files held open from their check (data/pinned_files.py) and HDF5 files written without h5py's
crash (data/hdf5_writes.py), in process. The processes that meet them for real (a file truncated,
replaced or deleted under main.py, a file-size limit): tests/e2e/test_hostile_inputs.py."""

import errno
import os

import numpy as np
import pytest

from data import cellspike_file, hdf5_writes, pinned_files
from errors import UserError
from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import assert_names


def test_a_held_file_is_read_after_its_name_is_renamed_over_or_deleted(tmp_path):
  path = tmp_path / "cell.h5"
  path.write_bytes(b"checked")
  pin = pinned_files.PinnedFile.open(str(path))
  (tmp_path / "other").write_bytes(b"another file")
  os.replace(str(tmp_path / "other"), str(path))
  with open(pin.region, "rb") as held:  # as TensorFlow's ImmutableConst opens it
    assert held.read() == b"checked"
  assert_names(pin.moved(), "was replaced by", "another file")
  assert pin.change() is None
  os.remove(str(path))
  with open(pin.region, "rb") as held:
    assert held.read() == b"checked"
  assert pin.moved() == "was deleted"
  pin.close()


def test_h5py_opening_another_file_by_the_name_is_one_line(tmp_path):
  path = write_cellspike(str(tmp_path / "cell.h5"))
  pin = pinned_files.PinnedFile.open(path)
  with pin.opened() as f:
    assert "train_frames" in f
  os.replace(write_cellspike(str(tmp_path / "new.h5"), seed=5), path)
  with pytest.raises(UserError) as error:
    with pin.opened():
      pass
  assert_names(error.value, path, "replaced by another file", "while the run started")


def test_changes_are_checked_in_a_run_and_stop_it_once(tmp_path, monkeypatch):
  monkeypatch.setattr(pinned_files, "_reported", [])
  path = tmp_path / "cell.h5"
  path.write_bytes(b"0123456789")
  pin = pinned_files.PinnedFile.open(str(path))
  with pinned_files.watched_in_run():
    pinned_files.watch(pin)
    pinned_files.check_all()  # unchanged
    os.utime(str(path), ns=(pin.mtime_ns + 10**9, pin.mtime_ns + 10**9))
    with pytest.raises(pinned_files.InputChanged) as stop:
      pinned_files.check_all()
  assert stop.value.code == 1
  assert_names(stop.value.message, "was written to", "(its modification time")
  pinned_files.check_all()  # outside the run: its files are not looked at
  pin.close()


def test_a_fifo_or_a_folder_as_the_data_file_is_one_line_not_a_hang(tmp_path):
  fifo = tmp_path / "data.h5"
  os.mkfifo(str(fifo))
  with pytest.raises(UserError) as error:
    cellspike_file.open_cellspike(str(fifo))
  assert_names(error.value, str(fifo), "not a regular file")
  with pytest.raises(UserError) as error:
    pinned_files.PinnedFile.open(str(tmp_path / "missing.h5"))
  assert_names(error.value, str(tmp_path / "missing.h5"), "cannot be opened", "for reading")


def test_the_checked_file_is_held_by_what_the_check_returns(tmp_path):
  path = write_cellspike(str(tmp_path / "cell.h5"))
  with open(path, "rb") as f:
    content = f.read()
  info = cellspike_file.open_cellspike(path)
  os.remove(path)
  with open(info.pin.region, "rb") as held:
    assert held.read() == content and info.pin.size == len(content)


@pytest.mark.parametrize("code", [errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOSPC])
def test_a_failed_write_removes_the_file_and_closes_h5py(tmp_path, code):
  path = str(tmp_path / "new.h5")
  with pytest.raises(OSError) as failed:
    with hdf5_writes.created(path) as h5:
      h5.create_dataset("x", data=np.zeros((64, 16), np.float32))
      raise OSError(code, os.strerror(code))
  assert failed.value.errno == code and not os.path.exists(path)
  assert not h5.id.valid  # closed, in memory


def test_h5pys_message_of_a_failed_write_becomes_its_cause():
  message = ("Can't write data (file write failed: time = Sat Dec  5 08:49:05 2026\n, filename = 'x.tmp', "
             "file descriptor = 3, errno = 27, error message = 'File too large', buf = 0x7f)")
  plain = hdf5_writes.plain_error(OSError(message))  # h5py 3.1: no errno, the cause in the text
  assert (plain.errno, plain.strerror) == (errno.EFBIG, os.strerror(errno.EFBIG))
  assert str(hdf5_writes.plain_error(ValueError("no errno"))) == "no errno"


def test_a_file_larger_than_the_file_size_limit_is_refused_before_writing(monkeypatch):
  monkeypatch.setattr(hdf5_writes, "size_limit", lambda: 2 * 2**20)
  with pytest.raises(UserError, match="^--out_dir=x: ") as error:
    hdf5_writes.check_size_limit(3 * 2**20, "--out_dir=x: the dataset", "raise the limit")
  assert_names(error.value, "needs 3.1 MB", "at most 2.1 MB", "file-size limit", "ulimit -f")
  hdf5_writes.check_size_limit(2**20, "--out_dir=x: the dataset", "raise the limit")


def test_a_checked_file_deleted_before_the_loader_reads_it_is_one_line(tmp_path):
  path = write_cellspike(str(tmp_path / "cell.h5"))
  pin = pinned_files.PinnedFile.open(path)
  os.remove(path)
  with pytest.raises(UserError) as error:
    with pin.opened():
      pass
  assert_names(error.value, path, "was deleted", "while the run started", "after its check")
