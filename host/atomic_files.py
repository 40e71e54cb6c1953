"""Files that appear whole or not at all, written without following links: the one place for writes.

Every file the application writes into a run folder, a cache, a staging folder or an output folder
goes through here. Such folders may be shared (a project space writable by the group, /tmp): whoever
can create names there could plant a link at a name the application writes, to make it overwrite a
file of the user's elsewhere, and a full disk or a file-size limit can cut any write short. So:

- A new file is written under a hidden temporary name unique to the process and unguessable
  (`.<name>.<host>.<pid>.<random>.tmp`), created with O_CREAT|O_EXCL|O_NOFOLLOW (never an existing
  file, never through a link), fsynced, then renamed over the name (a rename replaces a link; it
  never writes through one). Readers never see a partial file, and processes that write the same
  file at once do not collide (the last rename wins).
- A file that is added to (a log) or locked is opened with O_NOFOLLOW, and must be a regular file.
- A link found where a file is expected is a `LinkError` naming it; nothing is written through it.
- A failed write (ENOSPC, EFBIG, EDQUOT, EROFS, EIO, EACCES, EPERM) is a `WriteError` naming the file
  and the cause, the temporary removed: the file keeps its earlier content, if it had any.
Both are UserErrors (one `error:` line) and OSErrors (code that catches OSError still does).

The functions:
  temporary_name(path)          a fresh hidden name beside `path` (the file is not created: create it
                                exclusively, as h5py's mode "x" or `create_new` does)
  create_new(path, mode)        opens a file that does not exist yet, exclusively, not through a link
  replaced(path, mode)          context manager: a file object whose content replaces `path` on success
  write_text(path, text), write_bytes(path, data)   replaced() in one call
  open_append(path), append_text(path, text)        a log's appends (O_APPEND|O_NOFOLLOW)
  open_lock_file(path)          a lock file's descriptor (O_RDWR|O_CREAT|O_NOFOLLOW), regular only
  refuse_link(path)             a LinkError if `path` is a link (or another non-file where a file goes)
  staged_files(folder)          context manager: a private folder inside `folder` for a set of files
                                that are moved into `folder` together once all are written
  check_writable_folder(folder) a probe file created and removed (no fixed name to plant a link at)
  write_error(path, error), is_write_error(error), disk_full(error)   failures as one line
  remove_stale(path)            the temporaries of `path` that killed processes of this host left
  one_writer_at_a_time(path, on_wait)  an flock on `.<name>.lock` beside `path` for a block
Without TensorFlow, so the generator's modules can use it.
"""

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import tempfile

import psutil

from errors import UserError

# Failures of a write that the user's storage causes, reported as one line (not a bug's traceback).
WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM)
_HINTS = {
    errno.ENOSPC: "free space there or choose another folder",
    errno.EDQUOT: "the disk quota is used up: free space there or choose another folder",
    errno.EFBIG: "the file-size limit (ulimit -f, as batch systems set) is too small for it",
    errno.EROFS: "the file system is read-only: choose another folder",
    errno.EIO: "the storage reported an input/output error",
    errno.EACCES: "choose a folder you can write to",
    errno.EPERM: "choose a folder you can write to",
}
_NEW_FILE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class WriteError(UserError, OSError):
  """A file could not be written (`path`, the OS's cause); nothing partial is left of it."""

  def __init__(self, message: str, code: int, path: str, cause: str = None):
    OSError.__init__(self, code, cause or (os.strerror(code) if code else message), path)
    self.message, self.path = message, path

  def __str__(self):
    return self.message


class LinkError(WriteError):
  """A link (or a folder, a FIFO...) where the application writes a file; nothing was written through it."""


class _Passed(Exception):
  """Carries an error of a `replaced` block's own past the conversion of the write's errors."""

  def __init__(self, error):
    super().__init__(error)
    self.error = error


def _hidden_stem(name: str) -> str:
  return name[:150]  # the temporary's name within NAME_MAX (255) with its suffixes


def temporary_name(path: str) -> str:
  """A hidden name next to `path`, unique to this process (host and pid: the folder may be shared
  between nodes) and unguessable (random), renamed to `path` once complete. Not created: create it
  with O_EXCL (create_new; h5py's mode "x"), which fails rather than follow a link planted there."""
  folder, name = os.path.split(path)
  return os.path.join(folder, ".%s.%s.%d.%s.tmp" % (_hidden_stem(name), socket.gethostname(), os.getpid(),
                                                    os.urandom(4).hex()))


def remove_stale(path: str) -> list:
  """Removes the temporaries of `path` that processes of this host left when they were killed before
  they could clean up (SIGKILL, the out-of-memory killer): a partial built-in dataset holds up to
  0.9 GB. Another host's are left alone, since whether its process lives cannot be seen from here.
  Returns the names removed."""
  folder, name = os.path.split(path)
  pattern = re.compile(r"\.%s\.%s\.(\d+)(\.[0-9a-f]+)?\.tmp$" % (re.escape(_hidden_stem(name)),
                                                                 re.escape(socket.gethostname())))
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


