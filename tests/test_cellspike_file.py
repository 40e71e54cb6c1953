"""Validation of cellSpike files on open: every malformation is one UserError naming file and key."""

import json
import os

import h5py
import numpy as np
import pytest
import yaml

from data import cellspike_file
from errors import UserError
from run_config import RunConfig
from tests.support.cellspike_files import write_cellspike, write_meta_yaml
from tests.support.helpers import assert_names


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


@pytest.mark.parametrize("key, data, names", [
    ("val_frames", None, ["missing key", "'val_frames'"]),
    ("train_unitStar_par", np.zeros((64, 15, 1), np.float32), ["'train_unitStar_par'", "(64, 15, 1)", "rank 2"]),
    ("train_frames", np.zeros((64, 1600), np.float32), ["'train_frames'", "(64, 1600)", "rank 3"]),
    ("test_frames", np.zeros((31, 1600, 4), np.float32), ["'test_frames' has 31", "'test_unitStar_par'", "has 32"]),
    ("val_frames", np.zeros((0, 1600, 4), np.float32), ["val split", "empty"]),
    ("train_unitStar_par", np.full((64, 15), np.nan, np.float32), ["'train_unitStar_par'", "NaN"]),
    ("train_frames", np.zeros((64, 1600, 4), np.int16), ["'train_frames'", "int16", "float16 or float32"]),
    ("val_frames", np.ones((32, 800, 4), np.float32), ["splits disagree", "frame shape"]),  # zeros: not written
])
def test_malformed_files(tmp_path, key, data, names):
  path = write_cellspike(str(tmp_path / "c.h5"))
  if key == "val_frames" and data is not None and data.shape[0] == 0:
    _edit(path, "val_unitStar_par", np.zeros((0, 15), np.float32))
  _edit(path, key, data)
  with pytest.raises(UserError) as error:
    cellspike_file.open_cellspike(path)
  assert_names(error.value, path, *names)


def test_inf_in_the_middle_is_found(tmp_path):
  path = write_cellspike(str(tmp_path / "c.h5"), sizes={"train": 2000, "val": 8, "test": 8})
  with h5py.File(path, "a") as f:
    f["train_frames"][1000, 5, 2] = np.inf
  with pytest.raises(UserError, match="'train_frames'.*NaN"):
    cellspike_file.open_cellspike(path)


