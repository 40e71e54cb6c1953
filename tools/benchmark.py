"""Neuron-Inverter benchmark on the current backend: training and inference throughput, side by side
with the reference PyTorch model, input pipeline, compile time (cold and with a warm executable
cache), peak host memory; a table and JSON.

    python tools/benchmark.py [--designs=ontra4,dev] [--batch_size=192] [--precisions=auto|32.32,16.32]
        [--replicas=1] [--rounds=3] [--reference_python=.venv-torch/bin/python] [--data_path=FILE.h5]
        [--autotune=on|off] [--json=benchmark.json] [--skip=reference,compile,input]

Every measurement runs in its own process (so peak memory is its own) on the built-in dataset unless
--data_path is given. Throughput is samples/s of all --replicas together (one by default), after a
warm-up window, the median of --windows timed windows of --window_steps steps. `--replicas=4
--batch_size=48` measures the default job's layout (4 replicas of 48 rows, their ops side by side on
the cores, as main.py runs them); the reference then trains the same 192 rows per step in one process
on all cores. Training is measured in --rounds rounds; in each round
the reference PyTorch model (`tools/reference_torch.py`, run by --reference_python) and this
application train one after the other at the same precision, so both see the machine in the same
state, and the reported speed-up is the median of the per-round ratios (a line under the table gives
every round's figures and how far the timed windows of one round lay apart). The application trains with
the convolution forms `main.py --autotune` would choose on this machine for this batch layout (timed
by the first measurement that needs them, then read from --cache_dir). The CPU is named in the table
and the JSON. Nothing here is asserted by the test suite.
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

from errors import parse_flags, report_missing_packages, with_one_line_errors  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing
from host import atomic_files  # noqa: E402  pylint: disable=wrong-import-position

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position
from flags import PRECISIONS, register_data_path_checks  # noqa: E402  pylint: disable=wrong-import-position
from model.neuron_inverter.designs import DESIGNS  # noqa: E402  pylint: disable=wrong-import-position

flags.DEFINE_list("designs", ["ontra4", "dev"], "Neuron-Inverter designs to measure.")
flags.DEFINE_integer("batch_size", 192, "Batch size per replica.", lower_bound=1)
flags.DEFINE_integer("replicas", 1, "Replicas of the application, as main.py --replicas (the default "
                     "job has 4); the throughput counts them all.", lower_bound=1)
flags.DEFINE_list("precisions", ["auto"], "--precision values of main.py to compare side by side "
                  "(32.32, 16.32, 16.16); auto: 32.32, and 16.32 where main.py's --precision=auto "
                  "picks it.")
flags.DEFINE_bool("jit_compile", False, "XLA-compile the steps.")
flags.DEFINE_integer("windows", 5, "Timed windows (the median is reported).", lower_bound=1)
flags.DEFINE_integer("window_steps", 30, "Steps per timed window.", lower_bound=1)
flags.DEFINE_string("data_path", None, "cellSpike .h5 file (default: the built-in dataset).")
flags.DEFINE_integer("rounds", 3, "Training rounds (ours and the reference alternate in each).",
                     lower_bound=1)
flags.DEFINE_string("reference_python", os.path.join(REPO_ROOT, ".venv-torch", "bin", "python"),
                    "Python with PyTorch for tools/reference_torch.py (make bench-reference builds it); "
                    "the reference is skipped if it does not exist.")
flags.DEFINE_integer("compile_pairs", 3, "Cold/warm-cache start-up pairs per design and precision.",
                     lower_bound=1)
flags.DEFINE_list("skip", [], "Parts to skip: train, reference, inference, input, compile, peak.")
flags.DEFINE_enum("autotune", "on", ["on", "off"], "on: train with the convolution forms main.py's "
                  "--autotune chooses on this machine (timed once, kept in --cache_dir); off: the "
                  "model's built-in forms for this hardware.")
flags.DEFINE_string("cache_dir", None, "Where the autotune results are kept (default: main.py's "
                    "--cache_dir default, so the benchmark and the application share them).")
flags.DEFINE_integer("matmul_size", 2048, "Side of the square matmul behind the peak GFLOP/s.",
                     lower_bound=16)
flags.DEFINE_string("json", None, "Write all results to this JSON file.")
flags.DEFINE_string("child", None, "Internal: run one measurement (kind:design) and print JSON.")
FLAGS = flags.FLAGS
SKIPPABLE = ("train", "reference", "inference", "input", "compile", "peak")


def _all_in(valid, what: str):
  """A flag validator: every listed value is one of `valid` (absl then names the flag and its value)."""
  def check(values):
    unknown = [value for value in values if value not in valid]
    if unknown:
      raise flags.ValidationError("%s %s: valid %s are %s"
                                  % (what, ", ".join(unknown), what, ", ".join(valid)))
    return True
  return check


register_data_path_checks(flags.FLAGS)
flags.register_validator("designs", _all_in(tuple(DESIGNS), "designs"))
flags.register_validator("precisions", _all_in(PRECISIONS, "precisions"))
flags.register_validator("skip", _all_in(SKIPPABLE, "parts"))
flags.register_multi_flags_validator(
    ["jit_compile", "replicas"], lambda values: not (values["jit_compile"] and values["replicas"] > 1),
    "--jit_compile trains one CPU replica only, as in main.py: use --replicas=1 with it")


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _prepare():
  """The measurement's run config, after TensorFlow's start-up environment is set (in every process)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies import environment, start  # pylint: disable=import-outside-toplevel
  config = RunConfig(model="neuron_inverter", backend="cpu", batch_size=FLAGS.batch_size,
                     replicas=FLAGS.replicas, precision=FLAGS.precisions[0], jit_compile=FLAGS.jit_compile,
                     in_memory=True, cache_dir="", autotune=FLAGS.autotune)
  environment.prepare(config)  # without an XLA persistent cache: compile times are measured apart
  start.import_tensorflow(config)
  return dataclasses.replace(config, data_path=_data_path(),
                             cache_dir=FLAGS.cache_dir or RunConfig.cache_dir)


