"""Opening and validating cellSpike HDF5 files (the Neuron-Inverter data format).

A file holds, for each split `dom` in train/val/test, `<dom>_frames` (N, time bins, probes) and
`<dom>_unitStar_par` (N, parameters), float32 or float16, optionally `<dom>_phys_par` and a `meta.JSON`
string. `--data_path` names the .h5 file itself, or a folder holding `meta.cellSpike_<probe_type>.yaml`
whose `dataInfo.h5nameTemplate` with `*` replaced by `--cell_name` names the file, as in the reference.

Everything is checked when the file is opened, so that a bad file fails in a second with one line
naming the file and key, not an hour into training. Any malformation, corruption or truncation is a
`UserError` naming the file (and the key where there is one), never another exception. The file is
opened once for the check and held open (`CellSpikeFile.pin`, data/pinned_files.py): the run then
reads the file it checked, whatever happens to its name, or stops in one line if the file changes.

NaN/Inf check: a dataset of at most `FULL_SCAN_BYTES` is scanned completely (in chunks of
`SCAN_CHUNK_BYTES`, so memory stays bounded); that covers every target array (N x 15 values: 68 MB for a
29 GB fp16 file) and small frame arrays. A larger frame array is checked on `SAMPLED_ROWS` rows at its
start, middle and end only: scanning 15-144 GB at every start would cost minutes (the whole file read
from a parallel file system) before each run. A NaN/Inf elsewhere in such a frame array is therefore
not found at open time; it shows up as a NaN/Inf training loss, which the training loop stops on.

A file written in part reads its missing rows as zeros: HDF5's fill value, or the fresh file space behind
a contiguous dataset (space the file freed and reused would hold old bytes, which no check can tell from
data). A dataset never written and chunks never stored are found in HDF5's own records, and the last
sample of each split's frames is read, since a writer that stopped early leaves it unwritten.
"""

import dataclasses
import json
import os

import h5py
import numpy as np
import yaml

from data import checked_files, pinned_files
from errors import UserError

SPLITS = ("train", "val", "test")
FRAMES_KEY = "%s_frames"
TARGETS_KEY = "%s_unitStar_par"
META_YAML = "meta.cellSpike_%s.yaml"
META_KEYS = ("h5nameTemplate", "numFeature", "parName", "numPar")
FULL_SCAN_BYTES = 256 * 2**20   # datasets up to this size are checked for NaN/Inf completely
SCAN_CHUNK_BYTES = 16 * 2**20   # bytes read at a time by the complete scan
SAMPLED_ROWS = 64               # rows read at each end and the middle of a larger dataset
MAX_ROW_BYTES = 2**20           # per sample; the reference's is 25,600 (1600 x 4 float32)
_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclasses.dataclass(frozen=True)
class SplitInfo:
  num_samples: int
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class CellSpikeFile:
  """A validated cellSpike file: where it is, its shapes, and its meta data."""
  path: str
  splits: dict                 # dom -> SplitInfo
  time_bins: int
  num_probes: int
  num_params: int
  par_names: tuple
  meta: dict                   # meta.JSON (if present), its dataInfo completed from the meta yaml's
  # The checked file, held open: every later read goes through it (data/pinned_files.py).
  pin: object = dataclasses.field(default=None, compare=False, repr=False)

  @property
  def input_shape(self):
    return (self.time_bins, self.num_probes)


MAX_META_BYTES = 1 << 20  # a real meta yaml is a few kB


class _NoAliasLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
  """safe_load without aliases: a few hundred bytes of nested aliases expand to gigabytes."""

  def compose_node(self, parent, index):
    if self.check_event(yaml.AliasEvent):
      event = self.peek_event()
      raise yaml.composer.ComposerError(None, None, "aliases (*%s) are not allowed" % event.anchor,
                                        event.start_mark)
    return super().compose_node(parent, index)


