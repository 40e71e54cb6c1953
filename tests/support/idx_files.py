"""Writes small IDX files (the MNIST format) for tests."""

import gzip
import os
import struct

import numpy as np


def write_idx(path: str, array: np.ndarray, compress: bool = False) -> str:
  array = np.ascontiguousarray(array, dtype=np.uint8)
  header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(">" + "i" * array.ndim, *array.shape)
  opener = gzip.open if compress else open
  with opener(path, "wb") as f:
    f.write(header + array.tobytes())
  return path


def write_mnist_folder(folder: str, train: tuple, test: tuple, compress: bool = False) -> str:
  """Writes the four MNIST IDX files for (images, labels) pairs into `folder`."""
  os.makedirs(folder, exist_ok=True)
  suffix = ".gz" if compress else ""
  for prefix, (images, labels) in (("train", train), ("t10k", test)):
    write_idx(os.path.join(folder, "%s-images-idx3-ubyte%s" % (prefix, suffix)), images, compress)
    write_idx(os.path.join(folder, "%s-labels-idx1-ubyte%s" % (prefix, suffix)), labels, compress)
  return folder
