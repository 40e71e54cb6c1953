"""The sizes a run's flags imply, checked before TensorFlow starts against the data the checks before it
read (`data.check_named_files`) and against this machine: a count the data or the machine cannot hold
is one `error:` line at once, not minutes of set-up (or an exhausted memory) later.

- Every replica reads a block of its own of each split (data/cellspike.py `shard_blocks`, data/splits.py
  `count_steps`): the training split must hold a whole global batch, --replicas x --batch_size x
  --gradient_accumulation rows, and each evaluation split one sample per replica.
- With --backend=cpu, at most `cpuinfo.MAX_CPU_REPLICAS` replicas (logical CPU devices). With
  --backend=auto, the backend is known only once TensorFlow is imported: strategies/cpu.py checks it
  there, before it makes any device.
- Host memory (psutil's `available`): --in_memory holds this process's share of every split; streaming
  holds at least `BATCHES_HELD` batches per replica (queued and being gathered).

--shuffle_buffer and --read_chunk allocate nothing of their size: they set how the visiting order is
drawn (data/cellspike.py `epoch_rows`), and values beyond a replica's block act as the whole block.
The built-in datasets are sized when they are loaded, after the backend (whose replicas are bounded
as above); their sizes are fixed, so a refusal there comes within seconds too.
"""

import os
import sys

from errors import UserError
from host import cpuinfo

BATCHES_HELD = 4  # per replica at least: 2 queued ahead of the step, 2 gathered (data/cellspike.py)


def check(config, read) -> None:
  """A UserError for a size that `config`'s flags imply and that the data `read` by
  data.check_named_files (a CellSpikeFile, MNIST's digits by split, or None) or this machine cannot
  hold."""
  if config.backend == "cpu":
    problem = cpuinfo.cpu_replicas_problem(config.replicas)
    if problem:
      raise UserError(problem)
  rows, row_bytes, source = _split_rows(read)
  if rows:
    _check_batches_fit(config, rows, source)
  if row_bytes:
    _check_memory(config, rows, row_bytes, source)


def _split_rows(read) -> tuple:
  """({split: rows}, bytes per sample, where from) of what the checks read; ({}, 0, "") if nothing."""
  # Each kind's module is loaded where its check read something (an MNIST run imports no h5py).
  cellspike_file, mnist_files = sys.modules.get("data.cellspike_file"), sys.modules.get("data.mnist_files")
  if cellspike_file and isinstance(read, cellspike_file.CellSpikeFile):
    itemsize = max(info.dtype.itemsize for info in read.splits.values())
    row_bytes = itemsize * (read.time_bins * read.num_probes + read.num_params)
    return {split: info.num_samples for split, info in read.splits.items()}, row_bytes, read.path
  if mnist_files and isinstance(read, dict) and read and all(isinstance(v, mnist_files.Digits)
                                                             for v in read.values()):
    return {split: len(digits.x) for split, digits in read.items()}, 0, "the IDX files"
  return {}, 0, ""


def _step_rows(config) -> int:
  return config.replicas * config.batch_size * config.gradient_accumulation


def _step_flags(config) -> str:
  text = "--replicas=%d x --batch_size=%d" % (config.replicas, config.batch_size)
  if config.gradient_accumulation > 1:
    text += " x --gradient_accumulation=%d" % config.gradient_accumulation
  return text


def _check_batches_fit(config, rows: dict, source: str) -> None:
  train = rows.get("train")
  if train is not None and train < _step_rows(config):
    raise UserError("%s = %d rows per training step, more than the %d of the train split of %s: lower "
                    "--replicas or --batch_size%s" % (
                        _step_flags(config), _step_rows(config), train, source,
                        " or --gradient_accumulation" if config.gradient_accumulation > 1 else ""))
  for split, count in sorted(rows.items()):
    if split != "train" and count < config.replicas:
      raise UserError("--replicas=%d is more than the %d samples of the %s split of %s: every replica "
                      "evaluates a part of its own; use at most --replicas=%d"
                      % (config.replicas, count, split, source, count))


def processes() -> int:
  """The processes the run's data is shared between, as the launcher's environment says (srun, poprun,
  TF_CONFIG); 1 where it says nothing. Each holds its own replicas' share."""
  counts = [1]
  for variable in ("SLURM_STEP_NUM_TASKS", "POPDIST_NUM_INSTANCES"):
    value = os.environ.get(variable, "")
    counts.append(int(value) if value.isdigit() else 1)
  if os.environ.get("TF_CONFIG"):
    import json  # pylint: disable=import-outside-toplevel
    try:
      cluster = json.loads(os.environ["TF_CONFIG"]).get("cluster", {})
      counts.append(sum(len(cluster.get(kind, [])) for kind in ("chief", "worker")))
    except (ValueError, AttributeError, TypeError):
      pass  # the backend reports a malformed TF_CONFIG
  return max(counts)


def _gb(count: float) -> str:
  return "%.1f GB" % (count / 1e9)


def _check_memory(config, rows: dict, row_bytes: int, source: str) -> None:
  import psutil  # pylint: disable=import-outside-toplevel  (only where a file's sizes are known)
  memory = psutil.virtual_memory()
  share = processes()
  if config.in_memory:
    held = sum(rows.values()) * row_bytes // share
    if held > memory.available:
      raise UserError("--in_memory would hold %s of %s in host memory (%d samples of %d bytes%s); this "
                      "machine has %s available (of %s): stream the file instead (drop --in_memory)"
                      % (_gb(held), source, sum(rows.values()), row_bytes,
                         ", this process's share of %d" % share if share > 1 else "",
                         _gb(memory.available), _gb(memory.total)))
  replica_rows = config.batch_size * config.gradient_accumulation
  local_replicas = max(1, config.replicas // share)
  held = BATCHES_HELD * local_replicas * replica_rows * row_bytes
  if held > memory.available:
    raise UserError("%s: the input pipeline would hold at least %s of batches (%d per replica of %d samples "
                    "of %d bytes, from %s); this machine has %s available (of %s): lower --batch_size or "
                    "--replicas" % (_step_flags(config), _gb(held), BATCHES_HELD, replica_rows, row_bytes,
                                    source, _gb(memory.available), _gb(memory.total)))