def test_truncated_and_non_hdf5_files(tmp_path):
  path = write_cellspike(str(tmp_path / "c.h5"))
  os.truncate(path, os.path.getsize(path) // 2)
  with pytest.raises(UserError, match="c.h5: not a readable"):
    cellspike_file.open_cellspike(path)
  text = tmp_path / "notes.h5"
  text.write_text("just text")
  with pytest.raises(UserError, match="notes.h5: not a readable"):
    cellspike_file.open_cellspike(str(text))


def test_folder_resolution_through_meta_yaml(tmp_path):
  write_meta_yaml(str(tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"))
  write_cellspike(str(tmp_path / "cellA_excite.cellSpike_4prB8kHz.data.h5"))
  path, info = cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  assert path.endswith("cellA_excite.cellSpike_4prB8kHz.data.h5")
  opened = cellspike_file.open_cellspike(path, info)
  assert opened.par_names[0] == "p0" and opened.meta["dataInfo"]["numPar"] == 15
  with pytest.raises(UserError) as caught:
    cellspike_file.resolve(str(tmp_path), None, "excite_4prB8kHz")
  assert_names(caught.value, "--cell_name", "cells there: cellA")
  with pytest.raises(UserError) as caught:
    cellspike_file.resolve(str(tmp_path), "cellB", "excite_4prB8kHz")
  assert_names(caught.value, "cellB_excite.cellSpike_4prB8kHz.data.h5", "no such file", "cells there: cellA")
  os.remove(path)
  with pytest.raises(UserError) as caught:
    cellspike_file.resolve(str(tmp_path), None, "excite_4prB8kHz")
  assert_names(caught.value, "no file", "h5nameTemplate", "*_excite.cellSpike_4prB8kHz")
  with pytest.raises(UserError, match="meta.cellSpike_other.yaml"):
    cellspike_file.resolve(str(tmp_path), "cellA", "other")


def test_a_template_without_a_star_cannot_pick_a_cell(tmp_path):
  """A template without a * would pick its one file for every --cell_name, whatever the name: refused."""
  write_meta_yaml(str(tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"), template="c1_x.h5")
  write_cellspike(str(tmp_path / "c1_x.h5"))
  with pytest.raises(UserError) as caught:
    cellspike_file.resolve(str(tmp_path), "zzz", "excite_4prB8kHz")
  assert_names(caught.value, "h5nameTemplate 'c1_x.h5'", "single *", "--cell_name")
  assert cellspike_file.resolve(str(tmp_path / "c1_x.h5"), None, "excite_4prB8kHz")[0].endswith("c1_x.h5")


def test_meta_yaml_problems(tmp_path):
  yaml_path = tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"
  write_cellspike(str(tmp_path / "cellA_excite.cellSpike_4prB8kHz.data.h5"))
  yaml_path.write_text("dataInfo: [unclosed")
  with pytest.raises(UserError) as caught:
    cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  assert_names(caught.value, "meta.cellSpike_excite_4prB8kHz.yaml", "malformed YAML")
  yaml_path.write_text("dataInfo: {numFeature: 4}")
  with pytest.raises(UserError) as caught:
    cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  assert_names(caught.value, "dataInfo", "h5nameTemplate", "parName", "numPar")
  write_meta_yaml(str(yaml_path), num_feature=3)
  path, info = cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path, info)
  assert_names(caught.value, "numFeature=3", "4 probes")


def test_implausibly_large_samples_are_refused_before_any_read(tmp_path):
  """A damaged header can claim terabyte rows; the NaN scan must not try to read them."""
  path = str(tmp_path / "huge_rows.h5")
  with h5py.File(path, "w") as f:
    for dom in ("train", "val", "test"):
      f.create_dataset(dom + "_frames", shape=(4, 10**6, 4), dtype=np.float32)   # never written
      f.create_dataset(dom + "_unitStar_par", data=np.zeros((4, 15), np.float32))
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path)
  assert_names(caught.value, "'train_frames'", "(4, 1000000, 4)", "16000000 bytes per sample")


# Hostile files.

def _with_external_targets(path, outside):
  """Rewrites val_unitStar_par as external raw storage in `outside` (h5py `external=`)."""
  with h5py.File(path, "a") as f:
    data = f["val_unitStar_par"][()]
    del f["val_unitStar_par"]
    data.tofile(outside)
    f.create_dataset("val_unitStar_par", shape=data.shape, dtype=data.dtype,
                     external=[(outside, 0, data.nbytes)])


def test_external_storage_is_refused(tmp_path):
  path = write_cellspike(str(tmp_path / "a.h5"))
  _with_external_targets(path, str(tmp_path.parent / ("secret-%s.bin" % tmp_path.name)))
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path)
  assert_names(caught.value, "'val_unitStar_par'", "stored outside the file")


def _virtual_copy(source, target, missing=False):
  """A file whose datasets are virtual views of `source`'s (the source then removed if `missing`)."""
  with h5py.File(source, "r") as src, h5py.File(target, "w") as dst:
    for key in src:
      if key == "meta.JSON":
        continue
      layout = h5py.VirtualLayout(shape=src[key].shape, dtype=src[key].dtype)
      layout[...] = h5py.VirtualSource(os.path.basename(source), key, shape=src[key].shape)
      dst.create_virtual_dataset(key, layout, fillvalue=0)
  if missing:
    os.remove(source)
  return target


def test_virtual_datasets_need_their_sources_beside_the_file(tmp_path):
  source = write_cellspike(str(tmp_path / "source.h5"), extra_keys=False)
  cellspike_file.open_cellspike(_virtual_copy(source, str(tmp_path / "view.h5")))  # sound: it opens
  _virtual_copy(source, str(tmp_path / "orphan.h5"), missing=True)
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(str(tmp_path / "orphan.h5"))
  assert_names(caught.value, "virtual dataset", "source.h5", "missing")


def test_links_must_lead_to_data_beside_the_file(tmp_path):
  path = write_cellspike(str(tmp_path / "a.h5"))
  write_cellspike(str(tmp_path / "b.h5"))
  with h5py.File(path, "a") as f:
    del f["val_frames"]
    f["val_frames"] = h5py.ExternalLink("b.h5", "val_frames")
  assert cellspike_file.open_cellspike(path).splits["val"].num_samples == 32  # sound: it opens
  (tmp_path / "text.h5").write_text("not HDF5")
  elsewhere = tmp_path.parent / (tmp_path.name + "-elsewhere")
  elsewhere.mkdir()
  write_cellspike(str(elsewhere / "outside.h5"))
  with h5py.File(str(tmp_path / "middle.h5"), "w") as middle:  # beside it, but linking out of the folder
    middle["val_frames"] = h5py.ExternalLink(str(elsewhere / "outside.h5"), "val_frames")
  for link, names in [(h5py.ExternalLink("b.h5", "nothing"), ["external link", "b.h5:nothing", "not hold"]),
                      (h5py.ExternalLink("gone.h5", "val_frames"), ["external link", "gone.h5", "missing"]),
                      (h5py.SoftLink("/nowhere"), ["'val_frames'", "link to /nowhere", "not hold"]),
                      (h5py.ExternalLink("text.h5", "val_frames"), ["external link", "text.h5", "not a readable"]),
                      (h5py.ExternalLink("middle.h5", "val_frames"), ["'val_frames'", "external links",
                                                                      "outside.h5, outside"])]:
    with h5py.File(path, "a") as f:
      del f["val_frames"]
      f["val_frames"] = link
    with pytest.raises(UserError) as caught:
      cellspike_file.open_cellspike(path)
    assert_names(caught.value, *names)


def test_a_dataset_never_written_is_refused(tmp_path):
  """Created by a writer that stopped before filling it: it reads as zeros, and trained silently."""
  path = write_cellspike(str(tmp_path / "a.h5"))
  with h5py.File(path, "a") as f:
    del f["test_frames"]
    f.create_dataset("test_frames", shape=(32, 1600, 4), dtype=np.float32)
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path)
  assert_names(caught.value, "'test_frames'", "no data", "32x1600x4", "never written")


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
def test_a_split_whose_last_samples_were_never_written_is_refused(tmp_path, layout):
  """Contiguous storage (h5py's default), or a chunked dataset whose last chunk was begun: the chunk count
  cannot see the unwritten rows, which would read as zeros. A file whose last sample holds data opens."""
  whole = write_cellspike(str(tmp_path / "whole.h5"))
  path = str(tmp_path / "a.h5")
  with h5py.File(whole, "r") as source, h5py.File(path, "w") as f:  # a new file: no freed space reused
    for key in source:
      if key != "val_frames":
        source.copy(source[key], f)
    frames = source["val_frames"][...]
    f.create_dataset("val_frames", shape=frames.shape, dtype=frames.dtype,
                     chunks=(32, 400, 4) if layout == "chunked" else None)
    f["val_frames"][:29] = frames[:29]
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path)
  assert_names(caught.value, "a.h5: ", "last sample", "'val_frames' (row 31)", "zero", "written only in part")
  with h5py.File(path, "a") as f:
    f["val_frames"][29:] = frames[29:]
  assert cellspike_file.open_cellspike(path).splits["val"].num_samples == 32


