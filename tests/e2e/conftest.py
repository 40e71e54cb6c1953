"""Fixtures the end-to-end test files share."""

import pytest

from tests.support.cellspike_files import write_contiguous_folder


@pytest.fixture(scope="module")
def contiguous_data_file(tmp_path_factory):
  """A small cellSpike file stored contiguously, made once per test file (read in place: nothing is staged to
  /tmp, which a file-size limit would also stop)."""
  return write_contiguous_folder(str(tmp_path_factory.mktemp("data")))
