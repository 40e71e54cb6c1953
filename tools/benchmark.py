"""Neuron-Inverter benchmark on the current backend: training and inference throughput, input pipeline,
compile time (cold and with a warm executable cache), peak host memory; a table and JSON.

    python tools/benchmark.py [--designs=ontra4,dev] [--batch_size=192] [--precision=32.32]
        [--data_path=FILE.h5] [--json=benchmark.json] [--skip=compile,input]

Every measurement runs in its own process (so peak memory is its own) on the built-in dataset unless
--data_path is given. Throughput is samples/s per replica, after a warm-up window, the median of
--windows timed windows of --window_steps steps. Nothing here is asserted by the test suite.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

flags.DEFINE_list("designs", ["ontra4", "dev"], "Neuron-Inverter designs to measure.")
flags.DEFINE_integer("batch_size", 192, "Batch size per replica.", lower_bound=1)
flags.DEFINE_list("precisions", ["32.32", "16.32"], "--precision values of main.py to compare side by "
                  "side (32.32, 16.32, 16.16).")
flags.DEFINE_bool("jit_compile", False, "XLA-compile the steps.")
flags.DEFINE_integer("windows", 5, "Timed windows (the median is reported).", lower_bound=1)
flags.DEFINE_integer("window_steps", 30, "Steps per timed window.", lower_bound=1)
flags.DEFINE_string("data_path", None, "cellSpike .h5 file (default: the built-in dataset).")
flags.DEFINE_list("skip", [], "Parts to skip: train, inference, input, compile.")
flags.DEFINE_string("json", None, "Write all results to this JSON file.")
flags.DEFINE_string("child", None, "Internal: run one measurement (kind:design) and print JSON.")
FLAGS = flags.FLAGS


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _prepare():
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies import environment  # pylint: disable=import-outside-toplevel
  config = RunConfig(model="neuron_inverter", backend="cpu", batch_size=FLAGS.batch_size,
                     precision=FLAGS.precisions[0], jit_compile=FLAGS.jit_compile,
                     data_path=FLAGS.data_path, in_memory=True, cache_dir="")
  environment.prepare(config)
  return config


def flops_per_sample(net) -> int:
  """Forward multiply-adds x 2 of the Conv1D and Dense layers (the rest is negligible)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  total = 0
  for layer in net.layers:
    if isinstance(layer, tf.keras.layers.Conv1D):
      _, length, out_channels = layer.output_shape
      kernel, in_channels = layer.kernel_size[0], layer.input_shape[-1]
      total += 2 * length * out_channels * in_channels * kernel
    elif isinstance(layer, tf.keras.layers.Dense):
      total += 2 * layer.input_shape[-1] * layer.units
  return total


def _model_and_batches(config, design):
  """A compiled model and a cached, repeating dataset of real batches (the input is not measured here)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from data.splits import BatchLayout  # pylint: disable=import-outside-toplevel
  from strategies.select import select_backend  # pylint: disable=import-outside-toplevel
  from training.loop import build_and_compile  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  config = dataclasses.replace(config, design=design, steps_per_epoch=8, eval_steps=1)
  backend = select_backend(config)
  splits = cellspike.load(config, BatchLayout(1, config.batch_size))
  net = build_and_compile(config, backend, model.get_model_module("neuron_inverter"), splits)
  return net, splits.train.dataset.cache().repeat()


def _timed_windows(run_window) -> dict:
  run_window()  # warm-up: tracing, compilation, first allocations
  rates = []
  for _ in range(FLAGS.windows):
    start = time.perf_counter()
    run_window()
    rates.append(FLAGS.window_steps * FLAGS.batch_size / (time.perf_counter() - start))
  return {"samples_per_sec": statistics.median(rates), "windows": rates}


def child_train(config, design) -> dict:
  """One fit() call, one epoch per window: the first is the warm-up, the rest are timed."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  net, dataset = _model_and_batches(config, design)
  seconds = []
  timer = tf.keras.callbacks.LambdaCallback(
      on_epoch_begin=lambda epoch, logs: seconds.append(-time.perf_counter()),
      on_epoch_end=lambda epoch, logs: seconds.__setitem__(-1, seconds[-1] + time.perf_counter()))
  net.fit(dataset, steps_per_epoch=FLAGS.window_steps, epochs=FLAGS.windows + 1, verbose=0,
          callbacks=[timer])
  rates = [FLAGS.window_steps * FLAGS.batch_size / s for s in seconds[1:]]
  result = {"samples_per_sec": statistics.median(rates), "windows": rates}
  result["flops_per_sample_forward"] = flops_per_sample(net)
  return result


def child_inference(config, design) -> dict:
  net, dataset = _model_and_batches(config, design)
  frames = dataset.map(lambda x, y: x)
  return _timed_windows(lambda: net.predict(frames, steps=FLAGS.window_steps, verbose=0))


