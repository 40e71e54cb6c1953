"""The benchmark tools run end to end on a small file (their figures are not asserted: no timed tests).

The reference PyTorch model runs from `.venv-torch`, which `make test` builds (requirements-reference.txt).
"""

import ast
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from data import cellspike_generate
from errors import UserError
from strategies import cpu
from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import REPO_ROOT, assert_names, line_naming

TORCH_PYTHON = os.path.join(REPO_ROOT, ".venv-torch", "bin", "python")
# TensorFlow's start-up lines that main.py drops (strategies/environment.py): oneDNN's notice, the
# CPU-instructions hint (TF 2.21 and 2.6), the C++ log's preamble, and, without a GPU, the CUDA probe.
START_UP_LINES = ("oneDNN custom operations are on", "rebuild TensorFlow with the appropriate compiler flags",
                  "absl::InitializeLog()")
CUDA_PROBE_LINES = ("Could not find cuda drivers", "cuInit")


def assert_no_start_up_lines(stderr: str) -> None:
  for line in START_UP_LINES + (() if glob.glob("/dev/nvidia[0-9]*") else CUDA_PROBE_LINES):
    assert line not in stderr, stderr[-3000:]


def shell_environment(**variables) -> dict:
  """The environment of a user's shell: without the TensorFlow variables this test process has set
  (conftest.py), which a tool must set itself; with `variables` added."""
  environment = {k: v for k, v in os.environ.items()
                 if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR")}
  return dict(environment, **variables)


def test_benchmark_produces_every_figure(tmp_path):
  # One precision keeps the test short: bfloat16 where TensorFlow has the CPU kernels (the reference
  # then autocasts too), else float32 (TF 2.6, the Poplar SDK's version, has no CPU bfloat16 kernels).
  # Two replicas, as main.py runs them side by side: the reference trains their rows of a step at once.
  precision = "16.32" if cpu.bfloat16_kernels_available() else "32.32"
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 256, "val": 32, "test": 32})
  out = str(tmp_path / "bench.json")
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark.py"), "--designs=dev",
                           "--batch_size=16", "--replicas=2", "--windows=1", "--window_steps=2",
                           "--data_path=" + data, "--precisions=" + precision, "--rounds=1",
                           "--reference_python=" + TORCH_PYTHON,
                           # the input part has a test of its own (tools/benchmark_input.py, below)
                           "--skip=compile,input", "--json=" + out, "--matmul_size=64",
                           "--cache_dir=" + str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.load(open(out))
  assert results["machine"] == cpu.machine_signature()  # the figures name the CPU they were measured on
  assert_names(line_naming(result.stdout, "reference: batch"), "batch 16 per replica", "2 replicas", "batch 32")
  row = results["precisions"][precision]["dev"]
  train = row["train"]
  assert results["replicas"] == train["replicas"] == 2 and row["reference"]["batch_size"] == 32
  assert train["samples_per_sec"] > 0 and train["peak_rss_mb"] > 0
  assert train["matmul_gflops_float32"] > 0  # the ceiling of the round, measured right after its windows
  # dev: convs 1597x4x4x4 + 398x16x4x2 + 198x32x16x2, dense 3168x128 + 128x128 + 128x15, x 2 FLOP.
  assert train["flops_per_sample_forward"] == 1559424
  # The reference ran beside ours at the same precision (bfloat16 by autocast).
  assert row["reference"]["params"] == 431683 and row["reference"]["bf16"] == (precision == "16.32")
  assert row["speedup_vs_reference"] == train["samples_per_sec"] / row["reference"]["samples_per_sec"]
  assert row["inference"]["samples_per_sec"] > 0
  # A bfloat16 ceiling only where the CPU computes in bfloat16.
  assert set(results["matmul_peak"]["gflops"]) == (
      {"float32", "bfloat16"} if cpu.has_bfloat16_units() else {"float32"})


