"""Learning parity with the reference: the PyTorch reference and this application, trained side by side.

    python tools/parity.py [--data_path=FILE.h5] [--epochs=6] [--seeds=0,1,2] [--precisions=32.32]
        [--schedules=plateau] [--train_samples=16384] [--val_samples=2048] [--out=parity]
        [--reference_python=.venv-torch/bin/python]   (`make parity` runs it with its defaults)

Both train ontra4 on the same slice of the same cellSpike file (written once into OUT), on one
process, with the same batch size, Adam learning rate, warm-up and reduce-on-plateau settings (ours
with `--lr_schedule=plateau`, whatever the application's default schedule; `--schedules=plateau,cosine`
adds runs of ours with its cosine decay after the same warm-up, a departure measured against the rest):
the reference through `tools/reference_train.py` (its Trainer's loop in PyTorch), this application
through `main.py --replicas=1 --in_memory` (in-memory mode shuffles the whole block each epoch, as the
reference's DataLoader does). One run at a time, so that their wall times can be compared.

Writes OUT/parity.md (per seed: best validation loss and the ratio to the reference; per epoch:
mean training and validation loss; the time to reach the target validation loss, MLPerf HPC's
time-to-quality metric, by default the reference's mean best), OUT/parity.png (loss per epoch, and
validation loss against wall time) and OUT/parity.json. Times count each side's epochs (training
and validation) from its first step: ours include the tracing of the first step, neither includes
process start-up or reading the file.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from errors import (OneLineArgumentParser, UserError, existing_file, report_missing_packages,  # noqa: E402  pylint: disable=wrong-import-position
                    reported_on_one_line)
from host.output_paths import check_output_path  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing
from host import atomic_files  # noqa: E402  pylint: disable=wrong-import-position

import h5py  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
import yaml  # noqa: E402  pylint: disable=wrong-import-position

from model.neuron_inverter.designs import DESIGNS  # noqa: E402  pylint: disable=wrong-import-position  (plain data)

# main.py's --precision values (flags.PRECISIONS; not imported: flags imports TensorFlow's model code).
PRECISIONS = ("auto", "32.32", "16.32", "16.16")
SPLIT_KEYS = tuple(split + key for split in ("train", "val", "test") for key in ("_frames", "_unitStar_par"))


def _seeds(text: str) -> list:
  """An argparse `type`: comma-separated integers (a bad one is named, before anything trains)."""
  try:
    return [int(seed) for seed in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError("%s: expected comma-separated integers, such as 0,1,2" % text) from None


def _precisions(text: str) -> list:
  """An argparse `type`: --precision values main.py takes (it refused 64.64 only after the reference trained)."""
  unknown = [value for value in text.split(",") if value not in PRECISIONS]
  if unknown:
    raise argparse.ArgumentTypeError("%s: %s not a --precision of main.py (%s)"
                                     % (text, ",".join(unknown) + (" is" if len(unknown) == 1 else " are"),
                                        ", ".join(PRECISIONS)))
  return text.split(",")


def parse_args(argv=None):
  parser = OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data_path", type=existing_file, default=None,
                      help="cellSpike .h5 file (default: the built-in generated dataset, made on first use)")
  parser.add_argument("--out", default=None, help="folder for the slice, the runs and the report "
                      "(default: parity)")
  parser.add_argument("--epochs", type=int, default=6)
  parser.add_argument("--seeds", type=_seeds, default="0,1,2", help="comma-separated seeds, one run of each "
                      "side each")
  parser.add_argument("--precisions", type=_precisions, default="32.32", help="comma-separated --precision "
                      "values for ours (the reference runs float32)")
  parser.add_argument("--schedules", default="plateau", help="comma-separated --lr_schedule values for "
                      "ours: plateau (the reference's, default), cosine (the application's default)")
  parser.add_argument("--train_samples", type=int, default=16384)
  parser.add_argument("--val_samples", type=int, default=2048)
  parser.add_argument("--batch_size", type=int, default=192)
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--warmup_epochs", type=int, default=2)
  parser.add_argument("--lr_factor", type=float, default=0.11, help="reduce-on-plateau factor (both sides)")
  parser.add_argument("--lr_patience", type=int, default=8)
  parser.add_argument("--lr_cooldown", type=int, default=2)
  parser.add_argument("--target", type=float, default=None, help="validation loss for the time to "
                      "quality (default: the reference's mean best)")
  parser.add_argument("--reference_python", default=os.path.join(REPO, ".venv-torch", "bin", "python"))
  args = parser.parse_args(argv)
  args.out_is_default = args.out is None  # an error about it then says it is the default
  args.out = args.out or "parity"
  args.schedules = args.schedules.split(",")
  unknown = sorted(set(args.schedules) - {"plateau", "cosine"})
  if unknown:
    parser.error("--schedules: %s is not plateau or cosine" % ",".join(unknown))
  for name in ("seeds", "precisions", "schedules"):  # each value names a run folder of its own
    values = getattr(args, name)
    if len(set(values)) < len(values):
      parser.error("--%s: %s lists a value more than once; give each once" % (name, ",".join(map(str, values))))
  return args


def write_slice(source: str, destination: str, train: int, val: int, named: str = None) -> str:
  """The first `train` / `val` rows (and `val` test rows) of `source`, contiguous, same dtypes.
  `named`: how a bad source is named in the error (the flag that gave it)."""
  with _cellspike_file(source, named or source) as src:
    available = {split: len(src[split + "_frames"]) for split in ("train", "val", "test")}
    wanted = {"train": train, "val": val, "test": min(val, available["test"])}
    for split in ("train", "val"):
      if available[split] < wanted[split]:
        raise SystemExit("error: %s has %d %s samples; --%s_samples=%d" % (
            source, available[split], split, split, wanted[split]))
    with h5py.File(destination + ".tmp", "w") as dst:
      for split, rows in wanted.items():
        for key in (split + "_frames", split + "_unitStar_par"):
          dst.create_dataset(key, data=src[key][:rows])
  os.replace(destination + ".tmp", destination)
  return destination


def _cellspike_file(path: str, named: str):
  """`path` opened with h5py, holding every split's frames and parameters; else a UserError naming it."""
  try:
    source = h5py.File(path, "r")
  except OSError as error:
    raise UserError("%s: not a readable HDF5 file (%s); expected a cellSpike .h5 file" % (named, error)) from None
  missing = [key for key in SPLIT_KEYS if key not in source]
  if missing:
    source.close()
    raise UserError("%s has no %s; expected a cellSpike file with %s" % (named, ", ".join(missing),
                                                                        ", ".join(SPLIT_KEYS)))
  return source


