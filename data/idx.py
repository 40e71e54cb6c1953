"""Reader for the IDX format of the original MNIST files (gzipped or not), with strict validation.

IDX: two zero bytes, a type code (0x08 = uint8), the number of dimensions, one big-endian int32 per
dimension, then the values in C order. Any deviation is a UserError naming the file.
"""

import gzip
import os
import zlib

import numpy as np

from errors import UserError

_UINT8 = 0x08


def _read_bytes(path: str) -> bytes:
  try:
    with open(path, "rb") as f:
      head = f.read(2)
      f.seek(0)
      opener = gzip.open(path, "rb") if head == b"\x1f\x8b" else f
      with opener as stream:
        return stream.read()
  except (OSError, EOFError, zlib.error) as error:
    raise UserError("%s: cannot read IDX data (%s)" % (path, error)) from None


def read_idx(path: str) -> np.ndarray:
  """Returns the array stored in IDX file `path`; a UserError if it is malformed or truncated."""
  raw = _read_bytes(path)
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
    raise UserError("%s: not an IDX file (expected a header starting with two zero bytes)" % path)
  if raw[2] != _UINT8:
    raise UserError("%s: IDX type code 0x%02x, expected 0x08 (unsigned bytes)" % (path, raw[2]))
  ndim = raw[3]
  header = 4 + 4 * ndim
  if ndim == 0 or len(raw) < header:
    raise UserError("%s: IDX header truncated (%d dimensions declared)" % (path, ndim))
  shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
  if min(shape) < 0:
    raise UserError("%s: IDX header declares dimensions %s, expected sizes of at least 0 (corrupt)"
                    % (path, shape))
  expected = int(np.prod(shape))
  found = len(raw) - header
  if found != expected:
    raise UserError("%s: IDX data holds %d bytes but its header %s declares %d (truncated or corrupt)"
                    % (path, found, shape, expected))
  return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def find_idx_file(folder: str, stem: str) -> str:
  """Finds `stem` in `folder` under the usual spellings (`-idx3-ubyte` or `.idx3-ubyte`, optional .gz)."""
  candidates = [stem, stem.replace("-idx", ".idx")]
  for name in candidates:
    for suffix in ("", ".gz"):
      path = os.path.join(folder, name + suffix)
      if os.path.isfile(path):
        return path
  raise UserError("--data_path=%s: missing MNIST file %s (or %s.gz)" % (folder, stem, stem))