def flops_per_sample(net) -> int:
  """Forward multiply-adds x 2 of the Conv1D and Dense layers (the rest is negligible)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  total = 0
  for layer in net.layers:
    kernel = getattr(layer, "kernel", None)
    if kernel is not None and len(kernel.shape) == 3:  # Conv1D, or the fused PooledConv1D
      # The design's (width, in, out) kernel: padded channels are not counted as useful work.
      width, in_channels, out_channels = layer.kernel.shape
      length = layer.input_shape[1] - width + 1
      total += 2 * length * out_channels * in_channels * width
    elif isinstance(layer, tf.keras.layers.Dense):
      total += 2 * layer.input_shape[-1] * layer.units
  return total


def _model_and_batches(config, design):
  """A compiled model, a cached, repeating dataset of real batches (the input is not measured here),
  and the form of its layers it was built with and how it was chosen (as summary.yaml records them)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from strategies.select import select_backend  # pylint: disable=import-outside-toplevel
  from training.loop import build_and_compile, chosen_form  # pylint: disable=import-outside-toplevel
  from training.summary import forms_record  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  from model.neuron_inverter.designs import DESIGNS  # pylint: disable=import-outside-toplevel
  # The reference's network, dropout included, as the PyTorch side trains it.
  config = dataclasses.replace(config, model_options=dict(config.model_options, design=design),
                               dropout=DESIGNS[design]["dropout"], steps_per_epoch=8, eval_steps=1)
  backend = select_backend(config)
  splits = cellspike.load(config, backend.layout(config.batch_size))
  module = model.get_model_module("neuron_inverter")
  form, chosen_by = chosen_form(config, backend, module, splits, FLAGS.window_steps * (FLAGS.windows + 1))
  net = build_and_compile(config, backend, module, splits, form=form)
  return net, splits.train.dataset.cache().repeat(), forms_record(form, chosen_by)


