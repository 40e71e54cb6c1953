"""Writes a synthetic cellSpike dataset (HDF5 + meta yaml) from the numpy neuron model in neuron_sim.

Layout written (the Neuron-Inverter format, reference section 2):
  <out_dir>/<cell_name>_excite.cellSpike_4prB8kHz.data.h5 with, for dom in train, val, test:
    <dom>_frames (N, 1600, 4), <dom>_unitStar_par (N, 15), <dom>_phys_par (N, 15): float32, or float16
    with fp16=True; plus meta.JSON, a 1-element variable-length string holding the meta dict as JSON.
  <out_dir>/meta.cellSpike_<probe_type>.yaml holding the same dict (dataInfo + packInfo).

Targets u are uniform in [-1, 1], drawn from one seeded stream per split, so the output is a function of
the arguments only: the batch size and the number of worker processes do not change a single bit.
Frames are normalised per probe with a mean and std taken once over the first up-to-2048 training
samples (stored as packInfo fnorm_mean / fnorm_std), as the real data were packed.

Samples are simulated a batch at a time and written into pre-created datasets, so memory is bounded by a
batch (plus the buffered normalisation sample), not by the file. The file is written under a fresh
temporary name in out_dir (created exclusively, never through a link), fsynced and renamed at the end:
an interrupted run never leaves a partial file under the final name. The free space and the file-size
limit (`ulimit -f`) are checked before the simulation starts; a write that fails anyway (a disk that
others fill, a quota, a read-only or failing file system) is one line naming the file and the cause,
with the partial file removed and h5py closed without its crash (data/hdf5_writes.py).
"""

import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import time

import h5py
import numpy as np
import yaml
from absl import logging

from data import hdf5_writes
from data import neuron_sim
from errors import UserError
from host import atomic_files
from stop_signals import leave_interrupts_to_the_parent

H5_NAME_TEMPLATE = "*_excite.cellSpike_4prB8kHz.data.h5"
DOMAINS = ("train", "val", "test")
NORM_SAMPLES = 2048          # frames behind fnorm_mean / fnorm_std, as the real packing's first shard
_SEED_SALT = 0xCE115         # keeps these streams apart from other users of the same --seed


def h5_name(cell_name: str) -> str:
  return H5_NAME_TEMPLATE.replace("*", cell_name)


def meta_yaml_name(probe_type: str) -> str:
  return "meta.cellSpike_%s.yaml" % probe_type


def _check_args(out_dir, cell_name, counts, seed, batch_size, workers, probe_type):
  for name, value in zip(DOMAINS, counts):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise UserError("num_%s must be an integer >= 1, got %r" % (name, value))
  for name, value in (("cell_name", cell_name), ("probe_type", probe_type)):
    if not value or any(c in value for c in "/\\*") or value.startswith("."):
      raise UserError("%s %r is not usable in a file name (empty, leading '.', or '/', '\\', '*')"
                      % (name, value))
  if seed < 0:
    raise UserError("seed must be >= 0, got %d" % seed)
  if batch_size < 1:
    raise UserError("batch_size must be >= 1, got %d" % batch_size)
  if workers < 1:
    raise UserError("workers must be >= 1, got %d" % workers)
  if not out_dir:
    raise UserError("--out_dir must be set")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise UserError("--out_dir=%s exists and is not a directory" % out_dir)


