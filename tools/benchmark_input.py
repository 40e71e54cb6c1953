"""Input-pipeline benchmark: what a host can feed, to size it for N IPUs or GPUs.

    python tools/benchmark_input.py --data_path=FILE.h5 --replicas=4 [--in_memory] [--passes=3]
        [--json=out.json]

Streams whole training epochs of the application's pipeline (no model) through one iterator, as
Keras reads it: one warm-up pass, then --passes timed passes; throughput is total samples over total
time. It reports samples/s, GB/s (bytes as they cross to the device, in the file's dtype) and the
CPU-seconds per 1,000 samples (all threads of the process: what feeding costs a shared host). Then the
ceilings: the same rows read with plain h5py, sequentially in one process and by one process per
replica in parallel. The last line says how many devices of which kind that host could keep busy,
against the published per-device rates of this network. Peak and current resident memory are printed
(the memory-mapped file's pages count as RssFile: page cache, not memory the pipeline holds). Run the
two modes in separate processes: peak RSS only grows. `tools/benchmark.py` imports `time_pipeline`
and `time_raw_read` from here.
"""

import json
import multiprocessing
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import parse_flags, report_missing_packages, with_one_line_errors  # noqa: E402  pylint: disable=wrong-import-position
from stop_signals import leave_interrupts_to_the_parent  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing
from host import atomic_files  # noqa: E402  pylint: disable=wrong-import-position

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

from flags import register_data_path_checks  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS

# Published training rates of this network per device (samples/s), from the reference's figures
# (balewski/neuron_inverter_benchmark; docs/performance.md, "Input pipeline"): M2000 IPU 61,000 alone,
# ~40,000 each at 4; a Bow IPU up to 1.4x an M2000 one; one A100 68,000.
DEVICE_RATES = (("M2000 IPUs (4-way, 40,000 each)", 40000), ("Bow IPUs (up to 85,000 each)", 85000),
                ("A100 GPUs (68,000 each)", 68000))