def _step_rows() -> int:
  """Rows per optimizer step: a batch per replica. The reference trains batches of this size."""
  return FLAGS.batch_size * FLAGS.replicas


def _window_samples() -> int:
  return FLAGS.window_steps * _step_rows()


def _timed_windows(run_window) -> dict:
  run_window()  # warm-up: tracing, compilation, first allocations
  rates = []
  for _ in range(FLAGS.windows):
    start = time.perf_counter()
    run_window()
    rates.append(_window_samples() / (time.perf_counter() - start))
  return {"samples_per_sec": statistics.median(rates), "windows": rates}


def child_train(config, design) -> dict:
  """One fit() call, one epoch per window: the first is the warm-up, the rest are timed."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  net, dataset, forms = _model_and_batches(config, design)
  seconds = []
  timer = tf.keras.callbacks.LambdaCallback(
      on_epoch_begin=lambda epoch, logs: seconds.append(-time.perf_counter()),
      on_epoch_end=lambda epoch, logs: seconds.__setitem__(-1, seconds[-1] + time.perf_counter()))
  net.fit(dataset, steps_per_epoch=FLAGS.window_steps, epochs=FLAGS.windows + 1, verbose=0,
          callbacks=[timer])
  rates = [_window_samples() / s for s in seconds[1:]]
  result = {"samples_per_sec": statistics.median(rates), "windows": rates, **forms,
            "replicas": net.distribute_strategy.num_replicas_in_sync}
  result["flops_per_sample_forward"] = flops_per_sample(net)
  # The machine's float32 ceiling of this moment: the VM's speed drifts between rounds.
  result["matmul_gflops_float32"] = _matmul_gflops("float32", repeats=5)
  return result


def _matmul_gflops(dtype: str, repeats: int) -> float:
  """The best of 3 timings of `repeats` square matmuls of side --matmul_size, in GFLOP/s of the whole
  machine: where each op runs on one thread (several replicas side by side), one matmul per core at once."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from host import cpuinfo  # pylint: disable=import-outside-toplevel
  size = FLAGS.matmul_size
  streams = cpuinfo.usable_cores() if tf.config.threading.get_intra_op_parallelism_threads() == 1 else 1
  # Distinct inputs: identical products would be merged into one by the graph optimizer.
  inputs = [tf.cast(tf.random.uniform((size, size), dtype=tf.float32), dtype) for _ in range(streams)]
  product = tf.function(lambda *matrices: [tf.matmul(m, m) for m in matrices])
  product(*inputs)[0].numpy()  # warm-up
  rates = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(repeats):
      results = product(*inputs)
    _ = [result.numpy() for result in results]
    rates.append(2 * size ** 3 * repeats * streams / (time.perf_counter() - start) / 1e9)
  return max(rates)


def child_matmul_peak(config, design) -> dict:
  """GFLOP/s of a large square matmul per dtype: the practical ceiling to read model throughput against.
  bfloat16 only where the CPU has bfloat16 units: elsewhere it is emulated, and no ceiling of the
  application, which trains in float32 there."""
  del config, design
  from strategies import cpu  # pylint: disable=import-outside-toplevel
  dtypes = ("float32", "bfloat16") if cpu.has_bfloat16_units() else ("float32",)
  return {"gflops": {dtype: _matmul_gflops(dtype, repeats=20) for dtype in dtypes},
          "matmul_size": FLAGS.matmul_size}


def child_inference(config, design) -> dict:
  net, dataset, forms = _model_and_batches(config, design)
  frames = dataset.map(lambda x, y: x)
  return dict(_timed_windows(lambda: net.predict(frames, steps=FLAGS.window_steps, verbose=0)), **forms)


