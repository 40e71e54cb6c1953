"""The one exception type that the application reports as a plain one-line error.

Anything a user can cause (a bad flag combination, a missing or malformed data file, a backend that is
not installed) is raised as `UserError` with a message naming the flag, file or key and what was
expected. `main.py` prints it on one line and exits non-zero; any other exception is a bug and keeps
its traceback.
"""


class UserError(Exception):
  """A problem with the user's input or environment, reported without a traceback."""
