"""The application's log: its own INFO lines, and only warnings and errors from the libraries.

TensorFlow and Keras log at INFO through the same absl logger as the application, some of it once per
call: MirroredStrategy's "Reduce to ... then broadcast to" for every all-reduce it builds, the
checkpoint saver's "Sharding callback duration", TensorBoard's directory watcher. A user reads those
as noise between the epoch lines. Warnings and errors from anywhere still show.
"""

import logging as python_logging
import os

from absl import logging

_APP_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class _OwnInfoOnly(python_logging.Filter):
  """Passes records of WARNING and above, and records logged from this application's own files."""

  def filter(self, record):
    return record.levelno >= python_logging.WARNING or os.path.abspath(record.pathname).startswith(
        _APP_ROOT) and os.sep + "site-packages" + os.sep not in record.pathname


def setup() -> None:
  """INFO for the application, WARNING for the libraries; call once at start-up."""
  logging.set_verbosity(logging.INFO)
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _OwnInfoOnly) for f in handler.filters):
    handler.addFilter(_OwnInfoOnly())