def test_benchmark_reads_float32_training_against_the_matmul_rate_of_each_round():
  # ontra4's 28.3 MFLOP forward per sample (84.9 MFLOP trained). Round 1: ours 1,000 samples/s, the
  # reference 500, the matmul 100 GFLOP/s; round 2 on a machine twice as fast; round 3 slower still.
  def ours(rate, peak):
    return {"samples_per_sec": rate, "flops_per_sample_forward": 28.3e6, "matmul_gflops_float32": peak}
  results = {"precisions": {
      "32.32": {"ontra4": {"train_rounds": [ours(1000.0, 100.0), ours(2000.0, 200.0), ours(400.0, 80.0)],
                           "reference_rounds": [{"samples_per_sec": r} for r in (500.0, 1000.0, 100.0)]}},
      "16.32": {"ontra4": {"train_rounds": [ours(3000.0, 100.0)]}}}}
  script = ("import sys; sys.path.insert(0, %r); import benchmark; print(benchmark._float32_ceiling_lines(%r))"
            % (os.path.join(REPO_ROOT, "tools"), results))
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr[-3000:]
  # Shares per round: ours 85 / 85 / 42 %, the reference 42 / 42 / 11 %: medians 85 and 42, twice 85.
  # Only the float32 row: a bfloat16 step is not read against the float32 rate.
  (line,) = ast.literal_eval(result.stdout.strip())
  assert_names(line, "32.32 ontra4", "training at 85 %", "reference at 42 %", "would take 85 %")


def test_benchmark_shows_each_rounds_figures_and_the_spread_of_its_windows():
  # Three rounds of float32 beside the reference; one bfloat16 round of one window (nothing to show).
  def ours(rate, windows):
    return {"samples_per_sec": rate, "windows": windows}
  results = {"precisions": {
      "32.32": {"ontra4": {"train_rounds": [ours(1287.0, [1250.0, 1287.0, 1300.0]),
                                            ours(1489.0, [1489.0, 1400.0, 1540.0]),
                                            ours(1222.0, [1222.0, 1100.0, 1320.0])],
                           "reference_rounds": [{"samples_per_sec": r} for r in (821.0, 791.0, 779.0)],
                           "speedups": [1287.0 / 821.0, 1489.0 / 791.0, 1222.0 / 779.0],
                           "speedup_vs_reference": 1287.0 / 821.0}},  # the median round, as computed
      "16.32": {"ontra4": {"train_rounds": [ours(3000.0, [3000.0])]}}}}
  script = ("import sys; sys.path.insert(0, %r); import benchmark; print(benchmark._spread_lines(%r))"
            % (os.path.join(REPO_ROOT, "tools"), results))
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr[-3000:]
  # Ratios 1.568 / 1.882 / 1.569; the widest round is the third (1,320 over 1,100 = 1.20x).
  (line,) = ast.literal_eval(result.stdout.strip())
  assert_names(line, "32.32 ontra4 by round", "1.57 / 1.88 / 1.57", "median 1.57", "range 1.57-1.88",
               "1,287 / 1,489 / 1,222", "reference 821 / 791 / 779", "up to 1.20x")


def test_benchmark_trains_with_the_forms_the_autotune_chose_and_times_them_once(tmp_path):
  """In float32 the first measurement times the convolution forms, as main.py's --autotune does, and
  the next one reads the choice from --cache_dir."""
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 128, "val": 32, "test": 32})
  out, cache = str(tmp_path / "bench.json"), tmp_path / "cache"
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark.py"), "--designs=dev",
                           "--batch_size=8", "--windows=1", "--window_steps=2", "--data_path=" + data,
                           "--precisions=32.32", "--rounds=2", "--skip=reference,inference,compile,input,peak",
                           "--cache_dir=" + str(cache), "--json=" + out], check=True, capture_output=True,
                          text=True, timeout=300, env=shell_environment())
  assert_no_start_up_lines(result.stderr)   # the tool's own TensorFlow, as main.py's
  row = json.load(open(out))["precisions"]["32.32"]["dev"]
  assert [run["layer_forms_chosen_by"] for run in row["train_rounds"]] == ["measured", "cached"]
  # The table says how the run came by its forms, whichever round is the row's median.
  assert "32.32 dev convolution" in line_naming(result.stdout, "forms (measured)")
  assert line_naming(result.stdout, "32.32 dev by round").endswith(" ours %s / %s samples/s" % tuple(
      "{:,.0f}".format(run["samples_per_sec"]) for run in row["train_rounds"]))
  assert len(os.listdir(cache / "autotune")) == 1
  assert row["train_rounds"][0]["layer_forms"] == row["train_rounds"][1]["layer_forms"]