def _read_yaml(path: str) -> dict:
  try:
    if os.path.getsize(path) > MAX_META_BYTES:
      raise UserError("%s: %d bytes, more than a meta yaml's limit of %d"
                      % (path, os.path.getsize(path), MAX_META_BYTES))
    with open(path, encoding="utf-8") as f:
      content = yaml.load(f, Loader=_NoAliasLoader)  # nosec: a SafeLoader
  except OSError as error:
    raise UserError("%s: cannot read the meta yaml (%s)" % (path, error.strerror)) from None
  except (yaml.YAMLError, UnicodeDecodeError) as error:
    raise UserError("%s: malformed YAML (%s)" % (path, " ".join(str(error).split()))) from None
  info = content.get("dataInfo") if isinstance(content, dict) else None
  if not isinstance(info, dict):
    raise UserError("%s: expected a top-level 'dataInfo' mapping" % path)
  missing = [key for key in META_KEYS if key not in info]
  if missing:
    raise UserError("%s: dataInfo lacks %s" % (path, ", ".join(missing)))
  if not isinstance(info["h5nameTemplate"], str) or not info["h5nameTemplate"]:
    raise UserError("%s: dataInfo.h5nameTemplate is %r, expected a file name pattern such as "
                    "'*_excite.cellSpike_4prB8kHz.data.h5'" % (path, info["h5nameTemplate"]))
  for key in ("numFeature", "numPar", "numTimeBin"):
    value = info.get(key)
    if key in info and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise UserError("%s: dataInfo.%s is %r, expected a positive integer" % (path, key, value))
  if not isinstance(info["parName"], list) or not all(isinstance(n, str) for n in info["parName"]):
    raise UserError("%s: dataInfo.parName is %r, expected a list of parameter names (strings)"
                    % (path, info["parName"]))
  return info


def _inside(path: str, folder: str) -> bool:
  """Whether `path`'s name lies in `folder`: no `..` or absolute part leads out. Symbolic links are
  not followed: data folders on clusters often link each cell's file from where it is stored."""
  path, folder = (os.path.normpath(os.path.abspath(p)) for p in (path, folder))
  return os.path.commonpath([path, folder]) == folder


def _refuse_paths_in_names(data_path: str, **values) -> None:
  """Flag values that fill in a file name (meta.cellSpike_<probe_type>.yaml, h5nameTemplate's *) are
  names: with a '/' the file could lie outside --data_path's folder, through '..' or a link in it that
  no check of the written path sees. A UserError names the flag, as a template leaving the folder."""
  for flag, value in values.items():
    if value and (os.sep in value or (os.altsep and os.altsep in value) or value in (".", "..")
                  or "\0" in value):
      raise UserError("--%s=%s is a path, and the file it names could lie outside --data_path=%s: give a "
                      "name (without '/')" % (flag, value, data_path))


def resolve(data_path: str, cell_name, probe_type: str):
  """Returns (h5 path, meta yaml dataInfo or None) for `--data_path` (a file, or a folder + cell name)."""
  if not os.path.exists(data_path):
    raise UserError("--data_path=%s does not exist" % data_path)
  _refuse_paths_in_names(data_path, probe_type=probe_type, cell_name=cell_name)
  if not os.path.isdir(data_path):
    yaml_path = os.path.join(os.path.dirname(data_path), META_YAML % probe_type)
    return data_path, (_read_yaml(yaml_path) if os.path.isfile(yaml_path) else None)
  yaml_path = os.path.join(data_path, META_YAML % probe_type)
  if not os.path.isfile(yaml_path):
    raise UserError("--data_path=%s is a folder without %s (pass the .h5 file itself, or the folder "
                    "holding the meta yaml for --probe_type=%s)" % (data_path, META_YAML % probe_type,
                                                                    probe_type))
  info = _read_yaml(yaml_path)
  template = str(info["h5nameTemplate"])
  if template.count("*") != 1:  # the * is where --cell_name goes: without it every cell is one file
    raise UserError("%s: h5nameTemplate %r has no single * for --cell_name to fill, so it cannot pick a "
                    "cell's file (pass the .h5 file itself as --data_path)" % (yaml_path, template))
  if not cell_name:
    raise UserError("--data_path=%s is a folder: --cell_name is needed to pick the file (%s)"
                    % (data_path, _cells_in(data_path, template)))
  h5_path = os.path.join(data_path, template.replace("*", cell_name))
  if not _inside(h5_path, data_path):
    raise UserError("%s: h5nameTemplate %r with --cell_name=%s names %s, outside --data_path=%s"
                    % (yaml_path, info["h5nameTemplate"], cell_name, h5_path, data_path))
  if os.path.islink(h5_path) and not os.path.exists(h5_path):
    raise UserError("%s: a symbolic link to %s, which does not exist" % (h5_path, os.readlink(h5_path)))
  if not os.path.isfile(h5_path):
    raise UserError("%s: no such file (from %s h5nameTemplate and --cell_name=%s; %s)"
                    % (h5_path, yaml_path, cell_name, _cells_in(data_path, template)))
  return h5_path, info


