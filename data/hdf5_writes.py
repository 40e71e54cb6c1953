"""New HDF5 files whose failed writes end in one line, not in h5py's crash: the generator's and staging's.

Where a write fails (a full disk, a quota, a read-only or failing file system, a file-size limit),
HDF5 still flushes its metadata and extends the file to its allocated end when the file is closed;
those writes fail too. h5py then reports the close's failure as further errors, and h5py 3.1 (the
TensorFlow 2.6 stack's) crashes with a segmentation fault when it frees the file's objects (exit 139).
So, on any failure inside `created`'s block, the partial file is removed first, then h5py's
descriptor is pointed at an anonymous in-memory file (memfd: ftruncate to the allocated end costs no
memory, nothing reaches the disk), with the soft file-size limit raised to the hard one, and the
file is closed there: the close succeeds, and the block's own error is raised.

A file-size limit (`ulimit -f`, RLIMIT_FSIZE, as batch systems set) is checked before anything is
written (`check_size_limit`): under it, a write past the limit fails with EFBIG (Python ignores
SIGXFSZ, whose default action would kill the process; spawned workers are Python processes too, and
write no files), and where the hard limit is as low as the soft one nothing can close the file past
it, not even in memory. Such a limit lowered (prlimit) below a file being written can still crash
h5py 3.1 at exit, after the one line, with the partial file removed.

Without TensorFlow, so the generator's modules can use it.
"""

import contextlib
import os
import re
import resource
import signal
import tempfile

import h5py

from errors import UserError

_SLACK_BYTES = 2**20   # HDF5's headers, attributes and the rounding of its allocations
_unclosable = []       # h5py files whose close failed: freeing them would crash h5py 3.1


def size_limit():
  """The soft file-size limit in bytes (None: unlimited)."""
  soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
  return None if soft == resource.RLIM_INFINITY else soft


def _size(count: int) -> str:
  return "%.2f GB" % (count / 1e9) if count >= 1e9 else "%.1f MB" % (count / 1e6)


def check_size_limit(needed: int, what: str, what_to_do: str) -> None:
  """A UserError when a file of `needed` bytes (its data and HDF5's headers: `with_headers`) cannot
  be written under this process's file-size limit; `what` names the file (and flag), `what_to_do`
  ends the line."""
  limit = size_limit()
  if limit is not None and needed > limit:
    raise UserError("%s needs %s, and this process may write files of at most %s (the file-size limit, "
                    "ulimit -f, as batch systems set): %s" % (what, _size(needed), _size(limit), what_to_do))


def with_headers(data_bytes: int) -> int:
  """The size of an HDF5 file holding `data_bytes` of contiguous data, at most."""
  return data_bytes + _SLACK_BYTES


def keep_file_size_signal_ignored() -> None:
  """Past the file-size limit a write gets EFBIG while SIGXFSZ is ignored (Python's start-up ignores
  it); an embedding that restored its default action would be killed at the write instead."""
  if hasattr(signal, "SIGXFSZ") and signal.getsignal(signal.SIGXFSZ) == signal.SIG_DFL:
    with contextlib.suppress(ValueError):  # not the main thread: leave it
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@contextlib.contextmanager
def created(path: str):
  """Yields a new h5py file at `path` (mode "x": created exclusively, never through a link). When the
  block ends, it is flushed and closed; if the block or the flush fails, the file is removed and closed
  without crashing h5py (module docstring), and the error raised. Opening errors are the caller's."""
  keep_file_size_signal_ignored()
  h5 = h5py.File(path, "x")
  try:
    yield h5
    h5.flush()  # the metadata's writes, while a failure can still be handled as the block's
  except BaseException:
    abandon(h5, path)
    raise
  try:
    h5.close()
  except BaseException:
    _unclosable.append(h5)
    with contextlib.suppress(OSError):
      os.remove(path)
    raise


def plain_error(error: BaseException) -> BaseException:
  """h5py's error of a failed write as the OSError of its cause (errno and the OS's words), for the
  one line; h5py's own text (several lines, with a time stamp and buffer addresses) is no use there.
  Anything without a recognisable errno is returned as it is."""
  found = re.search(r"errno = (\d+)", str(error))
  code = int(found.group(1)) if found else getattr(error, "errno", None)
  return OSError(code, os.strerror(code)) if code else error


def abandon(h5, path: str) -> None:
  """Removes `path` and closes its h5py file `h5` into memory (module docstring); never raises."""
  with contextlib.suppress(OSError):
    os.remove(path)
  limits = None
  try:
    descriptor = h5.id.get_vfd_handle()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limits[0] != limits[1]:
      resource.setrlimit(resource.RLIMIT_FSIZE, (limits[1], limits[1]))
    scratch = os.memfd_create("abandoned.h5") if hasattr(os, "memfd_create") else os.dup(
        tempfile.TemporaryFile().fileno())
    try:
      os.dup2(scratch, descriptor)
    finally:
      os.close(scratch)
  except (OSError, ValueError, AttributeError):
    pass  # closed where it is: the close may fail, and is then kept from h5py's crash below
  try:
    h5.close()
  except Exception:  # pylint: disable=broad-except
    _unclosable.append(h5)
  finally:
    if limits is not None and limits[0] != limits[1]:
      with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