def test_benchmark_refuses_jit_compile_over_several_replicas_before_measuring():
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark.py"), "--jit_compile",
                           "--replicas=4"], capture_output=True, text=True, timeout=60)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert_names(lines[0], "--jit_compile", "one CPU replica", "replicas=4")


def test_input_benchmark_reports_what_sizes_a_host(tmp_path):
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 256, "val": 32, "test": 32},
                         dtype=np.float16)
  out = str(tmp_path / "input.json")
  run = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark_input.py"),
                        "--data_path=" + data, "--replicas=2", "--batch_size=16", "--passes=2",
                        "--json=" + out], check=True, capture_output=True, text=True, timeout=300)
  result = json.load(open(out))
  pipeline = result["pipeline"]
  assert pipeline["epoch_samples"] == 256 and pipeline["samples"] == 512   # 2 timed passes
  assert pipeline["bytes_per_sample"] == 2 * (1600 * 4 + 15)              # float16, as stored
  assert pipeline["peak_rss_mb"] > 0 and pipeline["cpu_seconds_per_1000"] > 0
  assert pipeline["samples_per_sec"] == pytest.approx(512 / pipeline["seconds"])
  assert result["raw_h5py"]["gb_per_sec"] > 0 and result["raw_h5py_parallel"]["processes"] == 2
  assert "feeds 2 device(s) at" in run.stdout and "A100 GPUs" in run.stdout
  if not glob.glob("/dev/nvidia[0-9]*"):
    assert "cuInit" not in run.stderr and "find cuda drivers" not in run.stderr
  assert "DT_HALF" not in run.stderr  # the float16 frames' one-off oneDNN line, dropped as by main.py


def test_reference_torch_model_has_the_reference_parameter_count(tmp_path):
  """Our PyTorch re-implementation matches the documented 2,988,843 parameters (as the Keras model does)."""
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 8, "val": 4, "test": 4})
  result = subprocess.run([TORCH_PYTHON, os.path.join(REPO_ROOT, "tools", "reference_torch.py"),
                           "--data_path=" + data, "--design=ontra4", "--batch_size=4", "--windows=1",
                           "--window_steps=1"], check=True, capture_output=True, text=True, timeout=120)
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["params"] == 2988843 and report["samples_per_sec"] > 0


@pytest.mark.parametrize("variant, other", [([], "standard"), (["--variant=kernel_grad_by_matmul=true"], "variant")])
def test_forms_benchmark_times_both_forms(variant, other):
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark_forms.py"), "--design=dev",
                           "--precision=32.32", "--batch_size=8", "--rounds=2", "--steps=2"] + variant,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "round 2/2" in result.stdout and other + " / application:" in result.stdout
  assert result.stdout.count("ms/step") == 2
  if not glob.glob("/dev/nvidia[0-9]*"):  # as in main.py's log: no CUDA probe lines without a GPU
    assert "cuInit" not in result.stderr and "find cuda drivers" not in result.stderr


def test_reference_trainer_follows_the_reference_schedule(tmp_path):
  """tools/reference_train.py: epochs of the reference's loop, warm-up then plateau, losses per epoch."""
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 64, "val": 32, "test": 16})
  result = subprocess.run([TORCH_PYTHON, os.path.join(REPO_ROOT, "tools", "reference_train.py"),
                           "--data_path=" + data, "--design=dev", "--batch_size=16", "--epochs=4",
                           "--warmup_epochs=2", "--learning_rate=0.01", "--lr_patience=0", "--lr_cooldown=0"],
                          check=True, capture_output=True, text=True, timeout=120)
  history = json.loads(result.stdout.strip().splitlines()[-1])["history"]
  assert history["lr"][:3] == pytest.approx([0.005, 0.01, 0.01])
  assert len(history["loss"]) == len(history["val_loss"]) == len(history["epoch_seconds"]) == 4
  assert all(np.isfinite(history["loss"])) and all(s > 0 for s in history["epoch_seconds"])