def is_write_error(error: BaseException) -> bool:
  """Whether `error` is a write failure the storage caused (WRITE_ERRNOS). h5py 3.1 and TensorFlow
  name the cause only in their message."""
  if isinstance(error, WriteError):
    return True
  if getattr(error, "errno", None) in WRITE_ERRNOS:
    return True
  text = str(getattr(error, "message", "") or error)
  return any(os.strerror(code) in text for code in WRITE_ERRNOS)


def _code_of(error: BaseException) -> int:
  code = getattr(error, "errno", None)
  if code:
    return code
  text = str(getattr(error, "message", "") or error)
  return next((code for code in WRITE_ERRNOS if os.strerror(code) in text), errno.EIO)


def write_error(path: str, error: BaseException) -> WriteError:
  """The one-line error for a failed write of `path` (an OSError, or a library's error naming the
  cause): the file, the cause and what to do."""
  if isinstance(error, WriteError):
    return error
  code = _code_of(error)
  if isinstance(error, OSError) and error.strerror:
    cause = error.strerror
  elif code in WRITE_ERRNOS or not str(error):
    cause = os.strerror(code)
  else:
    cause = " ".join(str(error).split())[:200]
  hint = _HINTS.get(code)
  return WriteError("cannot write %s (%s)%s" % (path, cause, ": " + hint if hint else ""), code, path, cause)


