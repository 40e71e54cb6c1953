"""Input-pipeline benchmark: cellSpike HDF5 -> tf.data, against a raw h5py sequential read.

    python tools/benchmark_input.py --data_path=FILE.h5 --replicas=4 [--in_memory] [--passes=3]
        [--json=out.json]

Streams whole training epochs through the application's pipeline (no model): one warm-up pass, then
--passes timed passes, of which the median is reported, in samples/s of wall time and per CPU-second
(the second is what feeding costs the training job on a shared host). Then it reads the same rows
with plain h5py as the ceiling and prints the process's peak resident memory, so the memory bound of
streaming can be checked against the file size. Run the two modes in separate processes: peak RSS
only grows. `tools/benchmark.py` imports `time_pipeline` and `time_raw_read` from here.
"""

import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS


def define_flags():
  """Only when run as a program: importing this module must not define flags."""
  flags.DEFINE_string("data_path", None, "cellSpike .h5 file.", required=True)
  flags.DEFINE_integer("replicas", 1, "Shards to read, as for --replicas of main.py.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 192, "Local batch size.", lower_bound=1)
  flags.DEFINE_bool("in_memory", False, "Benchmark in-memory mode instead of streaming.")
  flags.DEFINE_integer("read_chunk", 512, "Rows per HDF5 read when streaming.", lower_bound=1)
  flags.DEFINE_integer("shuffle_buffer", 4096, "Rows shuffled together per replica.", lower_bound=1)
  flags.DEFINE_integer("passes", 3, "Timed passes over the training split (after one warm-up).",
                       lower_bound=1)
  flags.DEFINE_bool("raw", True, "Also time a raw sequential h5py read of the same rows.")
  flags.DEFINE_string("json", None, "Write the results to this JSON file.")


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def time_pipeline(config, replicas: int, passes: int = 3) -> dict:
  """Median rate of `passes` epochs of the training split, after a warm-up epoch."""
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from data.splits import BatchLayout  # pylint: disable=import-outside-toplevel
  info = cellspike.open_configured(config)
  split = cellspike.make_split(info, "train", config, BatchLayout(replicas, config.batch_size), 0, True, 0)
  bytes_per_sample = 4 * (info.time_bins * info.num_probes + info.num_params)  # float32 as fed
  walls, cpus = [], []
  for _ in range(passes + 1):  # every pass over the dataset is a new epoch of the generator
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in split.dataset:
      pass
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
  seconds, cpu_seconds = statistics.median(walls[1:]), statistics.median(cpus[1:])
  return {"samples": split.samples, "seconds": seconds, "samples_per_sec": split.samples / seconds,
          "samples_per_cpu_sec": split.samples / cpu_seconds,
          "gb_per_sec": split.samples * bytes_per_sample / seconds / 1e9,
          "file_gb": os.path.getsize(info.path) / 1e9}


def time_raw_read(path: str, samples: int, chunk: int = 4096) -> dict:
  """A sequential read of the first `samples` training rows with h5py: the ceiling for streaming."""
  import h5py  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  with h5py.File(path, "r") as f:
    frames, targets = f["train_frames"], f["train_unitStar_par"]
    nbytes = 0
    for s in range(0, samples, chunk):
      nbytes += frames[s:s + chunk].nbytes + targets[s:s + chunk].nbytes
  seconds = time.perf_counter() - start
  return {"samples_per_sec": samples / seconds, "gb_per_sec": nbytes / seconds / 1e9}


def main(argv):
  del argv
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies import environment  # pylint: disable=import-outside-toplevel
  config = RunConfig(model="neuron_inverter", data_path=FLAGS.data_path, batch_size=FLAGS.batch_size,
                     in_memory=FLAGS.in_memory, read_chunk=FLAGS.read_chunk,
                     shuffle_buffer=FLAGS.shuffle_buffer)
  environment.prepare(config)
  result = {"mode": "in_memory" if FLAGS.in_memory else "streaming", "replicas": FLAGS.replicas}
  result["pipeline"] = time_pipeline(config, FLAGS.replicas, FLAGS.passes)
  result["pipeline"]["peak_rss_mb"] = peak_rss_mb()
  if FLAGS.raw:
    result["raw_h5py"] = time_raw_read(FLAGS.data_path, result["pipeline"]["samples"])
  pipeline = result["pipeline"]
  print("%-22s %12s %14s %10s %14s" % ("", "samples/s", "samples/cpu-s", "GB/s", "peak RSS (MB)"))
  print("%-22s %12.0f %14.0f %10.2f %14.0f" % ("tf.data " + result["mode"], pipeline["samples_per_sec"],
                                               pipeline["samples_per_cpu_sec"], pipeline["gb_per_sec"],
                                               pipeline["peak_rss_mb"]))
  if FLAGS.raw:
    print("%-22s %12.0f %14s %10.2f" % ("raw h5py sequential", result["raw_h5py"]["samples_per_sec"], "",
                                        result["raw_h5py"]["gb_per_sec"]))
  print("file size %.2f GB" % pipeline["file_gb"])
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