@pytest.mark.parametrize("rows_written, refused", [(8, True), (20, True), (32, False)])
def test_a_chunked_dataset_written_in_part_is_refused(tmp_path, rows_written, refused):
  """The writer stopped after some chunks: the others would read as zeros. With every chunk stored it
  opens, though the chunks along the time axis run past its end (1600 bins in chunks of 1000)."""
  path = write_cellspike(str(tmp_path / "a.h5"))
  with h5py.File(path, "a") as f:
    frames = f["val_frames"][...]
    del f["val_frames"]
    f.create_dataset("val_frames", shape=frames.shape, dtype=frames.dtype, chunks=(8, 1000, 4))
    f["val_frames"][:rows_written] = frames[:rows_written]
  if not refused:
    assert cellspike_file.open_cellspike(path).splits["val"].num_samples == 32
    return
  stored = -(-rows_written // 8) * 2
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path)
  assert_names(caught.value, "a.h5: ", "'val_frames'", "partly written", "%d of its 8 chunks" % stored, "8x1000x4")


def test_cell_files_may_be_links_to_files_elsewhere(tmp_path):
  """Clusters keep datasets in one place and link them into run folders; the check that the template
  stays in the folder is about its name, not where a link leads."""
  store, data = tmp_path / "store", tmp_path / "data"
  store.mkdir()
  data.mkdir()
  write_cellspike(str(store / "cellA.h5"))
  os.symlink(str(store / "cellA.h5"), str(data / "cellA.h5"))
  write_meta_yaml(str(data / "meta.cellSpike_excite_4prB8kHz.yaml"), template="*.h5")
  assert cellspike_file.resolve(str(data), "cellA", "excite_4prB8kHz")[0] == str(data / "cellA.h5")
  os.symlink(str(store / "gone.h5"), str(data / "gone.h5"))  # listed among the cells, but leads nowhere
  with pytest.raises(UserError) as caught:
    cellspike_file.resolve(str(data), "gone", "excite_4prB8kHz")
  assert_names(caught.value, "gone.h5: ", "symbolic link", "store/gone.h5", "does not exist")


