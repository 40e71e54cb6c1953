"""The IDX reader: round trips, and every malformation is a UserError naming the file."""

import gzip
import os

import numpy as np
import pytest

from data import idx
from errors import UserError
from tests.support.helpers import assert_names
from tests.support.idx_files import write_idx


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(tmp_path, compress):
  images = np.random.RandomState(0).randint(0, 256, size=(7, 28, 28)).astype(np.uint8)
  path = write_idx(str(tmp_path / "x-idx3-ubyte"), images, compress)
  np.testing.assert_array_equal(idx.read_idx(path), images)


def test_truncated_file_is_reported_with_sizes(tmp_path):
  path = write_idx(str(tmp_path / "x-idx3-ubyte"), np.zeros((5, 28, 28)))
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 100)
  with pytest.raises(UserError) as caught:
    idx.read_idx(path)
  assert_names(caught.value, "x-idx3-ubyte: ", "3820 bytes", "3920")


def test_truncated_gzip_is_reported(tmp_path):
  path = write_idx(str(tmp_path / "x.gz"), np.zeros((50, 28, 28)), compress=True)
  raw = open(path, "rb").read()
  open(path, "wb").write(raw[: len(raw) // 2])
  with pytest.raises(UserError, match="x.gz: cannot read"):
    idx.read_idx(path)


def test_not_idx(tmp_path):
  path = tmp_path / "junk"
  path.write_bytes(b"hello world, not an idx file")
  with pytest.raises(UserError, match="junk: not an IDX file"):
    idx.read_idx(str(path))


def test_negative_dimensions_are_reported(tmp_path):
  """(-100, -28, 28) multiplies to the right byte count: numpy's reshape then raised a ValueError."""
  path = tmp_path / "negative"
  dims = b"".join(d.to_bytes(4, "big", signed=True) for d in (-100, -28, 28))
  path.write_bytes(bytes([0, 0, 0x08, 3]) + dims + b"\0" * (100 * 28 * 28))
  with pytest.raises(UserError) as caught:
    idx.read_idx(str(path))
  assert_names(caught.value, "negative: ", "dimensions", "(-100, -28, 28)")


def test_wrong_type_code(tmp_path):
  path = tmp_path / "floats"
  path.write_bytes(bytes([0, 0, 0x0D, 1]) + (4).to_bytes(4, "big") + b"\0" * 16)
  with pytest.raises(UserError, match="type code 0x0d"):
    idx.read_idx(str(path))


def test_find_idx_file_accepts_both_spellings_and_gzip(tmp_path):
  (tmp_path / "train-images.idx3-ubyte.gz").write_bytes(gzip.compress(b""))
  assert idx.find_idx_file(str(tmp_path), "train-images-idx3-ubyte").endswith(".idx3-ubyte.gz")
  with pytest.raises(UserError, match="t10k-labels-idx1-ubyte"):
    idx.find_idx_file(str(tmp_path), "t10k-labels-idx1-ubyte")