def child_input(config, design) -> dict:
  """The application's streaming and in-memory pipelines and a raw h5py read, one replica."""
  del design
  import dataclasses  # pylint: disable=import-outside-toplevel
  from tools import benchmark_input  # pylint: disable=import-outside-toplevel
  results = {mode: benchmark_input.time_pipeline(dataclasses.replace(config, in_memory=in_memory), 1)
             for mode, in_memory in (("streaming", False), ("in_memory", True))}
  results["raw_h5py"] = benchmark_input.time_raw_read(config.data_path,
                                                      results["streaming"]["epoch_samples"])
  return results


def _resolved_precisions(requested: list) -> list:
  """--precisions with `auto` replaced by what main.py's --precision=auto would train in here, and by
  float32 as well: the reference's precision on a CPU."""
  from strategies.select import resolve_precision  # pylint: disable=import-outside-toplevel
  resolved = []
  for precision in requested:
    for value in (["32.32", resolve_precision("auto", "cpu")] if precision == "auto" else [precision]):
      if value not in resolved:
        resolved.append(value)
  return resolved


def _run_child(kind: str, design: str, precision: str) -> dict:
  args = [sys.executable, os.path.abspath(__file__), "--child=%s:%s" % (kind, design),
          "--batch_size=%d" % FLAGS.batch_size, "--replicas=%d" % FLAGS.replicas, "--precisions=" + precision,
          "--windows=%d" % FLAGS.windows, "--window_steps=%d" % FLAGS.window_steps,
          "--%sjit_compile" % ("" if FLAGS.jit_compile else "no"), "--autotune=" + FLAGS.autotune,
          "--matmul_size=%d" % FLAGS.matmul_size]
  if FLAGS.cache_dir:
    args.append("--cache_dir=" + FLAGS.cache_dir)
  if FLAGS.data_path:
    args.append("--data_path=" + FLAGS.data_path)
  output = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT)
  if output.returncode != 0:
    raise SystemExit("benchmark %s:%s failed:\n%s" % (kind, design, output.stderr[-2000:]))
  result = json.loads(output.stdout.strip().splitlines()[-1])
  _progress("%s %s %s" % (kind, design, precision), result)
  return result


def _progress(label: str, result: dict) -> None:
  """One line per finished measurement: a full benchmark takes many minutes."""
  rate = result.get("samples_per_sec")
  print("%s %-28s %s" % (time.strftime("%H:%M:%S"), label,
                         "%.0f samples/s" % rate if rate else "done"), flush=True)


def _first_step_seconds(design: str, precision: str, cache: str):
  with tempfile.TemporaryDirectory(prefix="benchmark-run-") as logdir:
    args = [sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter",
            "--design=" + design, "--backend=cpu", "--compile_only", "--jit_compile",
            "--cache_dir=" + cache, "--batch_size=%d" % FLAGS.batch_size, "--precision=" + precision,
            "--logdir=" + logdir, "--steps_per_epoch=2", "--eval_steps=1"]
    if FLAGS.data_path:
      args.append("--data_path=" + FLAGS.data_path)
    output = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT)
  match = [line for line in output.stderr.splitlines() if "--compile_only: compiled in" in line]
  return float(match[-1].split("compiled in")[1].split()[0]) if match else None


def _compile_times(design: str, precision: str) -> dict:
  """First-step time of main.py --compile_only, cold and then with the executable cache warm.

  --compile_pairs pairs, each with a fresh cache, the warm run right after its cold one; the ratio is
  the median of the per-pair ratios (the machine's speed drifts less within a pair).
  """
  pairs = []
  for _ in range(FLAGS.compile_pairs):
    with tempfile.TemporaryDirectory(prefix="benchmark-cache-") as cache:
      cold = _first_step_seconds(design, precision, cache)
      pairs.append((cold, _first_step_seconds(design, precision, cache)))
  complete = [(cold, warm) for cold, warm in pairs if cold and warm]
  if not complete:
    return {"cold": None, "warm_cache": None, "pairs": pairs}
  print("%s %-28s warm/cold s: %s" % (time.strftime("%H:%M:%S"), "compile %s %s" % (design, precision),
                                      " ".join("%.1f/%.1f" % (warm, cold) for cold, warm in complete)),
        flush=True)
  return {"cold": statistics.median(cold for cold, _ in complete),
          "warm_cache": statistics.median(warm for _, warm in complete),
          "warm_over_cold": statistics.median(warm / cold for cold, warm in complete), "pairs": pairs}