def define_flags():
  """Only when run as a program: importing this module must not define flags."""
  flags.DEFINE_string("data_path", None, "cellSpike .h5 file.", required=True)
  flags.DEFINE_integer("replicas", 1, "Shards to read, as for --replicas of main.py.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 192, "Local batch size.", lower_bound=1)
  flags.DEFINE_bool("in_memory", False, "Benchmark in-memory mode instead of streaming.")
  flags.DEFINE_integer("read_chunk", 512, "Rows per streaming chunk.", lower_bound=1)
  flags.DEFINE_integer("shuffle_buffer", 4096, "Rows shuffled together per replica.", lower_bound=1)
  flags.DEFINE_integer("passes", 3, "Timed passes over the training split (after one warm-up).",
                       lower_bound=1)
  flags.DEFINE_bool("raw", True, "Also time raw h5py reads of the same rows (sequential, parallel).")
  flags.DEFINE_string("json", None, "Write the results to this JSON file.")
  register_data_path_checks(flags.FLAGS)


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def rss_parts_mb() -> dict:
  """Current RssAnon (memory the process owns) and RssFile (mapped file pages) in MB, Linux only."""
  parts = {}
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(("RssAnon:", "RssFile:")):
          parts[line.split(":")[0].lower()] = int(line.split()[1]) / 1024.0
  except OSError:
    pass
  return parts


def _consumer(dataset):
  """A compiled loop that pulls `n` elements from one iterator of `dataset` (no Python per element)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  iterator = iter(dataset)

  @tf.function
  def pull(n):
    rows = tf.constant(0, tf.int64)
    for _ in tf.range(n):
      rows += tf.shape(next(iterator)[0], out_type=tf.int64)[0]
    return rows
  return pull


def time_pipeline(config, replicas: int, passes: int = 3) -> dict:
  """Throughput of `passes` epochs of the training split through one iterator, after a warm-up epoch."""
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from data.splits import BatchLayout  # pylint: disable=import-outside-toplevel
  from stderr_lines import DroppedLines  # pylint: disable=import-outside-toplevel
  from training.logs import ONE_OFF_NATIVE_LINES  # pylint: disable=import-outside-toplevel
  info = cellspike.open_configured(config)
  layout = BatchLayout(replicas, config.batch_size)
  split = cellspike.split_from_file(info, "train", config, layout, first_epoch=0, shuffle=True, max_steps=0)
  itemsize = info.splits["train"].dtype.itemsize
  bytes_per_sample = itemsize * (info.time_bins * info.num_probes + info.num_params)
  with DroppedLines(ONE_OFF_NATIVE_LINES):  # TensorFlow's one-off lines, dropped as in main.py's log
    pull = _consumer(split.epochs_from(0))
    pull(split.steps)  # warm-up: tracing, the file's pages mapped
  wall, cpu = time.perf_counter(), time.process_time()
  rows = int(pull(split.steps * passes))
  seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
  return {"samples": rows, "epoch_samples": split.samples, "seconds": seconds, "samples_per_sec": rows / seconds,
          "cpu_seconds_per_1000": cpu_seconds / rows * 1000, "gb_per_sec": rows * bytes_per_sample / seconds / 1e9,
          "bytes_per_sample": bytes_per_sample, "file_gb": os.path.getsize(info.path) / 1e9}


def _import_h5py(_) -> None:
  import h5py  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import


def _read_rows(args) -> int:
  path, start, stop, chunk = args
  import h5py  # pylint: disable=import-outside-toplevel
  nbytes = 0
  with h5py.File(path, "r") as f:
    frames, targets = f["train_frames"], f["train_unitStar_par"]
    for s in range(start, stop, chunk):
      nbytes += frames[s:min(s + chunk, stop)].nbytes + targets[s:min(s + chunk, stop)].nbytes
  return nbytes


def time_raw_read(path: str, samples: int, processes: int = 1, chunk: int = 4096) -> dict:
  """The first `samples` training rows read with h5py, in `processes` disjoint blocks: the ceiling."""
  per = samples // processes
  jobs = [(path, i * per, (i + 1) * per, chunk) for i in range(processes)]
  start = time.perf_counter()
  if processes == 1:
    nbytes = _read_rows(jobs[0])
  else:
    with multiprocessing.get_context("spawn").Pool(processes, initializer=leave_interrupts_to_the_parent) as pool:
      pool.map(_import_h5py, range(processes))  # the pool's start-up is not reading
      start = time.perf_counter()
      nbytes = sum(pool.map(_read_rows, jobs))
  seconds = time.perf_counter() - start
  return {"samples_per_sec": per * processes / seconds, "gb_per_sec": nbytes / seconds / 1e9,
          "processes": processes}


def feeds_line(rate: float, devices: int) -> str:
  """What `rate` samples/s means for `devices` accelerators at the published per-device rates."""
  each = rate / devices
  verdicts = ["%s: %s" % (name, "yes" if each >= need else "no (%.0f%%)" % (100 * each / need))
              for name, need in DEVICE_RATES]
  return "feeds %d device(s) at %.0f samples/s each; enough for %s" % (devices, each, "; ".join(verdicts))


def main(argv):
  del argv
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies import environment, start  # pylint: disable=import-outside-toplevel
  from host.output_paths import check_output_path  # pylint: disable=import-outside-toplevel
  if FLAGS.json:  # checked first: a mistyped path would fail after the benchmark
    check_output_path("--json", FLAGS.json)
  config = RunConfig(model="neuron_inverter", data_path=FLAGS.data_path, batch_size=FLAGS.batch_size,
                     in_memory=FLAGS.in_memory, read_chunk=FLAGS.read_chunk,
                     shuffle_buffer=FLAGS.shuffle_buffer)
  environment.prepare(config)
  start.import_tensorflow(config)
  result = {"mode": "in_memory" if FLAGS.in_memory else "streaming", "replicas": FLAGS.replicas}
  result["pipeline"] = time_pipeline(config, FLAGS.replicas, FLAGS.passes)
  result["pipeline"]["peak_rss_mb"] = peak_rss_mb()
  result["pipeline"].update(rss_parts_mb())
  pipeline = result["pipeline"]
  rows = [("tf.data " + result["mode"], pipeline)]
  if FLAGS.raw:
    result["raw_h5py"] = time_raw_read(FLAGS.data_path, pipeline["epoch_samples"])
    rows.append(("raw h5py sequential", result["raw_h5py"]))
    if FLAGS.replicas > 1:
      result["raw_h5py_parallel"] = time_raw_read(FLAGS.data_path, pipeline["epoch_samples"],
                                                  FLAGS.replicas)
      rows.append(("raw h5py, %d processes" % FLAGS.replicas, result["raw_h5py_parallel"]))
  print("%-26s %12s %10s %16s" % ("", "samples/s", "GB/s", "CPU-s/1000"))
  for name, entry in rows:
    cpu = entry.get("cpu_seconds_per_1000")
    print("%-26s %12.0f %10.2f %16s" % (name, entry["samples_per_sec"], entry["gb_per_sec"],
                                        "%.4f" % cpu if cpu is not None else ""))
  if FLAGS.raw:
    print("pipeline / raw sequential: %.2f" % (pipeline["samples_per_sec"]
                                               / result["raw_h5py"]["samples_per_sec"]))
  print("%d bytes per sample to the device; file %.2f GB; peak RSS %.0f MB (now: anon %.0f MB, mapped "
        "file %.0f MB)" % (pipeline["bytes_per_sample"], pipeline["file_gb"], pipeline["peak_rss_mb"],
                           pipeline.get("rssanon", float("nan")), pipeline.get("rssfile", float("nan"))))
  print(feeds_line(pipeline["samples_per_sec"], FLAGS.replicas))
  if FLAGS.json:
    with atomic_files.replaced(FLAGS.json) as f:  # whole or not at all, never through a link
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(with_one_line_errors(main), flags_parser=parse_flags)  # bad flag: `error:` line, exit 2