def test_reference_trainer_validates_every_row_as_the_application_does():
  """35 rows in batches of 16: the short last batch counts, weighted by its 3 rows."""
  code = ("import sys, types, torch; sys.path.insert(0, %r); import reference_train; "
          "rows = torch.arange(35, dtype=torch.float32)[:, None]; "
          "print(reference_train.validate(torch.nn.Identity(), torch.nn.MSELoss(), rows, torch.zeros(35, 1), "
          "types.SimpleNamespace(batch_size=16, bf16=False)))" % os.path.join(REPO_ROOT, "tools"))
  result = subprocess.run([TORCH_PYTHON, "-c", code], check=True, capture_output=True, text=True, timeout=120)
  assert float(result.stdout) == pytest.approx(np.mean(np.arange(35.0) ** 2), rel=1e-6)   # not over 32


@pytest.mark.parametrize("tool, args, names", [
    ("reference_train.py", ["--data_path=" + os.path.join(REPO_ROOT, "README.md"), "--batch_size=x"],
     ["--batch_size", "'x'"]),
    ("reference_train.py", ["--data_path=no_such.h5"], ["--data_path", "no_such.h5", "not a file"]),
    ("reference_torch.py", [], ["required", "--data_path"]),
    ("parity.py", ["--data_path=no_such.h5"], ["--data_path", "no_such.h5", "not a file"]),
    ("parity.py", ["--schedules=linear"], ["--schedules", "linear", "plateau or cosine"]),
])
def test_the_argparse_tools_report_a_bad_argument_on_one_line(tool, args, names):
  python = sys.executable if tool == "parity.py" else TORCH_PYTHON
  result = subprocess.run([python, os.path.join(REPO_ROOT, "tools", tool)] + args, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 2
  (line,) = result.stderr.splitlines()    # no usage block before it
  assert line.startswith("%s: error: " % tool), line
  assert_names(line, *names)


def _run_until_exit(python, tool, args, module):
  """Runs tools/`tool` as a program until it exits; its last stdout line is then its exit status and
  whether it had imported `module` by then."""
  code = ("import runpy, sys; sys.argv = [%r] + %r\n"
          "try:\n  runpy.run_path(%r, run_name='__main__')\n"
          "except SystemExit as stop:\n  print(stop.code, %r in sys.modules)"
          % (tool, args, os.path.join(REPO_ROOT, "tools", tool), module))
  return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tool", ["reference_train.py", "reference_torch.py"])
@pytest.mark.parametrize("args", [["--help"], ["--design=nope"]])
def test_the_reference_tools_answer_help_and_a_bad_argument_before_importing_pytorch(tool, args):
  result = _run_until_exit(TORCH_PYTHON, tool, args, "torch")
  assert result.stdout.splitlines()[-1] == ("0 False" if args == ["--help"] else "2 False"), result.stderr


def test_parity_report_and_time_to_quality(tmp_path):
  from tools import parity  # pylint: disable=import-outside-toplevel
  source = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 64, "val": 32, "test": 16})
  sliced = parity.write_slice(source, str(tmp_path / "slice.h5"), train=48, val=16)
  import h5py  # pylint: disable=import-outside-toplevel
  with h5py.File(sliced, "r") as f, h5py.File(source, "r") as g:
    assert f["train_frames"].shape[0] == 48 and f["val_unitStar_par"].shape[0] == 16
    np.testing.assert_array_equal(f["train_frames"][:], g["train_frames"][:48])
  with pytest.raises(SystemExit, match="has 64 train samples"):
    parity.write_slice(source, str(tmp_path / "big.h5"), train=128, val=16)
  reference = {"loss": [0.5, 0.4], "val_loss": [0.45, 0.30], "seconds": [10.0, 10.0]}
  ours = {"loss": [0.4, 0.3], "val_loss": [0.29, 0.28], "seconds": [6.0, 6.0]}
  assert parity.seconds_to(reference, 0.30) == 20.0 and parity.seconds_to(ours, 0.30) == 6.0
  assert parity.seconds_to(ours, 0.1) is None
  args = parity.parse_args(["--epochs=2", "--seeds=0"])
  text = parity.report(args, {"reference": [reference], "ours 32.32": [ours]})
  rows = {cells[0]: cells[1:] for cells in ([cell.strip() for cell in line.strip("|").split("|")]
                                            for line in text.splitlines() if line.startswith("|"))}
  assert rows["ours 32.32"] == ["0.2800", "0.2800", "0.933", "6 (1/1 seeds)", "6.0"]
  assert rows["2"] == ["0.4000 / 0.3000", "0.3000 / 0.2800"]