def test_a_template_cannot_leave_the_data_folder(tmp_path):
  data, outside = tmp_path / "data", tmp_path / "outside"
  data.mkdir()
  outside.mkdir()
  write_cellspike(str(outside / "cellA.h5"))
  for template in ("../outside/*.h5", str(outside / "*.h5")):
    write_meta_yaml(str(data / "meta.cellSpike_excite_4prB8kHz.yaml"), template=template)
    with pytest.raises(UserError, match="outside --data_path"):
      cellspike_file.resolve(str(data), "cellA", "excite_4prB8kHz")


def test_yaml_aliases_and_oversized_meta_are_refused_quickly(tmp_path):
  yaml_path = tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"
  laughs = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
      "a%d: &a%d [%s]" % (i, i, ", ".join(["*a%d" % (i - 1)] * 9)) for i in range(1, 12)]
  yaml_path.write_text("\n".join(laughs) + "\ndataInfo: {parName: *a11}\n")
  with pytest.raises(UserError, match="malformed YAML.*aliases"):
    cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  yaml_path.write_text("# " + "x" * (2 << 20))
  with pytest.raises(UserError, match="meta yaml's limit"):
    cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")


def test_par_names_must_be_strings(tmp_path):
  yaml_path = str(tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml")
  write_meta_yaml(yaml_path)
  with open(yaml_path) as f:
    text = f.read().replace("- p3\n", "- {p3: 1}\n")
  with open(yaml_path, "w") as f:
    f.write(text)
  with pytest.raises(UserError, match="parName.*parameter names"):
    cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")


def test_a_file_without_a_meta_yaml_takes_the_parameter_names_of_its_own_meta_json(tmp_path):
  """A generator's file copied on its own trained with par0, par1, ... in every report."""
  path = write_cellspike(str(tmp_path / "a.h5"))
  assert cellspike_file.open_cellspike(path).par_names[:2] == ("par0", "par1")  # it names none
  for names in (["g%d" % i for i in range(15)], ["g%d" % i for i in range(14)]):
    with h5py.File(path, "a") as f:
      del f["meta.JSON"]
      f["meta.JSON"] = json.dumps({"dataInfo": {"parName": names}})
    if len(names) == 15:
      assert cellspike_file.open_cellspike(path).par_names == tuple(names)
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path)
  assert_names(caught.value, "meta.JSON", "dataInfo.parName", "15 parameter names")