def _batches(seed: int, counts, batch_size: int, workers: int):
  """Yields simulation batches, each a list of (domain, start, u) segments; train first.

  Each domain draws from its own seeded stream, and successive draws from one numpy Generator continue
  a single stream, so the u of a sample does not depend on how the samples are cut into batches. A
  batch may span domains (fewer, fuller batches for small splits); small totals are cut finer so that
  every worker gets a share.
  """
  step = min(batch_size, max(64, -(-sum(counts) // workers)))
  streams = np.random.SeedSequence([_SEED_SALT, seed]).spawn(len(DOMAINS))
  batch, filled = [], 0
  for domain, count, stream in zip(DOMAINS, counts, streams):
    rng = np.random.default_rng(stream)
    start = 0
    while start < count:
      size = min(step - filled, count - start)
      batch.append((domain, start, rng.uniform(-1.0, 1.0, size=(size, neuron_sim.NUM_PAR))))
      start, filled = start + size, filled + size
      if filled == step:
        yield batch
        batch, filled = [], 0
  if batch:
    yield batch


def _simulate_segments(batch):
  """(segments, traces) for one batch; a module-level function so worker processes can run it."""
  return batch, neuron_sim.simulate(np.concatenate([u for _, _, u in batch]))


def _simulated(batches, workers: int):
  """Yields (domain, start, u, traces) per segment, in order, simulating in `workers` processes.

  Worker processes are spawned, not forked: a caller that has started TensorFlow's threads cannot be
  forked safely.
  """
  if workers == 1:
    results = (_simulate_segments(batch) for batch in batches)
    pool = None
  else:
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=leave_interrupts_to_the_parent)
    results = pool.imap(_simulate_segments, batches)
  try:
    for batch, traces in results:
      offset = 0
      for domain, start, u in batch:
        yield domain, start, u, traces[offset:offset + len(u)]
        offset += len(u)
  finally:
    if pool is not None:
      pool.terminate()
      pool.join()


class _Progress:
  """One status line on stderr: a bar rewritten in place on a terminal, else a new line every 10 s.

  The rate counts from when every worker has finished its first batch: those batches also carry the
  workers' start-up and, on a machine's first run, the kernel's compilation (about 4 s), which would make
  the first ETA twice too long. Until RATE_WINDOW seconds have passed since that point, a line gives no
  rate and no time left: counted from the start, the first line of a make run would say "331 s left"
  for 40 s; counted over the 0.24 s after the point, as the batches the workers finished while the first
  ones were written come in together, another would say 8,630 samples/s and "7 s left" for 37 s.
  """

  RATE_WINDOW = 5.0   # seconds: about ten of the built-in dataset's batches on two cores

  def __init__(self, total: int, enabled: bool, workers: int = 1):
    self.total, self.enabled, self.done = total, enabled, 0
    self.start = self.last = time.time()
    self.batches_to_mark = workers
    self.mark = None   # (time, samples done) when every worker had finished a batch
    self.tty = enabled and sys.stderr.isatty()

  def rate(self, now: float):
    """Samples per second since the mark; None until RATE_WINDOW seconds have passed since it, unless
    all are done before (then the whole run's rate)."""
    if self.mark is not None and now - self.mark[0] >= self.RATE_WINDOW:
      return (self.done - self.mark[1]) / (now - self.mark[0])
    return self.done / max(now - self.start, 1e-9) if self.done == self.total else None

  def update(self, domain: str, count: int, batches: int = 1):
    """`count` more samples, in `batches` batches: the first ones are written all at once after the
    normalisation's sample is complete, and their burst must not count as a rate."""
    self.done += count
    now = time.time()
    self.batches_to_mark -= batches
    if self.batches_to_mark <= 0 and self.mark is None:
      self.mark = (now, self.done)
    finished = self.done == self.total
    if not self.enabled or not (self.tty or finished or now - self.last >= 10.0):
      return
    self.last = now
    rate = self.rate(now)
    if self.tty:
      sys.stderr.write("\r%s\033[K%s" % (self.bar_line(domain, rate), "\n" if finished else ""))
    else:
      speed = ("%.1f samples/s, %.0f s left" % (rate, (self.total - self.done) / rate) if rate is not None
               else "the workers are starting, rate and time left to follow")
      # The count runs over all splits; the split named is the one being made now.
      sys.stderr.write("generating: %d/%d samples (%.0f%%), %s (%s split)\n" % (
          self.done, self.total, 100.0 * self.done / self.total, speed, domain))
    sys.stderr.flush()

  def bar_line(self, domain: str, rate) -> str:
    """The terminal's line: a bar and the shorter words, within the terminal's width (shutil: $COLUMNS,
    else the terminal's, else 80). A carriage return goes back to the start of the terminal's last row
    only: the file's line (105 columns) wrapped in a 100-column terminal, and each rewrite left a row."""
    speed = ("%.0f/s, %.0f s left" % (rate, (self.total - self.done) / rate) if rate is not None
             else "workers starting")
    words = " %.0f%% %d/%d samples, %s split, %s" % (100.0 * self.done / self.total, self.done, self.total,
                                                      domain, speed)
    columns = shutil.get_terminal_size().columns
    width = max(10, min(30, columns - 1 - len("generating []") - len(words)))
    filled = width * self.done // self.total
    bar = "=" * filled + (">" if filled < width else "") + "." * (width - filled - 1)
    return ("generating [%s]%s" % (bar[:width], words))[:columns - 1]


# The meta yaml's keys that the loaders read (data/cellspike_file.py): the same for every generated cell.
LOADER_KEYS = ("h5nameTemplate", "numFeature", "numPar", "numTimeBin", "parName")


def meta_yaml_conflicts(out_dir: str, probe_type: str) -> list:
  """The loader keys of a meta yaml already in `out_dir` that differ from those `generate_dataset`
  would write over it: a folder of other data (real cells, with their own parameter names)."""
  path = os.path.join(out_dir, meta_yaml_name(probe_type))
  if not os.path.isfile(path):
    return []
  try:
    with open(path, encoding="utf-8") as f:
      content = yaml.safe_load(f)
  except (OSError, UnicodeDecodeError, yaml.YAMLError):
    return ["content (not readable as YAML)"]
  info = content.get("dataInfo") if isinstance(content, dict) else None
  if not isinstance(info, dict):
    return ["dataInfo"]
  ours = _data_info("", (0, 0, 0), 0, False, probe_type)
  return [key for key in LOADER_KEYS if info.get(key) != ours[key]]


def _data_info(cell_name, counts, seed, fp16, probe_type):
  """The dataInfo dict of the meta yaml: the keys the loaders read, plus how the data were made."""
  channel_site = {c.par: neuron_sim.COMPARTMENT_NAMES[c.comp] for c in neuron_sim.CHANNELS}
  return {
      "fullName": "synthetic 4-compartment conductance-based cell (numpy, data/neuron_sim.py)",
      "shortName": cell_name,
      "probeType": probe_type,
      "dataNormalized": True,
      "ustarTransform": False,
      "featureName": list(neuron_sim.FEATURE_NAMES),
      "featureType": "probes_4prB8kHz",
      "h5nameTemplate": H5_NAME_TEMPLATE,
      "numFeature": neuron_sim.NUM_FEATURES,
      "numPar": neuron_sim.NUM_PAR,
      "numTimeBin": neuron_sim.NUM_TIME_BINS,
      "parName": list(neuron_sim.PAR_NAMES),
      "generator": {
          "model": "data/neuron_sim.py",
          "cellName": cell_name,
          "seed": int(seed),
          "numSamples": {d: int(n) for d, n in zip(DOMAINS, counts)},
          "dataPrecision": "fp16" if fp16 else "fp32",
          "uRange": [-1.0, 1.0],
          "physPar": "base * 10**u (S/cm2)",
          "baseConductance": {name: float(g) for name, g in
                              zip(neuron_sim.PAR_NAMES, neuron_sim.BASE_S_PER_CM2)},
          "parCompartment": [channel_site[k] for k in range(neuron_sim.NUM_PAR)],
          "fixedConductance": {k: float(v) for k, v in neuron_sim.FIXED_S_PER_CM2.items()},
          "dt_ms": neuron_sim.DT,
          "binMs": neuron_sim.BIN_MS,
          "settleMs": neuron_sim.SETTLE_MS,
          "stimulus": {"site": "soma", "unit": "nA",
                       "segments_ms_nA": [[float(x) for x in seg] for seg in neuron_sim.STIM_NA]},
          "numpyVersion": np.__version__,
      },
  }


def _create_datasets(h5, counts, dtype):
  """Contiguous datasets, as the reference's files are written: the loader memory-maps them
  (data/hdf5_native.py), where chunked ones would be copied to a temporary folder at every run."""
  for domain, count in zip(DOMAINS, counts):
    h5.create_dataset(domain + "_frames", shape=(count, neuron_sim.NUM_TIME_BINS, neuron_sim.NUM_FEATURES),
                      dtype=dtype)
    for key in ("_unitStar_par", "_phys_par"):
      h5.create_dataset(domain + key, shape=(count, neuron_sim.NUM_PAR), dtype=dtype)


def _normalised(traces, norm, dtype, rows=32):
  """(traces - mean) / std in float64, cast to dtype, a few rows at a time: the float64 temporaries then
  stay in cache (a quarter of the time of one pass over the whole batch)."""
  mean, std = norm
  frames = np.empty(traces.shape, dtype=dtype)
  for i in range(0, len(traces), rows):
    frames[i:i + rows] = ((traces[i:i + rows] - mean) / std).astype(dtype)
  return frames


def _write_batch(h5, domain, start, u, traces, norm, dtype):
  stop = start + len(u)
  h5[domain + "_frames"][start:stop] = _normalised(traces, norm, dtype)
  h5[domain + "_unitStar_par"][start:stop] = u.astype(dtype)
  h5[domain + "_phys_par"][start:stop] = neuron_sim.conductances(u).astype(dtype)


def _fill(h5, batches, num_norm, dtype, progress):
  """Writes every batch; the first num_norm training frames are held back until mean/std are known."""
  held, num_held, norm = [], 0, None
  for domain, start, u, traces in batches:
    if norm is None:
      held.append((domain, start, u, traces))
      num_held += len(u)
      if num_held < num_norm:
        continue
      raw = np.concatenate([b[3] for b in held])[:num_norm].astype(np.float64)
      norm = (raw.mean(axis=(0, 1)), raw.std(axis=(0, 1)))
      for batch in held:
        _write_batch(h5, *batch, norm=norm, dtype=dtype)
      progress.update(held[-1][0], sum(len(batch[2]) for batch in held), batches=len(held))
      held = []
      continue
    _write_batch(h5, domain, start, u, traces, norm, dtype)
    progress.update(domain, len(u))
  return norm


def _file_bytes(counts, dtype) -> int:
  """The size of the .h5 file for (train, val, test) sample counts: its contiguous datasets, plus a
  megabyte for HDF5's headers and meta.JSON."""
  values = neuron_sim.NUM_TIME_BINS * neuron_sim.NUM_FEATURES + 2 * neuron_sim.NUM_PAR
  return sum(counts) * values * np.dtype(dtype).itemsize + 2 ** 20


def _check_free_space(out_dir: str, needed: int, label: str) -> None:
  free = shutil.disk_usage(out_dir).free
  if free < needed:
    raise UserError("%s: the dataset needs %.0f MB, and the file system of %s has %.0f MB free (free "
                    "some space, or choose another folder)" % (label, needed / 1e6, out_dir, free / 1e6))
  hdf5_writes.check_size_limit(needed, "%s: the dataset" % label, "raise the limit")


def _write_failed(label: str, out_dir: str, path: str, needed: int, error: BaseException) -> UserError:
  """The one line for a write of the dataset that failed (its partial file already removed)."""
  if atomic_files.disk_full(error):  # filled up meanwhile by others
    return UserError("%s: the file system of %s filled up while the dataset was written (%.0f MB needed); "
                     "its partial file was removed" % (label, out_dir, needed / 1e6))
  return UserError("%s: %s; its partial file was removed"
                   % (label, atomic_files.write_error(path, hdf5_writes.plain_error(error))))


def _fsync(path: str) -> None:
  """The written bytes on the disk before the rename makes them the dataset."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def generate_dataset(out_dir: str, cell_name: str = "synth", num_train: int = 20000, num_val: int = 2000,
                     num_test: int = 2000, seed: int = 0, fp16: bool = False,
                     probe_type: str = "excite_4prB8kHz", batch_size: int = 1024, progress: bool = True,
                     workers: int = 1, label: str = None) -> str:
  """Simulates and writes one cell's dataset and the meta yaml; returns the path of the .h5 file.

  `workers` > 1 simulates batches in that many spawned processes (the same bits as 1 worker). `label`
  names the folder in error messages as the user gave it (default `--out_dir=<out_dir>`).
  """
  counts = (num_train, num_val, num_test)
  _check_args(out_dir, cell_name, counts, seed, batch_size, workers, probe_type)
  label = label or "--out_dir=%s" % out_dir
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as error:
    raise UserError("%s: cannot create it (%s)" % (label, error.strerror)) from None
  dtype = np.float16 if fp16 else np.float32
  path = os.path.join(out_dir, h5_name(cell_name))
  meta = {"dataInfo": _data_info(cell_name, counts, seed, fp16, probe_type)}
  for stale in atomic_files.remove_stale(path):
    logging.info("removed %s, the partial file of a generation on this host that was killed", stale)
  _check_free_space(out_dir, _file_bytes(counts, dtype), label)
  started = time.time()
  logging.info("generating %s: %d train, %d val, %d test samples, seed %d, %s, %d worker%s", path,
               num_train, num_val, num_test, seed, "fp16" if fp16 else "fp32", workers, "" if workers == 1 else "s")
  tmp = atomic_files.temporary_name(path)
  try:
    with hdf5_writes.created(tmp) as h5:
      _create_datasets(h5, counts, dtype)
      # Closed here however _fill ends: a Ctrl-C that lands in _fill, not in the generator, left it to
      # the garbage collector, which once ran its pool.join() on the pool's own thread at exit
      # ("cannot join current thread", Python 3.8).
      with contextlib.closing(_simulated(_batches(seed, counts, batch_size, workers), workers)) as batches:
        mean, std = _fill(h5, batches, min(NORM_SAMPLES, num_train), dtype,
                          _Progress(sum(counts), progress, workers))
      meta["packInfo"] = {"fnorm_mean": [float(x) for x in mean], "fnorm_std": [float(x) for x in std],
                          "fnorm_samples": int(min(NORM_SAMPLES, num_train)), "fnorm_domain": "train"}
      h5.create_dataset("meta.JSON", data=[json.dumps(meta)], dtype=h5py.special_dtype(vlen=str))
    _fsync(tmp)
    os.replace(tmp, path)
  except BaseException as error:
    if os.path.lexists(tmp):
      os.remove(tmp)
    if atomic_files.is_write_error(error) or isinstance(error, OSError):  # h5py's, its creation's too
      raise _write_failed(label, out_dir, path, _file_bytes(counts, dtype), error) from None
    raise
  atomic_files.write_text(os.path.join(out_dir, meta_yaml_name(probe_type)),
                     yaml.safe_dump(meta, default_flow_style=None, sort_keys=False, width=110))
  elapsed = time.time() - started
  logging.info("wrote %s (%.1f MB) in %.1f s: %.1f samples/s", path, os.path.getsize(path) / 1e6, elapsed,
               sum(counts) / elapsed)
  return path