def test_parity_runs_both_sides_on_the_references_schedule(tmp_path):
  """Whatever this application's defaults become, ours trains with the settings the reference gets."""
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  import flags  # pylint: disable=import-outside-toplevel
  from tools import parity  # pylint: disable=import-outside-toplevel
  data = write_cellspike(str(tmp_path / "d.h5"))
  args = parity.parse_args(["--epochs=3", "--seeds=4", "--warmup_epochs=1", "--lr_patience=5"])
  ours = parity.ours_command(args, data, 4, "32.32", str(tmp_path / "run"))
  values = absl_flags.FlagValues()
  flags.define_flags(values)
  values(["main.py"] + ours[2:])
  config = flags.to_config(values)
  assert (config.lr_schedule, config.optimizer, config.replicas, config.in_memory) == ("plateau", "adam", 1, True)
  cosine = parity.ours_command(args, data, 4, "32.32", str(tmp_path / "run"), schedule="cosine")
  assert cosine == [a.replace("--lr_schedule=plateau", "--lr_schedule=cosine") for a in ours
                    if not a.startswith(("--lr_factor=", "--lr_patience=", "--lr_cooldown="))]
  values = absl_flags.FlagValues()
  flags.define_flags(values)
  values(["main.py"] + cosine[2:])
  assert flags.to_config(values).lr_schedule == "cosine"   # main.py takes the cosine run's flags
  with pytest.raises(SystemExit):
    parity.parse_args(["--schedules=plateau,linear"])
  assert (config.epochs, config.seed, config.batch_size, config.learning_rate, config.warmup_epochs) == (
      3, 4, args.batch_size, args.learning_rate, 1)
  assert (config.lr_factor, config.lr_patience, config.lr_cooldown) == (args.lr_factor, 5, args.lr_cooldown)
  reference = parity.reference_command(args, data, 4)
  shared = parity.shared_flags(args, data, 4)
  assert reference[-len(shared):] == shared == ours[-len(shared):]
  with open(os.path.join(REPO_ROOT, "tools", "reference_train.py")) as f:
    source = f.read()
  for flag in shared:   # the reference's own parser takes each of them
    assert 'add_argument("%s"' % flag.split("=")[0] in source, flag


@pytest.mark.parametrize("flag, names", [
    ("--designs=ontra4,nope", ["nope", "ontra4, dev"]),
    ("--precisions=32.32,99", ["99", "auto, 32.32, 16.32, 16.16"]),
    ("--skip=reference,bogus", ["bogus", "train, reference"]),
])
def test_benchmark_names_an_unknown_value_before_measuring_anything(flag, names):
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark.py"), flag],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("benchmark.py: error: "), lines
  assert_names(lines[0], flag.split("=")[0], *names)


@pytest.mark.parametrize("tool, args, names", [
    # An output file that cannot be written: said first, not after the whole benchmark (nor after
    # finding that README.md is no cellSpike file).
    ("benchmark_input.py", ["--data_path=README.md", "--json=/nonexistent/x.json"],
     ["--json=/nonexistent/x.json", "no folder /nonexistent"]),
    ("benchmark.py", ["--data_path=README.md", "--skip=reference", "--json=" + REPO_ROOT],
     ["--json=%s" % REPO_ROOT, "is a folder"]),
    ("benchmark_forms.py", ["--design=dev", "--precision=32.32", "--variant=bogus=1"],
     ["--variant", "'bogus'", "options: "]),
    ("benchmark_forms.py", ["--design=dev", "--precision=32.32", "--variant=channel_multiple=x"],
     ["--variant", "channel_multiple='x'", "int"]),
])
def test_the_benchmark_tools_report_a_user_error_on_one_line(tool, args, names):
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", tool)] + args, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr[-2000:]
  assert_names(errors[0], *names)