def check_before_training(args) -> None:
  """What would fail only after the reference trained (or later): said first, in one line."""
  check_output_path("--out", args.out, folder=True, default=args.out_is_default)
  found = shutil.which(args.reference_python)  # a path, or a program on the PATH (python3)
  if found is None or os.path.isdir(found):
    raise UserError("--reference_python=%s: no such program; expected the Python of the reference's "
                    "PyTorch environment (`make bench-reference` makes .venv-torch)" % args.reference_python)
  # A rerun into the same --out: main.py refuses a run folder that holds a run, after the reference
  # has trained. Earlier results are the user's to keep or delete, not ours to overwrite.
  earlier = [name for name in sorted(os.listdir(args.out)) if name.startswith("ours-")] \
      if os.path.isdir(args.out) else []
  if earlier:
    raise UserError("--out=%s already holds runs of an earlier parity (%s): delete them, or choose another "
                    "--out" % (args.out, ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "")))


def shared_flags(args, data: str, seed: int) -> list:
  """The settings both sides take, under the same flag names: the reference's schedule (linear warm-up,
  then reduce-on-plateau of the validation loss), whatever this application's defaults are."""
  return ["--data_path=" + data, "--epochs=%d" % args.epochs, "--seed=%d" % seed,
          "--batch_size=%d" % args.batch_size, "--learning_rate=%g" % args.learning_rate,
          "--warmup_epochs=%d" % args.warmup_epochs, "--lr_factor=%g" % args.lr_factor,
          "--lr_patience=%d" % args.lr_patience, "--lr_cooldown=%d" % args.lr_cooldown]


