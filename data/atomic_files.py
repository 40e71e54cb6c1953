"""Files that appear whole or not at all: written under a hidden name unique to the process, then renamed.

Readers never see a partial file, and processes that write the same file at once do not collide (the
last rename wins, with the same content). Without TensorFlow, so the generator's modules can use it.
"""

import contextlib
import errno
import fcntl
import os
import re
import socket

import psutil


def temporary_name(path: str) -> str:
  """A hidden name next to `path`, unique to this process (host and pid: the folder may be shared
  between nodes), renamed to `path` once complete."""
  folder, name = os.path.split(path)
  return os.path.join(folder, ".%s.%s.%d.tmp" % (name, socket.gethostname(), os.getpid()))


def remove_stale(path: str) -> list:
  """Removes the temporaries of `path` that processes of this host left when they were killed before
  they could clean up (SIGKILL, the out-of-memory killer): a partial built-in dataset holds up to
  0.9 GB. Another host's are left alone, since whether its process lives cannot be seen from here.
  Returns the names removed."""
  folder, name = os.path.split(path)
  pattern = re.compile(r"\.%s\.%s\.(\d+)\.tmp$" % (re.escape(name), re.escape(socket.gethostname())))
  removed = []
  for entry in os.listdir(folder or "."):
    match = pattern.match(entry)
    if match and not psutil.pid_exists(int(match.group(1))):
      try:
        os.remove(os.path.join(folder, entry))
        removed.append(entry)
      except OSError:
        pass  # removed meanwhile by another run
  return removed


def write_text(path: str, text: str) -> None:
  """Writes `text` to `path` atomically; on any failure nothing is left behind."""
  tmp = temporary_name(path)
  try:
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def disk_full(error: BaseException) -> bool:
  """Whether a write failed for want of space. h5py 3.1 (the TensorFlow 2.6 stack's) leaves
  OSError.errno unset and names the cause only in its message."""
  return getattr(error, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(error)


@contextlib.contextmanager
def one_writer_at_a_time(path: str, on_wait):
  """Runs the block while this process alone holds `fcntl.flock` on `.<name>.lock` beside `path`. When
  another process holds it (two jobs on a host, the workers of one multi-worker run), `on_wait()` is
  called once and the block waits its turn; the kernel releases a killed holder's lock. Where the file
  system has no locks (some Lustre and NFS mounts: ENOLCK, ENOSYS, EOPNOTSUPP), the block runs
  unlocked: the renames still keep every reader's file whole. The empty lock file
  stays: removed, a process still waiting on it and a newcomer creating it afresh could both hold one."""
  folder, name = os.path.split(path)
  with open(os.path.join(folder, ".%s.lock" % name), "a") as handle:
    try:
      try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        on_wait()
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
    except OSError as error:
      if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
        raise
    yield
