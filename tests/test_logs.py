"""The log keeps the application's INFO lines and only warnings from the libraries (issue 19)."""

import logging as python_logging
import os

import tensorflow as tf

from training import logs


def _record(pathname, level):
  return python_logging.LogRecord("absl", level, pathname, 1, "message", (), None)


def test_library_info_is_dropped_and_warnings_kept():
  own_filter = logs._OwnInfoOnly()  # pylint: disable=protected-access
  library = os.path.join(os.path.dirname(tf.__file__), "python", "distribute", "cross_device_ops.py")
  assert not own_filter.filter(_record(library, python_logging.INFO))
  assert own_filter.filter(_record(library, python_logging.WARNING))
  assert own_filter.filter(_record(os.path.abspath(logs.__file__), python_logging.INFO))


def test_setup_installs_the_filter_once():
  logs.setup()
  logs.setup()
  from absl import logging  # pylint: disable=import-outside-toplevel
  handler = logging.get_absl_handler()
  assert sum(isinstance(f, logs._OwnInfoOnly) for f in handler.filters) == 1  # pylint: disable=protected-access