def reference_command(args, data: str, seed: int) -> list:
  return [args.reference_python, os.path.join(REPO, "tools", "reference_train.py")] + shared_flags(args, data,
                                                                                                     seed)


def ours_command(args, data: str, seed: int, precision: str, logdir: str, schedule: str = "plateau") -> list:
  shared = shared_flags(args, data, seed)
  if schedule != "plateau":  # main.py refuses reduce-on-plateau's settings with a schedule that ignores them
    shared = [flag for flag in shared if not flag.startswith(("--lr_factor=", "--lr_patience=", "--lr_cooldown="))]
  return [sys.executable, os.path.join(REPO, "main.py"), "--model=neuron_inverter", "--replicas=1",
          "--in_memory", "--logdir=" + logdir, "--precision=" + precision, "--lr_schedule=" + schedule,
          "--optimizer=adam", "--dropout=%g" % DESIGNS["ontra4"]["dropout"]] + shared


def run_reference(args, data: str, seed: int) -> dict:
  command = reference_command(args, data, seed)
  done = subprocess.run(command, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise SystemExit("error: the reference failed (%s):\n%s" % (" ".join(command), done.stderr[-2000:]))
  history = json.loads(done.stdout.strip().splitlines()[-1])["history"]
  return {"loss": history["loss"], "val_loss": history["val_loss"], "seconds": history["epoch_seconds"]}


def run_ours(args, data: str, seed: int, precision: str, schedule: str) -> dict:
  logdir = os.path.join(args.out, "ours-%s-%s-seed%d" % (precision, schedule, seed))
  command = ours_command(args, data, seed, precision, logdir, schedule)
  done = subprocess.run(command, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise SystemExit("error: main.py failed (%s):\n%s" % (" ".join(command), done.stderr[-2000:]))
  with open(os.path.join(logdir, "summary.yaml")) as f:
    summary = yaml.safe_load(f)
  history = summary["history"]
  return {"loss": history["loss"], "val_loss": history["val_loss"],
          "seconds": history["epoch_wall_seconds"], "precision": summary["precision"]}


def seconds_to(run: dict, target: float):
  """Wall seconds from the first step to the end of the first epoch whose validation loss <= target."""
  elapsed = np.cumsum(run["seconds"])
  reached = [i for i, loss in enumerate(run["val_loss"]) if loss <= target]
  return float(elapsed[reached[0]]) if reached else None


def report(args, runs: dict) -> str:
  """The markdown report; `runs` maps a side ("reference", "ours 32.32", ...) to one run per seed."""
  best = {side: [min(r["val_loss"]) for r in side_runs] for side, side_runs in runs.items()}
  target = args.target if args.target is not None else float(np.mean(best["reference"]))
  reference_mean = float(np.mean(best["reference"]))
  lines = ["# Learning parity: %d epochs, seeds %s, %d / %d train / validation samples, batch %d, Adam %g, "
           "%d warm-up epochs" % (args.epochs, ",".join(map(str, args.seeds)), args.train_samples,
                                  args.val_samples, args.batch_size, args.learning_rate, args.warmup_epochs),
           "", "| side | " + " | ".join("seed %d best val" % s for s in args.seeds) +
           " | mean | ratio to reference | seconds to val <= %.4f (mean) | seconds per epoch |" % target,
           "|---|" + "---|" * (len(args.seeds) + 4)]
  for side, side_runs in runs.items():
    times = [seconds_to(r, target) for r in side_runs]
    reached = [t for t in times if t is not None]
    time_text = "%.0f (%d/%d seeds)" % (np.mean(reached), len(reached), len(times)) if reached else "never"
    lines.append("| %s | %s | %.4f | %.3f | %s | %.1f |" % (
        side, " | ".join("%.4f" % b for b in best[side]), np.mean(best[side]),
        np.mean(best[side]) / reference_mean, time_text,
        np.mean([np.mean(r["seconds"]) for r in side_runs])))
  lines += ["", "Mean loss per epoch (training / validation):", "",
            "| epoch | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
  for epoch in range(args.epochs):
    cells = ["%.4f / %.4f" % (np.mean([r["loss"][epoch] for r in side_runs]),
                              np.mean([r["val_loss"][epoch] for r in side_runs]))
             for side_runs in runs.values()]
    lines.append("| %d | %s |" % (epoch + 1, " | ".join(cells)))
  return "\n".join(lines) + "\n"


def plot(runs: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  figure, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4))
  for color, (side, side_runs) in zip(("black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"), runs.items()):
    for i, run in enumerate(side_runs):
      epochs = np.arange(1, len(run["loss"]) + 1)
      label = side if i == 0 else None
      by_epoch.plot(epochs, run["loss"], "--", color=color, alpha=0.6)
      by_epoch.plot(epochs, run["val_loss"], "-", color=color, alpha=0.8, label=label)
      by_time.plot(np.cumsum(run["seconds"]), run["val_loss"], "o-", color=color, alpha=0.8, label=label)
  by_epoch.set(xlabel="epoch", ylabel="MSE loss (dashed: training, solid: validation)")
  by_time.set(xlabel="wall seconds from the first step", ylabel="validation loss")
  for axes in (by_epoch, by_time):
    axes.legend()
    axes.grid(alpha=0.3)
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def _builtin_dataset() -> str:
  """The application's built-in dataset (generated on first use), as `main.py` finds it. Its module
  imports TensorFlow, which this process never runs: without TensorFlow's start-up lines (oneDNN's
  notice, the CUDA probe, the CPU-instructions hint), as in the other tools."""
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies import environment  # pylint: disable=import-outside-toplevel
  with environment.quiet_tensorflow_import():
    from data.cellspike import default_data_path  # pylint: disable=import-outside-toplevel
  return default_data_path(RunConfig(model="neuron_inverter"))


def main(argv=None):
  args = parse_args(argv)
  check_before_training(args)
  source = args.data_path or _builtin_dataset()
  named = "--data_path=" + source if args.data_path else None
  _cellspike_file(source, named or source).close()  # a bad file is named before --out is made
  os.makedirs(args.out, exist_ok=True)
  data = write_slice(source, os.path.join(os.path.abspath(args.out), "slice.h5"), args.train_samples,
                     args.val_samples, named)
  runs = {"reference": []}
  for seed in args.seeds:
    print("reference, seed %d ..." % seed, flush=True)
    runs["reference"].append(run_reference(args, data, seed))
    for schedule in args.schedules:
      for precision in args.precisions:
        print("ours --precision=%s --lr_schedule=%s, seed %d ..." % (precision, schedule, seed), flush=True)
        run = run_ours(args, data, seed, precision, schedule)
        side = "ours %s (%s)%s" % (precision, run["precision"], "" if schedule == "plateau" else " " + schedule)
        runs.setdefault(side, []).append(run)
  text = report(args, runs)
  with atomic_files.replaced(os.path.join(args.out, "parity.md")) as f:
    f.write(text)
  with atomic_files.replaced(os.path.join(args.out, "parity.json")) as f:
    json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": runs}, f, indent=1)
  plot(runs, os.path.join(args.out, "parity.png"))
  print(text + "\nWrote %s/parity.md, parity.png and parity.json" % args.out)


if __name__ == "__main__":
  with reported_on_one_line():  # Ctrl-C or SIGTERM: one line and status 130 (143), the runs' children ended
    main()
