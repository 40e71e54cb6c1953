"""Output paths checked before a tool's work: a mistyped or unwritable path is one `error:` line at once, not a
traceback after minutes of work. Nothing is created here (host/atomic_files.py writes).
"""

import os

from errors import UserError


def check_output_path(flag: str, path: str, folder: bool = False, default: bool = False) -> None:
  """Before a tool's work: that `path`, given as `flag`, can be written -- a file in an existing folder,
  or with `folder` a folder (created with its parents if missing). A mistyped or unwritable path is
  then a UserError at once, not a traceback after the work is done. Nothing is created here.
  `default`: the user did not give `flag` and `path` is its default, which the error says (with how to
  choose another), instead of naming a flag the user never typed as if they had."""
  if not default:
    _check_writable("%s=%s" % (flag, path), path, folder)
    return
  try:
    _check_writable("the default %s=%s" % (flag, path), path, folder)
  except UserError as error:
    raise UserError("%s; pass %s=<a writable %s>" % (error, flag, "folder" if folder else "file")) from None


def _check_writable(given: str, path: str, folder: bool) -> None:
  """check_output_path's checks; `given` names the path in the errors."""
  if os.path.exists(path) and os.path.isdir(path) != folder:
    raise UserError("%s is a %s; expected %s" % (given, "folder" if os.path.isdir(path) else "file",
                                                 "a folder (created if missing)" if folder else "a file name"))
  if folder:  # the nearest existing folder: os.makedirs creates the rest below it
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
      existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
      raise UserError("%s: %s is not a folder, so no folder can be created below it" % (given, existing))
  else:  # open() creates no folder
    existing = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(existing):
      raise UserError("%s: %s; expected a file name in an existing folder" % (
          given, ("%s is not a folder" if os.path.exists(existing) else "no folder %s exists") % existing))
    if os.path.exists(path):
      existing = path
  if not os.access(existing, os.W_OK | (os.X_OK if os.path.isdir(existing) else 0)):
    raise UserError("%s: %s cannot be written (permission denied)" % (given, existing))