def _run_reference(design: str, precision: str, data_path: str):
  """One reference PyTorch training measurement, or None where there is no comparable one."""
  if "reference" in FLAGS.skip or precision not in ("32.32", "16.32"):
    return None
  args = [FLAGS.reference_python, os.path.join(REPO_ROOT, "tools", "reference_torch.py"),
          "--data_path=" + data_path, "--design=" + design, "--batch_size=%d" % _step_rows(),
          "--windows=%d" % FLAGS.windows, "--window_steps=%d" % FLAGS.window_steps]
  if precision == "16.32":
    args.append("--bf16")
  output = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT)
  if output.returncode != 0:
    raise SystemExit("reference benchmark %s failed:\n%s" % (design, output.stderr[-2000:]))
  result = json.loads(output.stdout.strip().splitlines()[-1])
  _progress("reference %s %s" % (design, precision), result)
  return result


def _data_path() -> str:
  """--data_path, checked as main.py checks it (a bad file is one error line here, not a failed
  measurement), or the built-in dataset (generated on first use by main.py's data code)."""
  from data import cellspike  # pylint: disable=import-outside-toplevel
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  config = RunConfig(model="neuron_inverter", data_path=FLAGS.data_path)
  return cellspike.open_configured(config).path if FLAGS.data_path else cellspike.default_data_path(config)