def disk_full(error: BaseException) -> bool:
  """Whether a write failed for want of space. h5py 3.1 (the TensorFlow 2.6 stack's) leaves
  OSError.errno unset and names the cause only in its message."""
  return getattr(error, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(error)


def _link_error(path: str, what: str, folder: bool = False) -> LinkError:
  return LinkError("%s is %s, where %s; nothing was written through it: remove it (was it planted by "
                   "someone else?) or choose another folder" % (
                       path, what, "files are written into a folder" if folder else "a file is written"),
                   errno.ELOOP, path, "is %s" % what)


def _kind(mode: int) -> str:
  if stat.S_ISLNK(mode):
    return "a symbolic link"
  if stat.S_ISDIR(mode):
    return "a folder"
  if stat.S_ISFIFO(mode):
    return "a FIFO"
  if stat.S_ISSOCK(mode):
    return "a socket"
  return "a device"


def refuse_link(path: str, folder: bool = False) -> None:
  """A LinkError naming `path` if a link (or anything but a regular file: a FIFO would block a write)
  is there; nothing there is fine. With `folder`, only a link is refused (whatever else is there, the
  folder's creation says so)."""
  try:
    mode = os.lstat(path).st_mode
  except FileNotFoundError:
    return
  except OSError as error:
    raise write_error(path, error) from None
  if stat.S_ISREG(mode) or folder and not stat.S_ISLNK(mode):
    return
  raise _link_error(path, _kind(mode), folder)


def _fsync(fd: int) -> None:
  """fsync, where the file system has it (some FUSE and network mounts answer EINVAL or ENOTSUP)."""
  try:
    os.fsync(fd)
  except OSError as error:
    if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
      raise


def _fsync_folder(folder: str) -> None:
  """Makes a rename in `folder` survive a crash of the node (where the file system can say so)."""
  try:
    fd = os.open(folder or ".", os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass  # folders that cannot be fsynced (EINVAL, EBADF): the rename stands all the same
  finally:
    os.close(fd)


def create_new(path: str, mode: str = "wb", encoding: str = None):
  """Opens `path`, which must not exist, for writing: created exclusively, never through a link (a
  name planted there is an error, not followed). Permissions as open() gives (0666 less the umask)."""
  try:
    fd = os.open(path, _NEW_FILE | os.O_WRONLY, 0o666)
  except FileExistsError:
    if os.path.islink(path):
      raise _link_error(path, "a symbolic link") from None
    raise
  except OSError as error:
    raise write_error(path, error) from None
  return os.fdopen(fd, mode, encoding=encoding if "b" not in mode else None)


@contextlib.contextmanager
def replaced(path: str, mode: str = "w", encoding: str = "utf-8"):
  """Yields a file object (text by default, "wb" for bytes) whose content replaces `path` when the
  block ends: written to a fresh temporary beside it, fsynced, renamed over `path`. A link at `path`
  is a LinkError before anything is written; a failed write a WriteError naming `path`, with the
  temporary removed and `path` as it was."""
  refuse_link(path)
  temporary = None
  try:
    for _ in range(5):  # a fresh random name each time: one taken meanwhile is never reused
      candidate = temporary_name(path)
      try:
        fd = os.open(candidate, _NEW_FILE | os.O_WRONLY, 0o666)
      except FileExistsError:
        continue
      temporary = candidate
      break
    else:
      raise OSError(errno.EEXIST, "no fresh temporary name", path)
    with os.fdopen(fd, mode, encoding=encoding if "b" not in mode else None) as handle:
      try:
        yield handle
      except OSError as error:
        if not is_write_error(error):
          raise _Passed(error) from error  # the block's own failure (a file it read), not the write's
        raise
      handle.flush()
      _fsync(handle.fileno())
    refuse_link(path)  # planted while it was written: replaced by the rename, but said
    os.replace(temporary, path)
    temporary = None
    _fsync_folder(os.path.dirname(path))
  except _Passed as passed:
    raise passed.error from passed.error.__cause__
  except OSError as error:
    raise write_error(path, error) from None
  finally:
    if temporary is not None:
      with contextlib.suppress(OSError):
        os.remove(temporary)


def write_text(path: str, text: str) -> None:
  """Writes `text` to `path` atomically (replaced); on any failure nothing is left behind."""
  with replaced(path) as handle:
    handle.write(text)


def write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path` atomically (replaced); on any failure nothing is left behind."""
  with replaced(path, "wb") as handle:
    handle.write(data)


def _open_regular(path: str, flags: int, mode: int = 0o666) -> int:
  """A descriptor of the regular file `path` (O_NOFOLLOW, O_NONBLOCK so that a FIFO planted there
  cannot block the open); a LinkError for a link or anything else that is not a regular file."""
  try:
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
  except OSError as error:
    if error.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR) or os.path.islink(path):
      raise _link_error(path, _kind(os.lstat(path).st_mode) if os.path.lexists(path) else "a link") from None
    raise write_error(path, error) from None
  try:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      raise _link_error(path, _kind(mode))
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
  except BaseException:
    os.close(fd)
    raise
  return fd


def open_append(path: str, encoding: str = "utf-8"):
  """A text file object that appends to `path` (created if missing), never through a link."""
  return os.fdopen(_open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding=encoding)


def append_text(path: str, text: str) -> None:
  """Appends `text` to `path` (created if missing), never through a link; a WriteError on failure."""
  try:
    with open_append(path) as handle:
      handle.write(text)
  except WriteError:
    raise
  except OSError as error:
    raise write_error(path, error) from None


def open_lock_file(path: str) -> int:
  """A read-write descriptor of the lock file `path` (created if missing, kept if there), never through
  a link."""
  return _open_regular(path, os.O_RDWR | os.O_CREAT)


def check_writable_folder(folder: str) -> None:
  """Creates and removes a probe file in `folder`: an OSError if nothing can be written there. The
  probe's name is fresh (no fixed name that a link could be planted at)."""
  probe = temporary_name(os.path.join(folder, "write-test"))
  create_new(probe).close()
  os.remove(probe)


@contextlib.contextmanager
def staged_files(folder: str):
  """Yields a fresh private folder inside `folder` (mode 0700: nobody else can plant names in it) to
  write a set of files into. When the block ends, each file is moved into `folder` over its name (a
  link there is a LinkError); if the block fails, the private folder is removed and `folder` keeps
  what it held: a set of files appears whole, never a mix of an old set and part of a new one. A
  WriteError inside names the file by its name in `folder`."""
  try:
    staging = tempfile.mkdtemp(prefix=".writing-", dir=folder)
  except OSError as error:
    raise write_error(folder, error) from None
  try:
    try:
      yield staging
    except WriteError as error:
      if error.path and os.path.dirname(error.path) == staging:
        final = os.path.join(folder, os.path.basename(error.path))
        raise type(error)(error.message.replace(error.path, final), error.errno, final, error.strerror) \
            from None
      raise
    names = sorted(os.listdir(staging))
    for name in names:
      refuse_link(os.path.join(folder, name))
    for name in names:
      os.replace(os.path.join(staging, name), os.path.join(folder, name))
    _fsync_folder(folder)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def one_writer_at_a_time(path: str, on_wait):
  """Runs the block while this process alone holds `fcntl.flock` on `.<name>.lock` beside `path`. When
  another process holds it (two jobs on a host, the workers of one multi-worker run), `on_wait()` is
  called once and the block waits its turn; the kernel releases a killed holder's lock. Where the file
  system has no locks (some Lustre and NFS mounts: ENOLCK, ENOSYS, EOPNOTSUPP), the block runs
  unlocked: the renames still keep every reader's file whole. The empty lock file
  stays: removed, a process still waiting on it and a newcomer creating it afresh could both hold one.
  A link planted at the lock file's name is a LinkError (it is opened with O_NOFOLLOW)."""
  folder, name = os.path.split(path)
  with os.fdopen(open_lock_file(os.path.join(folder, ".%s.lock" % name)), "r+b") as handle:
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
