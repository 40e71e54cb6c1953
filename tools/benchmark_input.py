"""Input-pipeline benchmark: cellSpike HDF5 -> tf.data, against a raw h5py sequential read.

    python tools/benchmark_input.py --data_path=FILE.h5 --replicas=4 [--in_memory] [--json=out.json]

Streams one training epoch through the application's pipeline (no model), then reads the same rows with
plain h5py as the ceiling, and prints samples/s, GB/s and the process's peak resident memory, so the
memory bound of streaming can be checked against the file size. Run the two modes in separate processes:
peak RSS only grows.
"""

import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

from run_config import RunConfig  # noqa: E402  pylint: disable=wrong-import-position
from strategies import environment  # noqa: E402  pylint: disable=wrong-import-position

flags.DEFINE_string("data_path", None, "cellSpike .h5 file.", required=True)
flags.DEFINE_integer("replicas", 1, "Shards to read, as for --replicas of main.py.", lower_bound=1)
flags.DEFINE_integer("batch_size", 192, "Local batch size.", lower_bound=1)
flags.DEFINE_bool("in_memory", False, "Benchmark in-memory mode instead of streaming.")
flags.DEFINE_integer("read_chunk", 512, "Rows per HDF5 read when streaming.", lower_bound=1)
flags.DEFINE_integer("shuffle_buffer", 4096, "Rows shuffled together per replica.", lower_bound=1)
flags.DEFINE_bool("raw", True, "Also time a raw sequential h5py read of the same rows.")
flags.DEFINE_string("json", None, "Write the results to this JSON file.")
FLAGS = flags.FLAGS


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def time_pipeline(config: RunConfig, replicas: int) -> dict:
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from data.splits import BatchLayout  # pylint: disable=import-outside-toplevel
  info = cellspike.open_configured(config)
  split = cellspike.make_split(info, "train", config, BatchLayout(replicas, config.batch_size), 0, True, 0)
  bytes_per_sample = 4 * (info.time_bins * info.num_probes + info.num_params)  # float32 as fed
  start = time.perf_counter()
  for _ in split.dataset:
    pass
  seconds = time.perf_counter() - start
  return {"samples": split.samples, "seconds": seconds, "samples_per_sec": split.samples / seconds,
          "gb_per_sec": split.samples * bytes_per_sample / seconds / 1e9,
          "file_gb": os.path.getsize(info.path) / 1e9}


def time_raw_read(path: str, samples: int, chunk: int) -> dict:
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
  config = RunConfig(model="neuron_inverter", data_path=FLAGS.data_path, batch_size=FLAGS.batch_size,
                     in_memory=FLAGS.in_memory, read_chunk=FLAGS.read_chunk,
                     shuffle_buffer=FLAGS.shuffle_buffer)
  environment.prepare(config)
  result = {"mode": "in_memory" if FLAGS.in_memory else "streaming", "replicas": FLAGS.replicas}
  result["pipeline"] = time_pipeline(config, FLAGS.replicas)
  result["pipeline"]["peak_rss_mb"] = peak_rss_mb()
  if FLAGS.raw:
    result["raw_h5py"] = time_raw_read(FLAGS.data_path, result["pipeline"]["samples"], 4096)
  print("%-22s %12s %10s %14s" % ("", "samples/s", "GB/s", "peak RSS (MB)"))
  print("%-22s %12.0f %10.2f %14.0f" % ("tf.data " + result["mode"], result["pipeline"]["samples_per_sec"],
                                         result["pipeline"]["gb_per_sec"], result["pipeline"]["peak_rss_mb"]))
  if FLAGS.raw:
    print("%-22s %12.0f %10.2f" % ("raw h5py sequential", result["raw_h5py"]["samples_per_sec"],
                                   result["raw_h5py"]["gb_per_sec"]))
  print("file size %.2f GB" % result["pipeline"]["file_gb"])
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