def _cells_in(folder: str, template: str) -> str:
  """Which --cell_name values find a file in `folder` through `template` ('*_excite...data.h5'), as
  the end of an error line."""
  prefix, _, suffix = template.partition("*")
  cells = [name[len(prefix):len(name) - len(suffix)] for name in sorted(os.listdir(folder))
           if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix)]
  if not cells:
    return "no file there matches h5nameTemplate %r" % template
  return "cells there: %s" % ", ".join(cells)


def _dataset(f: h5py.File, path: str, key: str) -> h5py.Dataset:
  _check_link(f, path, key)
  if key not in f:
    raise UserError("%s: missing key '%s' (a cellSpike file has %s)" % (
        path, key, ", ".join(FRAMES_KEY % d + "/" + TARGETS_KEY % d for d in SPLITS)))
  dataset = f[key]
  if not isinstance(dataset, h5py.Dataset):
    raise UserError("%s: '%s' is a group, expected a dataset" % (path, key))
  _check_storage(dataset, path, key)
  if dataset.dtype.newbyteorder("=") not in _FLOAT_DTYPES:  # either byte order
    raise UserError("%s: '%s' has dtype %s, expected float16 or float32" % (path, key, dataset.dtype))
  return dataset


def _check_link(f: h5py.File, path: str, key: str) -> None:
  """A key may be a link: to another object of the file, or to a dataset in a file beside it (the
  rule for virtual sources below). A dangling one is named as such, not as a damaged file."""
  link = f.get(key, getlink=True)
  if link is None or isinstance(link, h5py.HardLink):
    return  # missing (said by the caller), or an object of this file itself
  folder = os.path.dirname(os.path.abspath(path))
  if isinstance(link, h5py.ExternalLink):
    target = os.path.join(folder, link.filename)
    if not _inside(target, folder) or not os.path.isfile(target):
      raise UserError("%s: '%s' is an external link to %s, which is missing or outside %s"
                      % (path, key, link.filename, folder))
    try:
      with h5py.File(target, "r") as linked:
        if link.path not in linked:
          raise UserError("%s: '%s' is an external link to %s:%s, which that file does not hold"
                          % (path, key, link.filename, link.path))
    except OSError as error:
      raise UserError("%s: '%s' is an external link to %s, which is not a readable HDF5 file (%s)"
                      % (path, key, link.filename, " ".join(str(error).split()))) from None
  elif isinstance(link, h5py.SoftLink) and link.path not in f:
    raise UserError("%s: '%s' is a link to %s, which the file does not hold" % (path, key, link.path))
  if key in f:  # where a chain of links ends: beside the file too
    stored = f[key].file.filename
    if not _inside(stored, folder):
      raise UserError("%s: '%s' leads through external links to %s, outside %s" % (path, key, stored, folder))