def _median_run(runs: list) -> dict:
  """The run whose samples/s is the median (lower median for an even count)."""
  ranked = sorted(runs, key=lambda run: run["samples_per_sec"])
  return ranked[(len(ranked) - 1) // 2]


def _training_rounds(design: str, rows: dict, data_path: str) -> None:
  """--rounds rounds of [reference, ours] per precision; fills each row's train, reference, speed-ups."""
  for _ in range(FLAGS.rounds):
    for precision in FLAGS.precisions:
      row = rows[precision]
      reference = _run_reference(design, precision, data_path)
      ours = _run_child("train", design, precision)
      row.setdefault("train_rounds", []).append(ours)
      if reference:
        row.setdefault("reference_rounds", []).append(reference)
        row.setdefault("speedups", []).append(ours["samples_per_sec"] / reference["samples_per_sec"])
  fp32_reference = rows.get("32.32", {}).get("reference_rounds")
  for precision, row in rows.items():
    row["train"] = _median_run(row["train_rounds"])
    if row.get("reference_rounds"):
      row["reference"] = _median_run(row["reference_rounds"])
      row["speedup_vs_reference"] = statistics.median(row["speedups"])
    if fp32_reference:  # against the reference as its users run it on a CPU: float32
      row["speedup_vs_reference_fp32"] = statistics.median(
          ours["samples_per_sec"] / ref["samples_per_sec"]
          for ours, ref in zip(row["train_rounds"], fp32_reference))


def main(argv):
  del argv
  # As main.py: the application's INFO lines with the short prefix, only warnings from the libraries;
  # TensorFlow's start-up lines are dropped where _prepare imports it (strategies/start.py).
  from training import logs  # pylint: disable=import-outside-toplevel
  logs.setup()
  if FLAGS.json and not FLAGS.child:  # checked first: a mistyped path would fail after the benchmark
    from host.output_paths import check_output_path  # pylint: disable=import-outside-toplevel
    check_output_path("--json", FLAGS.json)
  config = _prepare()  # the parent too: it may generate the built-in dataset
  FLAGS.precisions = _resolved_precisions(FLAGS.precisions)
  if FLAGS.child:
    kind, design = FLAGS.child.split(":")
    result = {"train": child_train, "inference": child_inference, "input": child_input,
              "peak": child_matmul_peak}[kind](config, design)
    result["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(result))
    return
  if "reference" not in FLAGS.skip and not os.path.exists(FLAGS.reference_python):
    print("No PyTorch at --reference_python=%s (make bench-reference): the reference is skipped"
          % FLAGS.reference_python)
    FLAGS.skip.append("reference")
  from strategies import cpu  # pylint: disable=import-outside-toplevel
  results = {"machine": cpu.machine_signature(), "batch_size": FLAGS.batch_size, "replicas": FLAGS.replicas,
             "jit_compile": FLAGS.jit_compile, "rounds": FLAGS.rounds,
             "precisions": {p: {d: {} for d in FLAGS.designs} for p in FLAGS.precisions}}
  for design in FLAGS.designs:
    rows = {p: results["precisions"][p][design] for p in FLAGS.precisions}
    if "train" not in FLAGS.skip:
      _training_rounds(design, rows, config.data_path)
    for precision, row in rows.items():
      if "inference" not in FLAGS.skip:
        row["inference"] = _run_child("inference", design, precision)
      if "compile" not in FLAGS.skip:
        row["compile_seconds"] = _compile_times(design, precision)
  if "input" not in FLAGS.skip:
    results["input"] = _run_child("input", FLAGS.designs[0], FLAGS.precisions[0])
  if "peak" not in FLAGS.skip:
    results["matmul_peak"] = _run_child("peak", FLAGS.designs[0], FLAGS.precisions[0])
  _print_table(results)
  if FLAGS.json:
    with atomic_files.replaced(FLAGS.json) as f:  # whole or not at all, never through a link
      json.dump(results, f, indent=1)


def _print_table(results) -> None:
  replicas = results["replicas"]
  print("\n%s\nbatch %d per replica, %d replica%s (samples/s of all together; the reference: batch %d), "
        "jit_compile %s, %d round(s)" % (results["machine"], results["batch_size"], replicas,
                                         "" if replicas == 1 else "s", results["batch_size"] * replicas,
                                         results["jit_compile"], results["rounds"]))
  print("%-6s %-7s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s" % (
      "prec", "design", "train/s", "torch/s", "x torch", "x t-fp32", "infer/s", "GFLOP/s", "compile",
      "cached", "cch/cld", "peak MB"))
  for precision, designs in results["precisions"].items():
    for design, row in designs.items():
      train, infer = row.get("train", {}), row.get("inference", {})
      compile_s = row.get("compile_seconds", {})
      rate = train.get("samples_per_sec")
      # forward + two backward products
      train_gflops = rate * 3 * train["flops_per_sample_forward"] / 1e9 if rate else None
      peak_mb = max(train.get("peak_rss_mb", 0), infer.get("peak_rss_mb", 0))
      print("%-6s %-7s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s" % (
          precision, design, _fmt(rate, "%.0f"), _fmt(row.get("reference", {}).get("samples_per_sec"), "%.0f"),
          _fmt(row.get("speedup_vs_reference"), "%.2f"), _fmt(row.get("speedup_vs_reference_fp32"), "%.2f"),
          _fmt(infer.get("samples_per_sec"), "%.0f"), _fmt(train_gflops, "%.1f"),
          _fmt(compile_s.get("cold"), "%.1f"), _fmt(compile_s.get("warm_cache"), "%.1f"),
          _fmt(compile_s.get("warm_over_cold"), "%.2f"), _fmt(peak_mb or None, "%.0f")))
  for precision, designs in results["precisions"].items():
    for design, row in designs.items():
      if "layer_forms" in row.get("train", {}):
        # How the first round came by them: the later rounds read what it measured, and the row's
        # median round may be any of them.
        first = row.get("train_rounds", [row["train"]])[0]
        print("%s %s convolution forms (%s): %s" % (
            precision, design, first["layer_forms_chosen_by"],
            ", ".join("%s=%s" % item for item in sorted(row["train"]["layer_forms"].items()))))
  if "input" in results:
    fastest = max((row["train"]["samples_per_sec"] for designs in results["precisions"].values()
                   for design, row in designs.items() if design == "ontra4" and "train" in row), default=0)
    for mode in ("streaming", "in_memory", "raw_h5py"):
      entry = results["input"][mode]
      ratio = " (%.1fx the fastest ontra4 training)" % (entry["samples_per_sec"] / fastest) if fastest else ""
      print("input %-10s %9.0f samples/s %6.2f GB/s%s" % (mode, entry["samples_per_sec"], entry["gb_per_sec"],
                                                         ratio))
    print("input peak RSS %.0f MB" % results["input"]["peak_rss_mb"])
  for line in _spread_lines(results) + _float32_ceiling_lines(results):
    print(line)
  if "matmul_peak" in results:
    print("matmul %dx%d: %s" % (results["matmul_peak"]["matmul_size"], results["matmul_peak"]["matmul_size"],
                                 ", ".join("%s %.0f GFLOP/s" % item
                                           for item in results["matmul_peak"]["gflops"].items())))


def _spread_lines(results) -> list:
  """What the table's medians hide: each round's figures, and how far our timed windows moved within a
  round. On a shared VM one round can differ from the next by 20 %, as much as a change being measured."""
  def rates(runs):
    return " / ".join("{:,.0f}".format(run["samples_per_sec"]) for run in runs)
  lines = []
  for precision, designs in results["precisions"].items():
    for design, row in designs.items():
      rounds = row.get("train_rounds", [])
      widest = max((max(r["windows"]) / min(r["windows"]) for r in rounds if len(r.get("windows", [])) > 1),
                   default=None)
      if len(rounds) < 2 and widest is None:
        continue
      parts = []
      if row.get("reference_rounds"):
        speedups = row["speedups"]
        parts.append("x torch %s (median %.2f, range %.2f-%.2f)" % (
            " / ".join("%.2f" % s for s in speedups), row["speedup_vs_reference"], min(speedups), max(speedups)))
      parts.append("ours %s samples/s" % rates(rounds))
      if row.get("reference_rounds"):
        parts.append("the reference " + rates(row["reference_rounds"]))
      if widest is not None:
        parts.append("our windows within a round up to %.2fx apart" % widest)
      lines.append("%s %s by round: %s" % (precision, design, "; ".join(parts)))
  return lines


def _float32_ceiling_lines(results) -> list:
  """Each float32 design's training, and the reference's, as shares of the float32 matmul rate measured
  in the same round: how far the step is from what these cores can multiply, and what a given speed-up
  would ask of it. Medians over the rounds."""
  lines = []
  for design, row in results["precisions"].get("32.32", {}).items():
    rounds = list(zip(row.get("train_rounds", []), row.get("reference_rounds", [])))
    if not rounds:
      continue
    step_gflop = 3 * rounds[0][0]["flops_per_sample_forward"] / 1e9  # per sample; the same network
    # Each round's matmul rate was measured in our process of that round.
    ours = statistics.median(o["samples_per_sec"] * step_gflop / o["matmul_gflops_float32"] for o, _ in rounds)
    theirs = statistics.median(r["samples_per_sec"] * step_gflop / o["matmul_gflops_float32"] for o, r in rounds)
    lines.append("32.32 %s: training at %.0f %% of the float32 matmul rate of its round, the reference at "
                 "%.0f %%; twice the reference would take %.0f %%" % (design, 100 * ours, 100 * theirs,
                                                                     200 * theirs))
  return lines


def _fmt(value, pattern: str) -> str:
  return "-" if value is None else pattern % value


if __name__ == "__main__":
  app.run(with_one_line_errors(main), flags_parser=parse_flags)  # bad flag: `error:` line, exit 2