def child_input(config, design) -> dict:
  del design
  import dataclasses  # pylint: disable=import-outside-toplevel
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from data.splits import BatchLayout  # pylint: disable=import-outside-toplevel
  results = {}
  for mode, in_memory in (("streaming", False), ("in_memory", True)):
    mode_config = dataclasses.replace(config, in_memory=in_memory)
    info = cellspike.open_configured(mode_config)
    split = cellspike.make_split(info, "train", mode_config, BatchLayout(1, config.batch_size), 0, True, 0)
    start = time.perf_counter()
    for _ in split.dataset:
      pass
    seconds = time.perf_counter() - start
    row_bytes = 4 * (info.time_bins * info.num_probes + info.num_params)
    results[mode] = {"samples_per_sec": split.samples / seconds,
                     "gb_per_sec": split.samples * row_bytes / seconds / 1e9}
  import h5py  # pylint: disable=import-outside-toplevel
  start, nbytes = time.perf_counter(), 0
  with h5py.File(info.path, "r") as f:
    for s in range(0, split.samples, 4096):
      nbytes += f["train_frames"][s:s + 4096].nbytes + f["train_unitStar_par"][s:s + 4096].nbytes
  seconds = time.perf_counter() - start
  results["raw_h5py"] = {"samples_per_sec": split.samples / seconds, "gb_per_sec": nbytes / seconds / 1e9}
  return results


def _run_child(kind: str, design: str, precision: str) -> dict:
  args = [sys.executable, os.path.abspath(__file__), "--child=%s:%s" % (kind, design),
          "--batch_size=%d" % FLAGS.batch_size, "--precisions=" + precision,
          "--windows=%d" % FLAGS.windows, "--window_steps=%d" % FLAGS.window_steps,
          "--%sjit_compile" % ("" if FLAGS.jit_compile else "no")]
  if FLAGS.data_path:
    args.append("--data_path=" + FLAGS.data_path)
  output = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT)
  if output.returncode != 0:
    raise SystemExit("benchmark %s:%s failed:\n%s" % (kind, design, output.stderr[-2000:]))
  return json.loads(output.stdout.strip().splitlines()[-1])


def _compile_times(design: str, precision: str) -> dict:
  """First-step time of main.py --compile_only, cold and then with the executable cache warm."""
  cache = tempfile.mkdtemp(prefix="benchmark-cache-")
  times = {}
  for label in ("cold", "warm_cache"):
    args = [sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter",
            "--design=" + design, "--backend=cpu", "--compile_only", "--jit_compile",
            "--cache_dir=" + cache, "--batch_size=%d" % FLAGS.batch_size, "--precision=" + precision,
            "--logdir=" + tempfile.mkdtemp(prefix="benchmark-run-"), "--steps_per_epoch=2", "--eval_steps=1"]
    if FLAGS.data_path:
      args.append("--data_path=" + FLAGS.data_path)
    output = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT)
    match = [line for line in output.stderr.splitlines() if "--compile_only: compiled in" in line]
    times[label] = float(match[-1].split("compiled in")[1].split()[0]) if match else None
  return times


def main(argv):
  del argv
  if FLAGS.child:
    kind, design = FLAGS.child.split(":")
    config = _prepare()
    result = {"train": child_train, "inference": child_inference, "input": child_input}[kind](config, design)
    result["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(result))
    return
  results = {"batch_size": FLAGS.batch_size, "jit_compile": FLAGS.jit_compile, "precisions": {}}
  for precision in FLAGS.precisions:
    for design in FLAGS.designs:
      row = results["precisions"].setdefault(precision, {}).setdefault(design, {})
      for kind in ("train", "inference"):
        if kind not in FLAGS.skip:
          row[kind] = _run_child(kind, design, precision)
      if "compile" not in FLAGS.skip:
        row["compile_seconds"] = _compile_times(design, precision)
  if "input" not in FLAGS.skip:
    results["input"] = _run_child("input", FLAGS.designs[0], FLAGS.precisions[0])
  _print_table(results)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(results, f, indent=1)


def _print_table(results) -> None:
  print("\nbatch %d per replica, jit_compile %s" % (results["batch_size"], results["jit_compile"]))
  print("%-6s %-8s %13s %13s %11s %9s %10s %13s %8s" % (
      "prec", "design", "train samp/s", "infer samp/s", "GFLOP/samp", "GFLOP/s", "compile s",
      "warm cache s", "peak MB"))
  rows = [(p, d, row) for p, designs in results["precisions"].items() for d, row in designs.items()]
  for precision, design, row in rows:
    train, infer = row.get("train", {}), row.get("inference", {})
    compile_s = row.get("compile_seconds", {})
    train_flops = 3 * train.get("flops_per_sample_forward", 0)  # forward + two backward products
    print("%-6s %-8s %13.0f %13.0f %11.4f %9.1f %10s %13s %8.0f" % (
        precision, design, train.get("samples_per_sec", 0), infer.get("samples_per_sec", 0), train_flops / 1e9,
        train.get("samples_per_sec", 0) * train_flops / 1e9, compile_s.get("cold"),
        compile_s.get("warm_cache"), max(train.get("peak_rss_mb", 0), infer.get("peak_rss_mb", 0))))
  if "input" in results:
    for mode in ("streaming", "in_memory", "raw_h5py"):
      entry = results["input"][mode]
      print("input %-10s %12.0f samples/s %8.2f GB/s" % (mode, entry["samples_per_sec"], entry["gb_per_sec"]))
    print("input peak RSS %.0f MB" % results["input"]["peak_rss_mb"])


if __name__ == "__main__":
  app.run(main)