@pytest.mark.parametrize("variant", ["bogus=1", "channel_multiple=x"])
def test_the_forms_benchmark_refuses_a_bad_variant_before_importing_tensorflow(variant):
  result = _run_until_exit(sys.executable, "benchmark_forms.py", ["--variant=" + variant], "tensorflow")
  assert result.stdout.splitlines()[-1] == "1 False", result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("tool", ["benchmark.py", "benchmark_input.py"])
def test_the_benchmark_tools_check_data_path_as_main_does_before_importing_tensorflow(tool):
  result = _run_until_exit(sys.executable, tool, ["--data_path=/nonexistent.h5"], "tensorflow")
  assert result.stdout.splitlines()[-1] == "2 False", result.stdout + result.stderr[-2000:]
  (line,) = result.stderr.splitlines()
  assert line.startswith("%s: error: " % tool), line
  assert_names(line, "--data_path=/nonexistent.h5", "does not exist")


def _fake_reference(tmp_path):
  """A --reference_python that leaves a mark when it is started: training began."""
  fake = tmp_path / "bin" / "python"
  fake.parent.mkdir()
  fake.write_text("#!/bin/sh\ntouch %s\nexit 1\n" % (tmp_path / "reference_started"))
  fake.chmod(0o755)
  return str(fake)


def _parity_inputs(tmp_path, case):
  """The arguments of each bad-input case, and what its error line names."""
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 64, "val": 16, "test": 16})
  if case == "seeds":
    return ["--seeds=0,a"], ["--seeds", "0,a", "comma-separated integers"]
  if case == "repeated seed":  # both runs of seed 0 in one folder: the second failed after training
    return ["--data_path=" + data, "--seeds=0,0"], ["--seeds", "0,0", "more than once"]
  if case == "precision":
    return ["--data_path=" + data, "--precisions=32.32,64.64"], ["--precisions", "64.64", "--precision of main.py"]
  if case == "split key":
    import h5py  # pylint: disable=import-outside-toplevel
    with h5py.File(data, "a") as f:
      del f["val_frames"]
    return ["--data_path=" + data], ["--data_path=%s" % data, "val_frames"]
  if case == "not hdf5":
    return ["--data_path=" + os.path.join(REPO_ROOT, "README.md")], [
        "--data_path=%s" % os.path.join(REPO_ROOT, "README.md"), "not a readable HDF5 file"]
  if case == "reference python":
    return ["--data_path=" + data, "--reference_python=" + str(tmp_path / "none")], [
        "--reference_python=%s" % (tmp_path / "none"), "no such program"]
  if case == "out is a file":
    return ["--data_path=" + data, "--out=" + data], ["--out=%s" % data, "is a file"]
  # A second run into the same --out: main.py refused ours-... after the reference had trained.
  (tmp_path / "parity" / "ours-32.32-plateau-seed0").mkdir(parents=True)
  return ["--data_path=" + data], ["--out=%s" % (tmp_path / "parity"), "ours-32.32-plateau-seed0", "delete them"]


@pytest.mark.parametrize("case", ["seeds", "repeated seed", "precision", "split key", "not hdf5",
                                  "reference python", "out is a file", "rerun"])
def test_parity_refuses_bad_input_in_one_line_before_training(tmp_path, case):
  """Each was a traceback (ValueError, KeyError, OSError, FileNotFoundError, FileExistsError) or an
  error only after the reference had trained."""
  args, names = _parity_inputs(tmp_path, case)
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "parity.py"), "--epochs=1",
                           "--seeds=0", "--train_samples=32", "--val_samples=8",
                           "--reference_python=" + _fake_reference(tmp_path),
                           "--out=" + str(tmp_path / "parity")] + args, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
  assert re.match(r"(parity.py: )?error: ", result.stderr), result.stderr
  assert_names(result.stderr, *names)
  assert not (tmp_path / "reference_started").exists()


