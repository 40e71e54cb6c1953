"""What the checks before TensorFlow's start read, handed to the run's loader (data.FILE_CHECKS).

main.py and tools/predict.py validate the files that the flags name before TensorFlow's import; the
loader then opens the same files. A result kept here under the files' versions goes to the first
loader that asks for the same unchanged files, so that the validation is not done twice per run; a
file replaced or rewritten since has another version, and the loader reads it again.
"""

import os

_kept = {}


def versions(paths) -> tuple:
  """Each file's real path, inode, size and modification time (OSError for a missing one)."""
  found = []
  for path in paths:
    stat = os.stat(path)
    found.append((os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns))
  return tuple(found)


def keep(key, result) -> None:
  """Keeps `result` of a check for the next `take` of `key` (None: a key that could not be made)."""
  if key is not None:
    _kept[key] = result


def take(key, load):
  """The result kept under `key`, handed over once; else `load()`."""
  result = _kept.pop(key, None) if key is not None else None
  return result if result is not None else load()
