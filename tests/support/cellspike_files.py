"""Hand-made cellSpike files for tests: the reference layout, with learnable random data."""

import json
import os

import h5py
import numpy as np
import yaml

PAR_NAMES = ["p%d" % i for i in range(15)]


def make_arrays(n, seed=0, time_bins=1600, probes=4, params=15):
  """Frames whose content depends on the targets, so a model can learn something."""
  rng = np.random.RandomState(seed)
  targets = rng.uniform(-1, 1, size=(n, params)).astype(np.float32)
  t = np.linspace(0, 1, time_bins, dtype=np.float32)[None, :, None]
  frames = (np.sin(2 * np.pi * (3 + 2 * targets[:, None, :1]) * t) * (1 + 0.5 * targets[:, None, 1:2])
            + 0.1 * rng.randn(n, time_bins, probes)).astype(np.float32)
  return frames, targets


def write_cellspike(path, sizes=None, dtype=np.float32, extra_keys=True, seed=0, **array_kwargs):
  """Writes train/val/test splits (default 64/32/32 samples); the row index is stored in frames[:, 0, 0]
  when `mark_rows` is requested via the frames' first bin, so tests can trace which rows were read."""
  sizes = sizes or {"train": 64, "val": 32, "test": 32}
  with h5py.File(path, "w") as f:
    for i, (dom, n) in enumerate(sizes.items()):
      frames, targets = make_arrays(n, seed + i, **array_kwargs)
      f.create_dataset(dom + "_frames", data=frames.astype(dtype), chunks=True)
      f.create_dataset(dom + "_unitStar_par", data=targets.astype(dtype))
      if extra_keys:
        f.create_dataset(dom + "_phys_par", data=(10.0 ** targets).astype(dtype))
    if extra_keys:
      f.create_dataset("meta.JSON", data=[json.dumps({"hand_made": True})],
                       dtype=h5py.special_dtype(vlen=str))
  return path


def write_meta_yaml(path, template="*_excite.cellSpike_4prB8kHz.data.h5", num_feature=4, num_par=15):
  info = {"dataInfo": {"h5nameTemplate": template, "numFeature": num_feature,
                       "featureName": ["soma", "axon", "apic", "dend"][:num_feature],
                       "parName": PAR_NAMES[:num_par], "numPar": num_par, "numTimeBin": 1600}}
  with open(path, "w") as f:
    yaml.safe_dump(info, f)
  return path


def write_contiguous_folder(folder, name="contiguous.h5", sizes=(("train", 64), ("val", 32), ("test", 32))):
  """A small cellSpike file stored contiguously, with its meta yaml beside it, in `folder`; its path. Read
  in place (memory-mapped), where write_cellspike's chunked frames are staged to a temporary copy first."""
  write_meta_yaml(os.path.join(folder, "meta.cellSpike_excite_4prB8kHz.yaml"))
  path = os.path.join(folder, name)
  with h5py.File(path, "w") as f:
    for seed, (split, rows) in enumerate(sizes):
      frames, targets = make_arrays(rows, seed)
      f.create_dataset(split + "_frames", data=frames)
      f.create_dataset(split + "_unitStar_par", data=targets)
  return path


def write_row_marked(path, n_train, probes=4, time_bins=16, params=3, dtype=np.float32, n_eval=24, **storage):
  """A tiny file whose train frames hold their own row index everywhere (for sharding tests).

  `storage`: h5py dataset options for the frames (e.g. chunks, compression); contiguous by default."""
  with h5py.File(path, "w") as f:
    for dom, n in (("train", n_train), ("val", n_eval), ("test", n_eval)):
      rows = np.arange(n, dtype=np.float32)
      f.create_dataset(dom + "_frames", dtype=dtype, **storage,
                       data=np.broadcast_to(rows[:, None, None], (n, time_bins, probes)))
      f.create_dataset(dom + "_unitStar_par", data=np.broadcast_to(rows[:, None], (n, params)), dtype=dtype)
  return path