def test_parity_on_the_built_in_dataset_prints_no_tensorflow_start_up_lines(tmp_path):
  """Finding the built-in dataset imports TensorFlow (data/cellspike.py): its start-up lines came
  before the tool's first line. The dataset here is a small file where the cache holds the built-in one."""
  from data import cellspike, cellspike_generate  # pylint: disable=import-outside-toplevel
  folder = tmp_path / "cache" / "neuron_inverter" / ("cellspike-%s-seed0" % cellspike.DEFAULT_DATA_VERSION)
  folder.mkdir(parents=True)
  write_cellspike(str(folder / cellspike_generate.h5_name(cellspike.DEFAULT_CELL)),
                  sizes={"train": 64, "val": 16, "test": 16})
  env = shell_environment(XDG_CACHE_HOME=str(tmp_path / "cache"))
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "parity.py"), "--epochs=1",
                           "--seeds=0", "--train_samples=32", "--val_samples=8",
                           "--reference_python=" + _fake_reference(tmp_path), "--out=" + str(tmp_path / "parity")],
                          env=env, capture_output=True, text=True, timeout=120)
  # The fake reference fails at once: the tool had found the dataset and cut its slice.
  assert result.returncode == 1 and (tmp_path / "reference_started").exists(), result.stderr[-2000:]
  assert result.stderr.startswith("error: ") and "reference failed" in result.stderr, result.stderr[-2000:]
  assert_no_start_up_lines(result.stderr)


def test_parity_knows_main_pys_precisions():
  import flags  # pylint: disable=import-outside-toplevel
  from tools import parity  # pylint: disable=import-outside-toplevel
  assert parity.PRECISIONS == flags.PRECISIONS


def test_ctrl_c_during_parity_is_one_line(tmp_path):
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 256, "val": 32, "test": 16})
  tool = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "tools", "parity.py"), "--data_path=" + data,
                           "--train_samples=256", "--val_samples=32", "--epochs=50", "--seeds=0",
                           "--reference_python=" + TORCH_PYTHON, "--out=" + str(tmp_path / "parity")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert tool.stdout.readline().startswith("reference, seed 0")   # the reference is training
  time.sleep(1)
  tool.send_signal(signal.SIGINT)
  out, err = tool.communicate(timeout=60)
  assert tool.returncode == 130, out + err
  (line,) = err.strip().splitlines()
  assert line.startswith("interrupted by SIGINT"), err


@pytest.mark.parametrize("content, names", [
    (b"\xff" * 64, ["not a profiler trace", "damaged"]),
    (b"", ["no profiled training step"]),   # an empty XSpace: it printed a table of nothing
], ids=["garbage", "empty"])
def test_op_profile_names_a_trace_it_cannot_use(tmp_path, content, names):
  from tools import op_profile  # pylint: disable=import-outside-toplevel
  trace = tmp_path / "host.xplane.pb"
  trace.write_bytes(content)
  assert op_profile.newest_trace(str(tmp_path)) == str(trace)
  with pytest.raises(UserError) as error:
    op_profile.op_times(str(trace))
  assert str(error.value).startswith(str(trace))
  assert_names(error.value, *names)


def test_op_profile_checks_its_json_file_and_skips_folders_named_like_traces(tmp_path):
  (tmp_path / "run.xplane.pb").mkdir()   # no trace: --profile_dir holds none
  tool = [sys.executable, os.path.join(REPO_ROOT, "tools", "op_profile.py"), "--profile_dir=%s" % tmp_path]
  result = subprocess.run(tool, capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and result.stderr.startswith("error: --profile_dir=%s" % tmp_path)
  assert "no profile" in result.stderr
  # The --json file is checked first: with a readable trace, the error came after the printed table.
  result = subprocess.run(tool + ["--json=/nonexistent/ops.json"], capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and result.stdout == ""
  (line,) = result.stderr.splitlines()
  assert line.startswith("error: "), line
  assert_names(line, "--json=/nonexistent/ops.json", "no folder /nonexistent")


def test_generate_cellspike_replaces_a_dataset_only_with_overwrite(tmp_path):
  """The tool only: main.py's built-in dataset calls data/cellspike_generate.py itself."""
  from tools import generate_cellspike  # pylint: disable=import-outside-toplevel
  existing = tmp_path / "synth_excite.cellSpike_4prB8kHz.data.h5"
  existing.write_text("a-dataset-runs-were-trained-on")
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "generate_cellspike.py"),
                           "--out_dir=%s" % tmp_path, "--seed=1", "--num_train=4", "--num_val=1", "--num_test=1",
                           "--workers=1", "--noprogress"], capture_output=True, text=True, timeout=60)
  (line,) = result.stderr.splitlines()
  assert result.returncode == 1 and line.startswith("error: "), line
  assert_names(line, "--out_dir=%s" % tmp_path, existing.name, "--overwrite", "--cell_name")
  assert existing.read_text() == "a-dataset-runs-were-trained-on"
  generate_cellspike.refuse_to_overwrite(str(tmp_path), "synth", overwrite=True)
  generate_cellspike.refuse_to_overwrite(str(tmp_path), "another_cell", overwrite=False)