def test_a_deeply_nested_meta_json_is_named(tmp_path):
  path = write_cellspike(str(tmp_path / "a.h5"))
  with h5py.File(path, "a") as f:
    del f["meta.JSON"]
    f.create_dataset("meta.JSON", data=["[" * 100000 + "]" * 100000], dtype=h5py.special_dtype(vlen=str))
  with pytest.raises(UserError, match="'meta.JSON'.*too deeply"):
    cellspike_file.open_cellspike(path)


def test_meta_json_as_a_scalar_string_is_read_and_a_list_is_named(tmp_path):
  """h5py stores a plain Python string as a scalar dataset; reading it as the format's 1-element array
  would fail with "Illegal slicing argument for scalar dataspace"."""
  path = write_cellspike(str(tmp_path / "a.h5"))
  with h5py.File(path, "a") as f:
    del f["meta.JSON"]
    f["meta.JSON"] = json.dumps({"simu": {"cell": "scalar"}})
  assert cellspike_file.open_cellspike(path).meta["simu"] == {"cell": "scalar"}
  with h5py.File(path, "a") as f:
    del f["meta.JSON"]
    f["meta.JSON"] = "[1, 2, 3]"
  with pytest.raises(UserError) as caught:
    cellspike_file.open_cellspike(path)
  assert_names(caught.value, "'meta.JSON'", "a list", "JSON object")


def test_the_files_own_data_info_wins_over_the_folders_shared_meta_yaml(tmp_path):
  """A folder's meta yaml is shared by its cells (the generator rewrites it for the last cell it made):
  a run's input_meta must describe the file it trained on, not that last cell."""
  write_meta_yaml(str(tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"))
  with open(str(tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml")) as f:
    shared = yaml.safe_load(f)
  shared["dataInfo"]["generator"] = {"cellName": "other", "seed": 1}
  with open(str(tmp_path / "meta.cellSpike_excite_4prB8kHz.yaml"), "w") as f:
    yaml.safe_dump(shared, f)
  path = write_cellspike(str(tmp_path / "cellA_excite.cellSpike_4prB8kHz.data.h5"))
  with h5py.File(path, "a") as f:
    del f["meta.JSON"]
    f["meta.JSON"] = json.dumps({"dataInfo": {"generator": {"cellName": "cellA", "seed": 0}}})
  h5_path, info = cellspike_file.resolve(str(tmp_path), "cellA", "excite_4prB8kHz")
  meta = cellspike_file.open_cellspike(h5_path, info).meta["dataInfo"]
  assert meta["generator"] == {"cellName": "cellA", "seed": 0}
  assert meta["numPar"] == 15 and meta["h5nameTemplate"].startswith("*")   # filled in from the yaml


def test_the_check_before_tensorflow_hands_its_validation_to_the_runs_loader(tmp_path, monkeypatch):
  """main.py checks --data_path before TensorFlow starts; the loader's open of the unchanged file takes
  that result instead of reading the file's checked rows again. Any other open validates."""
  path = write_cellspike(str(tmp_path / "cell.h5"), sizes={"train": 64, "val": 32, "test": 32})
  config = RunConfig(model="neuron_inverter", data_path=path)
  validated = []
  real_open = cellspike_file.open_cellspike
  monkeypatch.setattr(cellspike_file, "open_cellspike", lambda *args: validated.append(args) or real_open(*args))
  cellspike_file.check_named_files(config)
  assert cellspike_file.open_named(path, None, config.probe_type).splits["train"].num_samples == 64
  assert len(validated) == 1
  cellspike_file.open_named(path, None, config.probe_type)  # a second open: validated again
  assert len(validated) == 2
  cellspike_file.check_named_files(config)
  write_cellspike(path, sizes={"train": 48, "val": 32, "test": 32})  # changed after the check
  assert cellspike_file.open_named(path, None, config.probe_type).splits["train"].num_samples == 48
  assert len(validated) == 4
