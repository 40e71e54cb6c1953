"""Validation of cellSpike files on open: every malformation is one UserError naming file and key."""

import os

import h5py
import numpy as np
import pytest

from data import cellspike_file
from errors import UserError
from tests.cellspike_files import write_cellspike, write_meta_yaml


def _edit(path, key, data):
  with h5py.File(path, "a") as f:
    del f[key]
    if data is not None:
      f.create_dataset(key, data=data)


def test_reference_layout_opens(tmp_path):
  path = write_cellspike(str(tmp_path / "c.h5"), dtype=np.float16)
  info = cellspike_file.open_cellspike(path)
  assert info.input_shape == (1600, 4) and info.num_params == 15
  assert info.splits["train"].num_samples == 64 and info.splits["val"].dtype == np.float16
  assert info.meta == {"hand_made": True}


@pytest.mark.parametrize("key, data, message", [
    ("val_frames", None, "missing key 'val_frames'"),
    ("train_unitStar_par", np.zeros((64, 15, 1), np.float32), "'train_unitStar_par' has shape .* rank 2"),
    ("train_frames", np.zeros((64, 1600), np.float32), "'train_frames' has shape .* rank 3"),
    ("test_frames", np.zeros((31, 1600, 4), np.float32), "'test_frames' has 31 samples but "
                                                          "'test_unitStar_par' has 32"),
    ("val_frames", np.zeros((0, 1600, 4), np.float32), "val split is empty"),
    ("train_unitStar_par", np.full((64, 15), np.nan, np.float32), "'train_unitStar_par' contains NaN"),
    ("train_frames", np.zeros((64, 1600, 4), np.int16), "dtype int16, expected float16 or float32"),
    ("val_frames", np.zeros((32, 800, 4), np.float32), "splits disagree on frame shape"),
])
def test_malformed_files(tmp_path, key, data, message):
  path = write_cellspike(str(tmp_path / "c.h5"))
  if key == "val_frames" and data is not None and data.shape[0] == 0:
    _edit(path, "val_unitStar_par", np.zeros((0, 15), np.float32))
  _edit(path, key, data)
  with pytest.raises(UserError, match=message) as error:
    cellspike_file.open_cellspike(path)
  assert path in str(error.value)


def test_inf_in_the_middle_is_found(tmp_path):
  path = write_cellspike(str(tmp_path / "c.h5"), sizes={"train": 2000, "val": 8, "test": 8})
  with h5py.File(path, "a") as f:
    f["train_frames"][1000, 5, 2] = np.inf
  with pytest.raises(UserError, match="'train_frames' contains NaN or Inf"):
    cellspike_file.open_cellspike(path)


def test_truncated_and_non_hdf5_files(tmp_path):
  path = write_cellspike(str(tmp_path / "c.h5"))
  os.truncate(path, os.path.getsize(path) // 2)
  with pytest.raises(UserError, match="c.h5: not a readable HDF5 file"):
    cellspike_file.open_cellspike(path)
  text = tmp_path / "notes.h5"
  text.write_text("just text")
  with pytest.raises(UserError, match="notes.h5: not a readable HDF5 file"):
    cellspike_file.open_cellspike(str(text))


def test_folder_resolution_through_meta_yaml(tmp_path):
  write_meta_yaml(str(tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"))
  write_cellspike(str(tmp_path / "cellA_excite.cellSpike_4prB8kHz.data.h5"))
  path, info = cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  assert path.endswith("cellA_excite.cellSpike_4prB8kHz.data.h5")
  opened = cellspike_file.open_cellspike(path, info)
  assert opened.par_names[0] == "p0" and opened.meta["dataInfo"]["numPar"] == 15
  with pytest.raises(UserError, match="--cell_name is needed"):
    cellspike_file.resolve(str(tmp_path), None, "excite_4prB8kHz")
  with pytest.raises(UserError, match="cellB_excite.cellSpike_4prB8kHz.data.h5: no such file"):
    cellspike_file.resolve(str(tmp_path), "cellB", "excite_4prB8kHz")
  with pytest.raises(UserError, match="without meta.cellSpike_other.yaml"):
    cellspike_file.resolve(str(tmp_path), "cellA", "other")


def test_meta_yaml_problems(tmp_path):
  yaml_path = tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"
  write_cellspike(str(tmp_path / "cellA_excite.cellSpike_4prB8kHz.data.h5"))
  yaml_path.write_text("dataInfo: [unclosed")
  with pytest.raises(UserError, match="meta.cellSpike_excite_4prB8kHz.yaml: malformed YAML"):
    cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  yaml_path.write_text("dataInfo: {numFeature: 4}")
  with pytest.raises(UserError, match="dataInfo lacks h5nameTemplate, parName, numPar"):
    cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  write_meta_yaml(str(yaml_path), num_feature=3)
  path, info = cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  with pytest.raises(UserError, match="numFeature=3 but the frames have 4 probes"):
    cellspike_file.open_cellspike(path, info)


def test_implausibly_large_samples_are_refused_before_any_read(tmp_path):
  """A damaged header can claim terabyte rows; the NaN scan must not try to read them."""
  path = str(tmp_path / "huge_rows.h5")
  with h5py.File(path, "w") as f:
    for dom in ("train", "val", "test"):
      f.create_dataset(dom + "_frames", shape=(4, 10**6, 4), dtype=np.float32)   # never written
      f.create_dataset(dom + "_unitStar_par", data=np.zeros((4, 15), np.float32))
  with pytest.raises(UserError, match=r"train_frames' has shape \(4, 1000000, 4\): 16000000 bytes per sample"):
    cellspike_file.open_cellspike(path)
