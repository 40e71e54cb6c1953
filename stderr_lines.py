"""Known lines that native code writes straight to file descriptor 2, dropped from what a user reads.

absl's Python logging can be filtered by level and source (training/logs.py), but TensorFlow's C++
core writes to the process's stderr itself, below Python. `DroppedLines` sends descriptor 2 to a
temporary file for a window and, when the window closes, writes everything back to stderr in order,
without the lines that contain one of its patterns. Closing is idempotent and also happens when the
block raises, so nothing but those lines is lost. A process killed inside a window loses that
window's lines: the windows are kept short (TensorFlow's import, a first step, a validation). A
terminal that closes during a window (a hang-up, SIGHUP) gets nothing back: descriptor 2 then writes to
/dev/null (stop_signals.leave_a_closed_terminal, as SIGHUP's handler does outside windows), since every
write to it would fail (EIO) and end the run before the stop that the hang-up asks for.
"""

import os
import sys
import tempfile

from stop_signals import leave_a_closed_terminal


class DroppedLines:
  """A window, opened by `start()` (or `with`) and closed by `stop()`, in which lines containing any
  of `patterns` never reach stderr."""

  def __init__(self, patterns):
    self.patterns = tuple(patterns)
    self._saved = None
    self._capture = None
    self._terminal = False

  def start(self) -> None:
    if self._saved is not None:
      return
    sys.stderr.flush()
    self._capture = tempfile.TemporaryFile()
    self._saved = os.dup(2)
    self._terminal = os.isatty(self._saved)
    os.dup2(self._capture.fileno(), 2)

  def stop(self) -> None:
    if self._saved is None:
      return
    sys.stderr.flush()
    os.dup2(self._saved, 2)
    os.close(self._saved)
    hung_up = self._terminal and not os.isatty(2)
    if hung_up:
      leave_a_closed_terminal([2])
    self._saved = None
    with self._capture:
      self._capture.seek(0)
      lines = self._capture.read().decode("utf-8", "replace").splitlines(True)
    if not hung_up:
      sys.stderr.write("".join(line for line in lines if not any(p in line for p in self.patterns)))
      sys.stderr.flush()

  def __enter__(self):
    self.start()
    return self

  def __exit__(self, *exc_info):
    self.stop()
    return False
