"""Files that appear whole or not at all: written under a hidden name unique to the process, then renamed.

Readers never see a partial file, and processes that write the same file at once do not collide (the
last rename wins, with the same content). Plain Python, so the generator's modules can use it without
TensorFlow.
"""

import os


def temporary_name(path: str) -> str:
  """A hidden name next to `path`, unique to this process, renamed to `path` once complete."""
  folder, name = os.path.split(path)
  return os.path.join(folder, ".%s.%d.tmp" % (name, os.getpid()))


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