def _check_storage(dataset: h5py.Dataset, path: str, key: str) -> None:
  """Data must live in the file, or in existing files beside it: external raw storage can name any
  file on the machine (whose bytes would then reach predictions.npz), and a virtual dataset with a
  missing source reads as its fill value, silently."""
  if dataset.external:
    raise UserError("%s: '%s' is stored outside the file (external storage in %s); cellSpike data must "
                    "be inside the HDF5 file" % (path, key, dataset.external[0][0]))
  if not dataset.is_virtual:
    return
  folder = os.path.dirname(os.path.abspath(path))
  for source in dataset.virtual_sources():
    name = source.file_name
    source_path = os.path.abspath(path) if name == "." else os.path.join(folder, name)
    if not _inside(source_path, folder) or not os.path.isfile(source_path):
      raise UserError("%s: '%s' is a virtual dataset whose source %s is missing or outside %s"
                      % (path, key, name, folder))


def _dims(shape: tuple) -> str:
  """A shape as an error line writes it: 32x1600x4."""
  return "x".join(str(d) for d in shape)


def _check_every_chunk_written(dataset: h5py.Dataset, path: str) -> None:
  """A chunked dataset whose writer stopped part-way has chunks that were never stored, and HDF5 reads
  them as the fill value: rows of zeros that would train silently. Counting the stored chunks reads
  only the chunk index, not the data."""
  if dataset.chunks is None or dataset.is_virtual:
    return
  expected = int(np.prod([-(-size // chunk) for size, chunk in zip(dataset.shape, dataset.chunks)],
                         dtype=np.int64))
  stored = dataset.id.get_num_chunks()
  if stored < expected:
    raise UserError("%s: '%s' is only partly written: %d of its %d chunks of %s values hold data, and the "
                    "rest would read as zeros (a writer that stopped early?)"
                    % (path, dataset.name.lstrip("/"), stored, expected, _dims(dataset.chunks)))


def _check_last_sample_written(frames: h5py.Dataset, path: str) -> None:
  """A writer that stopped before the end leaves the last rows unwritten, and they read as zeros (the
  fill value, or a contiguous dataset's fresh file space). The chunk count cannot see that in a
  contiguous dataset (h5py's default layout), nor inside a chunk that was begun; a recorded or
  simulated voltage trace is never zero at every time bin and probe. One row is read."""
  last = frames.shape[0] - 1
  if not np.any(frames[last]):
    raise UserError("%s: the last sample of '%s' (row %d) is zero at every time bin and probe: the file "
                    "looks written only in part (a writer that stopped early?)"
                    % (path, frames.name.lstrip("/"), last))


def checked_row_ranges(shape: tuple, itemsize: int) -> list:
  """[start, stop) row ranges of a dataset that the NaN/Inf check reads (see the module docstring)."""
  n = shape[0]
  row_bytes = itemsize * int(np.prod(shape[1:], dtype=np.int64))
  if n * row_bytes <= FULL_SCAN_BYTES:
    step = max(1, SCAN_CHUNK_BYTES // max(1, row_bytes))
    return [(start, min(start + step, n)) for start in range(0, n, step)]
  starts = sorted({0, max(0, n // 2 - SAMPLED_ROWS // 2), max(0, n - SAMPLED_ROWS)})
  return [(start, min(start + SAMPLED_ROWS, n)) for start in starts]


def _first_non_finite_row(dataset: h5py.Dataset):
  """The first row found holding NaN/Inf among the checked rows, or None."""
  for start, stop in checked_row_ranges(dataset.shape, dataset.dtype.itemsize):
    finite = np.isfinite(dataset[start:stop]).reshape(stop - start, -1).all(axis=1)
    if not finite.all():
      return start + int(np.argmin(finite))
  return None


def _check_split(path: str, f: h5py.File, dom: str) -> tuple:
  frames, targets = _dataset(f, path, FRAMES_KEY % dom), _dataset(f, path, TARGETS_KEY % dom)
  if frames.ndim != 3:
    raise UserError("%s: '%s' has shape %s, expected rank 3 (samples, time bins, probes)"
                    % (path, frames.name.lstrip("/"), frames.shape))
  if targets.ndim != 2:
    raise UserError("%s: '%s' has shape %s, expected rank 2 (samples, parameters)"
                    % (path, targets.name.lstrip("/"), targets.shape))
  if frames.shape[0] != targets.shape[0]:
    raise UserError("%s: '%s' has %d samples but '%s' has %d" % (
        path, FRAMES_KEY % dom, frames.shape[0], TARGETS_KEY % dom, targets.shape[0]))
  if frames.shape[0] == 0:
    raise UserError("%s: the %s split is empty ('%s' has 0 samples)" % (path, dom, FRAMES_KEY % dom))
  if 0 in frames.shape[1:] or targets.shape[1] == 0:
    raise UserError("%s: '%s' has shape %s and '%s' has shape %s, expected at least one time bin, one "
                    "probe and one parameter" % (path, FRAMES_KEY % dom, frames.shape, TARGETS_KEY % dom,
                                                 targets.shape))
  for dataset in (frames, targets):
    row_bytes = dataset.dtype.itemsize * int(np.prod(dataset.shape[1:], dtype=np.int64))
    if row_bytes > MAX_ROW_BYTES:  # e.g. a damaged header: reading even a few rows would exhaust memory
      raise UserError("%s: '%s' has shape %s: %d bytes per sample, more than the %d a cellSpike sample "
                      "can plausibly have (a damaged file?)" % (path, dataset.name.lstrip("/"),
                                                                 dataset.shape, row_bytes, MAX_ROW_BYTES))
    if not dataset.is_virtual and dataset.id.get_storage_size() == 0:
      # Created but never written (a writer that stopped early): it would read as its fill value.
      raise UserError("%s: '%s' holds no data (its %s values were never written)"
                      % (path, dataset.name.lstrip("/"), _dims(dataset.shape)))
    _check_every_chunk_written(dataset, path)
    row = _first_non_finite_row(dataset)
    if row is not None:
      raise UserError("%s: '%s' contains NaN or Inf values (row %d)"
                      % (path, dataset.name.lstrip("/"), row))
  _check_last_sample_written(frames, path)
  return frames.shape, targets.shape, frames.dtype


def _read_meta_json(f: h5py.File, path: str) -> dict:
  if "meta.JSON" not in f:
    return {}
  if isinstance(f["meta.JSON"], h5py.Dataset):
    _check_storage(f["meta.JSON"], path, "meta.JSON")
  try:
    record = f["meta.JSON"]
    # The format's 1-element string array, or the same string stored as a scalar (h5py's default).
    raw = record[()] if isinstance(record, h5py.Dataset) and record.shape == () else record[0]
    meta = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
  except RecursionError:
    raise UserError("%s: 'meta.JSON' is nested too deeply to be a cellSpike meta record" % path) from None
  except (ValueError, TypeError, IndexError, KeyError, AttributeError) as error:
    raise UserError("%s: 'meta.JSON' is not a JSON string (%s)" % (path, error)) from None
  if not isinstance(meta, dict):
    raise UserError("%s: 'meta.JSON' holds a %s, expected a JSON object" % (path, type(meta).__name__))
  return meta


def _own_par_names(path: str, meta: dict, num_params: int) -> tuple:
  """The parameter names in the file's own meta.JSON (dataInfo.parName, as the generator writes it),
  for a file without a meta yaml beside it; par0, par1, ... when it names none."""
  names = (meta.get("dataInfo") if isinstance(meta.get("dataInfo"), dict) else {}).get("parName")
  if names is None:
    return tuple("par%d" % i for i in range(num_params))
  if not isinstance(names, list) or len(names) != num_params or not all(isinstance(n, str) for n in names):
    raise UserError("%s: meta.JSON dataInfo.parName is %.200r, expected a list of %d parameter names "
                    "(strings)" % (path, names, num_params))
  return tuple(names)


def _check_meta_agrees(path: str, yaml_info: dict, time_bins: int, num_probes: int,
                       num_params: int) -> tuple:
  if yaml_info["numFeature"] != num_probes:
    raise UserError("%s: meta yaml says numFeature=%s but the frames have %d probes"
                    % (path, yaml_info["numFeature"], num_probes))
  if yaml_info["numPar"] != num_params or len(yaml_info["parName"]) != num_params:
    raise UserError("%s: meta yaml says numPar=%s with %d parName entries but the targets have %d "
                    "parameters" % (path, yaml_info["numPar"], len(yaml_info["parName"]), num_params))
  if "numTimeBin" in yaml_info and yaml_info["numTimeBin"] != time_bins:
    raise UserError("%s: meta yaml says numTimeBin=%s but the frames have %d time bins"
                    % (path, yaml_info["numTimeBin"], time_bins))
  return tuple(str(name) for name in yaml_info["parName"])


def _file_key(path: str, yaml_info) -> tuple:
  return checked_files.versions([path]) + (json.dumps(yaml_info, sort_keys=True, default=str),)


def open_named(data_path: str, cell_name, probe_type: str) -> CellSpikeFile:
  """The file that `--data_path` (with `--cell_name` for a folder) names, opened and validated (once
  per run: after check_named_files, the first open of the unchanged file takes its result; the
  validation reads every target and rows of each frame array, 0.2 s for a 2,560-sample file)."""
  path, yaml_info = resolve(data_path, cell_name, probe_type)
  return checked_files.take(_file_key(path, yaml_info), lambda: open_cellspike(path, yaml_info))


def check_named_files(config):
  """`data.check_named_files` for cellSpike: the `--data_path` file, if the run names one (returned)."""
  if config.data_path:
    path, yaml_info = resolve(config.data_path, config.cell_name, config.probe_type)
    key = _file_key(path, yaml_info)  # before the read: a file changed while read is read again
    info = open_cellspike(path, yaml_info)
    checked_files.keep(key, info)
    return info  # its split sizes are checked against the flags before TensorFlow too (data/sizes.py)
  return None


def open_cellspike(path: str, yaml_info=None) -> CellSpikeFile:
  """Opens and validates a cellSpike file; every problem is a UserError naming file and key."""
  if os.path.isdir(path):
    raise UserError("%s is a folder, expected a cellSpike .h5 file" % path)
  pin = pinned_files.PinnedFile.open(path)
  try:
    try:
      with pin.opened() as f:
        shapes = {dom: _check_split(path, f, dom) for dom in SPLITS}
        meta = _read_meta_json(f, path)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
      # h5py reports a truncated, corrupt or foreign file as OSError on open, and damage inside the
      # file (a bad object header, a garbled chunk index) as any of these while it is read.
      raise UserError("%s: not a readable HDF5 file (truncated, corrupt, or not HDF5: %s)"
                      % (path, " ".join(str(error).split()) or type(error).__name__)) from None
    return _checked_file(path, pin, shapes, meta, yaml_info)
  except BaseException:
    pin.close()
    raise


def _checked_file(path: str, pin, shapes: dict, meta: dict, yaml_info) -> CellSpikeFile:
  """The CellSpikeFile of a file whose splits were read (`shapes`), once they agree with each other
  and with the meta yaml."""
  frame_shapes = {shape[0][1:] for shape in shapes.values()}
  param_counts = {shape[1][1] for shape in shapes.values()}
  if len(frame_shapes) != 1 or len(param_counts) != 1:
    raise UserError("%s: the splits disagree on frame shape %s or parameter count %s"
                    % (path, sorted(frame_shapes), sorted(param_counts)))
  (time_bins, num_probes), num_params = frame_shapes.pop(), param_counts.pop()
  par_names = (_check_meta_agrees(path, yaml_info, time_bins, num_probes, num_params) if yaml_info
               else _own_par_names(path, meta, num_params))
  if yaml_info:
    # The folder's meta yaml is shared by its cells, so what the file says of itself wins (its cell
    # name, seed and sample counts); the yaml fills in what the file does not say.
    own = meta.get("dataInfo") if isinstance(meta.get("dataInfo"), dict) else {}
    meta = dict(meta, dataInfo=dict(yaml_info, **own))
  return CellSpikeFile(
      path=path, time_bins=time_bins, num_probes=num_probes, num_params=num_params,
      par_names=par_names, meta=meta, pin=pin,
      splits={dom: SplitInfo(shape[0][0], np.dtype(shape[2])) for dom, shape in shapes.items()})