def test_the_generator_keeps_a_meta_yaml_of_other_data(tmp_path):
  """A folder of real cells: the generator rewrote its meta yaml with its own parameter names."""
  from tools import generate_cellspike  # pylint: disable=import-outside-toplevel
  generated = cellspike_generate.generate_dataset(str(tmp_path), num_train=4, num_val=1, num_test=1,
                                                  progress=False)
  generate_cellspike.refuse_to_overwrite(str(tmp_path), "cell2", overwrite=False)  # its own yaml: fine
  meta = tmp_path / cellspike_generate.meta_yaml_name("excite_4prB8kHz")
  content = yaml.safe_load(meta.read_text())
  content["dataInfo"]["parName"] = ["r%d" % i for i in range(15)]
  meta.write_text(yaml.safe_dump(content))
  with pytest.raises(UserError) as caught:
    generate_cellspike.refuse_to_overwrite(str(tmp_path), "cell2", overwrite=False)
  assert_names(caught.value, "meta.cellSpike_excite_4prB8kHz.yaml", "other data", "parName")
  generate_cellspike.refuse_to_overwrite(str(tmp_path), "cell2", overwrite=True)
  assert os.path.isfile(generated)


def test_repeat_step_names_each_gradient_whose_bits_differ():
  from tools import repeat_step  # pylint: disable=import-outside-toplevel
  first = [np.array([1.0, 2.0, np.nan], np.float32), np.array([0.0, 3.0], np.float32)]
  assert repeat_step.differing(["a", "b"], first, [array.copy() for array in first]) == []
  one_ulp = np.nextafter(np.float32(2.0), np.float32(3.0))
  now = [np.array([1.0, one_ulp, np.nan], np.float32), np.array([-0.0, 3.0], np.float32)]
  found = repeat_step.differing(["a", "b"], first, now)
  assert [(name, count) for name, count, _ in found] == [("a", 1), ("b", 1)]
  assert found[0][2] == pytest.approx(float(one_ulp) - 2.0) and found[1][2] == 0.0  # -0.0: other bits, no gap


def test_repeat_step_repeats_the_step_and_reports_how_many_differed():
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "repeat_step.py"), "--design=dev",
                           "--replicas=2", "--batch_size=8", "--repeats=3", "--report_every=2"],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith("forms: {") and any(line.startswith("2 repeats, ") for line in lines)
  assert_names(lines[-1], "3 repeats", "2 replicas x 8 rows", "CPU")
  differed = int(re.search(r"(\d+) differed", lines[-1]).group(1))
  # A repeat that differs names its gradients (rare: two repeats in 25,000 of the main job's step).
  assert len([line for line in lines if line.startswith("repeat ")]) == differed <= 3
  assert "Reduce to /device:CPU:0" not in result.stderr  # the libraries' INFO lines are dropped, as in main.py
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flag, expected", [("--repeats=0", "--repeats"),
                                            ("--save_differing=/nonexistent/d.npz", "an existing folder")])
def test_repeat_step_refuses_a_bad_flag_on_one_line(flag, expected):
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "repeat_step.py"), flag],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2 and result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


def test_logging_benchmark_times_runs_with_the_logging_off_and_on(tmp_path):
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 128, "val": 32, "test": 32})
  out = str(tmp_path / "logging.json")
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark_logging.py"), "--rounds=1",
                           "--epochs=2", "--replicas=1", "--batch_size=16", "--data_path=" + data,
                           "--main_flag=--design=dev", "--main_flag=--steps_per_epoch=4", "--main_flag=--eval_steps=1",
                           "--log_every_n_steps=2", "--json=" + out], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.load(open(out))
  assert set(results["rounds"][0]) == {"off", "on", "ratio"} and results["median_ratio"] > 0
  assert results["log_every_n_steps"] == 2
