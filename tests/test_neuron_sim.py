"""The numpy neuron model and the cellSpike generator: traces, sensitivity, file layout, CLI.

Sizes are tens of samples: one simulation call costs about 2 s whatever its batch (8,600 time steps),
so the tests share simulated data through module fixtures.
"""

import json
import os
import socket
import subprocess
import sys

import h5py
import numpy as np
import pytest
import yaml

from data import cellspike_generate
from data import neuron_sim
from errors import UserError
from host import atomic_files
from tests.support.helpers import assert_names

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTS = {"train": 40, "val": 8, "test": 8}
REQUIRED_DATA_INFO = ("h5nameTemplate", "numFeature", "featureName", "parName", "numPar", "numTimeBin",
                      "featureType", "dataNormalized", "ustarTransform", "fullName", "shortName",
                      "generator")


def _generate(out_dir, **kwargs):
  args = dict(num_train=COUNTS["train"], num_val=COUNTS["val"], num_test=COUNTS["test"], seed=3,
              progress=False)
  args.update(kwargs)
  return cellspike_generate.generate_dataset(str(out_dir), **args)


def _read_h5(path):
  with h5py.File(path, "r") as f:
    data = {key: f[key][()] for key in f.keys() if key != "meta.JSON"}
    meta = f["meta.JSON"][()]
    chunks = {key: f[key].chunks for key in f.keys()}
    compression = {key: f[key].compression for key in f.keys()}
  text = meta[0].decode() if isinstance(meta[0], bytes) else meta[0]
  return data, json.loads(text), chunks, compression


@pytest.fixture(scope="module")
def traces():
  u = np.random.RandomState(0).uniform(-1.0, 1.0, size=(6, neuron_sim.NUM_PAR))
  u[0] = -1.0     # the corners of the parameter box must stay physiological as well
  u[1] = 1.0
  return u, neuron_sim.simulate(u)


@pytest.fixture(scope="module")
def fp32_file(tmp_path_factory):
  return _generate(tmp_path_factory.mktemp("fp32"))


def test_constants():
  assert len(neuron_sim.PAR_NAMES) == 15 and len(set(neuron_sim.PAR_NAMES)) == 15
  assert neuron_sim.PAR_NAMES[0] == "gNaTs2.tbar.NaTs2.t.api"
  assert neuron_sim.PAR_NAMES[-1] == "gIhbar.Ih.den"
  assert neuron_sim.FEATURE_NAMES == ("soma", "axon_150um", "apic_dend_150um", "soma_dend_50um")
  assert neuron_sim.NUM_TIME_BINS * neuron_sim.BIN_MS == 200.0
  # Every varied parameter drives exactly one channel, in the compartment its name says.
  suffix = {"api": "apical", "axn": "axon", "som": "soma", "den": "basal"}
  varied = [c for c in neuron_sim.CHANNELS if isinstance(c.par, int)]
  assert sorted(c.par for c in varied) == list(range(15))
  for channel in varied:
    expected = suffix[neuron_sim.PAR_NAMES[channel.par].rsplit(".", 1)[1]]
    assert neuron_sim.COMPARTMENT_NAMES[channel.comp] == expected


def test_conductances():
  u = np.array([[0.0] * 15, [1.0] * 15, [-1.0] * 15])
  g = neuron_sim.conductances(u)
  np.testing.assert_allclose(g[0], neuron_sim.BASE_S_PER_CM2)
  np.testing.assert_allclose(g[1], 10 * neuron_sim.BASE_S_PER_CM2)
  np.testing.assert_allclose(g[2], 0.1 * neuron_sim.BASE_S_PER_CM2)
  with pytest.raises(ValueError, match="shape"):
    neuron_sim.conductances(np.zeros((2, 14)))


def test_traces_shape_dtype_and_physiological(traces):
  _, v = traces
  assert v.shape == (6, 1600, 4) and v.dtype == np.float32
  assert np.all(np.isfinite(v))
  assert v.min() > -110.0 and v.max() < 60.0
  rest = v[:, 40:80, 0]                    # 5-10 ms, before any stimulus
  assert np.all((rest > -90.0) & (rest < -60.0))


def test_spiking_is_typical(traces):
  """The stimulus makes most cells fire (spikes cross -20 mV at the soma)."""
  _, v = traces
  soma = v[:, :, 0]
  spikes = np.sum((soma[:, 1:] > -20.0) & (soma[:, :-1] <= -20.0), axis=1)
  assert np.sum(spikes > 0) >= 3, spikes


# Per-cell mean voltage (mV) per probe of the `traces` fixture's cells, as data version v3 computes them
# (numpy 1.19 and 2.4 agree to 1e-5 mV; v2 differed from these by up to 8e-4 mV).
V3_MEAN_MV = [[-59.971142, -63.272926, -62.524834, -60.683205],
              [-72.669769, -75.606544, -73.684052, -72.385818],
              [-70.431519, -75.405663, -71.771492, -70.638763],
              [-68.690735, -74.463486, -65.471519, -69.066727],
              [-69.998688, -70.585297, -71.377533, -70.19648],
              [-68.037888, -72.694412, -69.49736, -68.115013]]


def test_traces_are_those_of_data_v3(traces):
  """A faster kernel must compute the same samples; a change here needs a new DEFAULT_DATA_VERSION and
  the identifiability results (docs/data.md, "The built-in simulated dataset") measured again."""
  _, v = traces
  np.testing.assert_allclose(v.mean(axis=1), V3_MEAN_MV, rtol=0, atol=1e-4)


def test_a_cell_does_not_depend_on_its_lane_or_neighbours(traces):
  """The kernel advances LANES cells in one loop: each cell's trace must not depend on which lane it
  has, on the cells beside it, or on the padding of an odd batch."""
  u, v = traces
  order = [4, 1, 5]
  np.testing.assert_array_equal(neuron_sim.simulate(u[order]), v[order])


def test_kernel_source_goes_to_the_temp_folder_in_a_read_only_tree(tmp_path, monkeypatch):
  """Where data/__pycache__ cannot be written (a container image), the kernel's module is written to
  the next folder (numba caches its machine code beside it) and loaded from there."""
  not_a_folder = tmp_path / "file"
  not_a_folder.write_text("")
  fallback = tmp_path / "kernels"
  monkeypatch.setattr(neuron_sim, "_KERNEL", {})
  monkeypatch.setattr(neuron_sim, "_kernel_folders", lambda: (str(not_a_folder / "sub"), str(fallback)))
  kernel = neuron_sim._kernel()
  written = list(fallback.glob("neuron_kernel_*.py"))
  assert len(written) == 1 and written[0].read_text() == neuron_sim._kernel_source()
  assert kernel.py_func.__code__.co_filename == str(written[0])


def test_parameter_sensitivity_every_parameter_matters():
  result = neuron_sim.parameter_sensitivity(num_draws=3, seed=0)
  assert result.rel_rms.shape == (3, 15) and result.rms_mv.shape == (3, 15)
  mean = result.rel_rms.mean(axis=0)
  weak = [(name, round(100 * m, 2)) for name, m in zip(neuron_sim.PAR_NAMES, mean) if m <= 0.01]
  assert not weak, "parameters changing the traces by <= 1%% relative RMS: %s" % weak
  table = neuron_sim.format_sensitivity(result)
  assert len(table.splitlines()) == 16 and "gIhbar.Ih.den" in table


def test_file_layout_fp32(fp32_file):
  assert os.path.basename(fp32_file) == "synth_excite.cellSpike_4prB8kHz.data.h5"
  data, meta, chunks, compression = _read_h5(fp32_file)
  assert sorted(data) == sorted("%s_%s" % (d, k) for d in COUNTS
                                for k in ("frames", "unitStar_par", "phys_par"))
  for dom, n in COUNTS.items():
    assert data[dom + "_frames"].shape == (n, 1600, 4)
    assert data[dom + "_unitStar_par"].shape == (n, 15)
    assert data[dom + "_phys_par"].shape == (n, 15)
    for key in ("_frames", "_unitStar_par", "_phys_par"):
      assert data[dom + key].dtype == np.float32
      assert np.all(np.isfinite(data[dom + key]))
      assert compression[dom + key] is None
    assert chunks[dom + "_frames"] is None and chunks[dom + "_unitStar_par"] is None   # contiguous: memory-mapped
    u = data[dom + "_unitStar_par"]
    assert u.min() >= -1.0 and u.max() <= 1.0
    np.testing.assert_allclose(data[dom + "_phys_par"], neuron_sim.conductances(u), rtol=1e-6)
  # Splits are different draws.
  assert not np.allclose(data["val_unitStar_par"], data["test_unitStar_par"])
  # Train frames normalised per probe over (samples, time) to N(0, 1): exactly, as the 40 train
  # samples are all within the first 2048.
  frames = data["train_frames"].astype(np.float64)
  np.testing.assert_allclose(frames.mean(axis=(0, 1)), 0.0, atol=1e-4)
  np.testing.assert_allclose(frames.std(axis=(0, 1)), 1.0, atol=1e-4)
  pack = meta["packInfo"]
  assert len(pack["fnorm_mean"]) == 4 and len(pack["fnorm_std"]) == 4
  assert all(-85.0 < m < -40.0 for m in pack["fnorm_mean"]) and all(s > 1.0 for s in pack["fnorm_std"])
  # Undoing the normalisation gives physiological voltages back.
  mv = data["test_frames"] * np.array(pack["fnorm_std"]) + np.array(pack["fnorm_mean"])
  assert mv.min() > -110.0 and mv.max() < 60.0


def test_meta_json_and_yaml(fp32_file):
  _, meta, _, _ = _read_h5(fp32_file)
  folder = os.path.dirname(fp32_file)
  with open(os.path.join(folder, "meta.cellSpike_excite_4prB8kHz.yaml")) as f:
    bulk = yaml.safe_load(f)
  assert bulk == meta
  info = bulk["dataInfo"]
  for key in REQUIRED_DATA_INFO:
    assert key in info, key
  assert info["h5nameTemplate"] == "*_excite.cellSpike_4prB8kHz.data.h5"
  assert info["h5nameTemplate"].replace("*", "synth") == os.path.basename(fp32_file)
  assert info["numFeature"] == 4 and info["numPar"] == 15 and info["numTimeBin"] == 1600
  assert info["featureName"] == ["soma", "axon_150um", "apic_dend_150um", "soma_dend_50um"]
  assert info["parName"] == list(neuron_sim.PAR_NAMES)
  assert info["featureType"] == "probes_4prB8kHz"
  assert info["dataNormalized"] is True and info["ustarTransform"] is False
  gen = info["generator"]
  assert gen["seed"] == 3 and gen["numSamples"] == COUNTS and gen["dataPrecision"] == "fp32"
  assert set(gen["baseConductance"]) == set(neuron_sim.PAR_NAMES)
  # No temporary files left behind.
  assert sorted(os.listdir(folder)) == ["meta.cellSpike_excite_4prB8kHz.yaml",
                                        "synth_excite.cellSpike_4prB8kHz.data.h5"]


def test_deterministic_whatever_the_batching(fp32_file, tmp_path):
  """Same arguments, other batch size and two worker processes: bit-identical datasets."""
  again = _generate(tmp_path, batch_size=30, workers=2)
  first, meta_first, _, _ = _read_h5(fp32_file)
  second, meta_second, _, _ = _read_h5(again)
  assert meta_first == meta_second
  for key in first:
    assert np.array_equal(first[key], second[key]), key


def test_fp16_file(tmp_path, fp32_file):
  path = _generate(tmp_path, fp16=True, cell_name="synth_fp16", probe_type="excite2_4prB8kHz")
  assert os.path.basename(path) == "synth_fp16_excite.cellSpike_4prB8kHz.data.h5"
  assert os.path.exists(os.path.join(str(tmp_path), "meta.cellSpike_excite2_4prB8kHz.yaml"))
  data, meta, _, _ = _read_h5(path)
  reference, _, _, _ = _read_h5(fp32_file)
  for dom, n in COUNTS.items():
    assert data[dom + "_frames"].shape == (n, 1600, 4)
    for key in ("_frames", "_unitStar_par", "_phys_par"):
      assert data[dom + key].dtype == np.float16
      assert np.all(np.isfinite(data[dom + key]))
    # Same seed, same cells: the fp16 file is the fp32 one rounded.
    np.testing.assert_allclose(data[dom + "_frames"], reference[dom + "_frames"], atol=0.01, rtol=0.002)
  assert meta["dataInfo"]["generator"]["dataPrecision"] == "fp16"
  frames = data["train_frames"].astype(np.float64)
  np.testing.assert_allclose(frames.mean(axis=(0, 1)), 0.0, atol=0.01)
  np.testing.assert_allclose(frames.std(axis=(0, 1)), 1.0, atol=0.01)


@pytest.mark.parametrize("kwargs, names", [
    ({"num_train": 0}, ["num_train", ">= 1"]),
    ({"num_val": -1}, ["num_val", ">= 1"]),
    ({"cell_name": "a/b"}, ["cell_name 'a/b'", "not usable"]),
    ({"cell_name": "*"}, ["cell_name"]),
    ({"probe_type": ""}, ["probe_type"]),
    ({"batch_size": 0}, ["batch_size", ">= 1"]),
    ({"seed": -1}, ["seed", ">= 0"]),
])
def test_bad_arguments_are_user_errors(tmp_path, kwargs, names):
  with pytest.raises(UserError) as caught:
    _generate(tmp_path / "out", **kwargs)
  assert_names(caught.value, *names)
  assert not os.path.exists(str(tmp_path / "out"))


def test_out_dir_that_is_a_file(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(UserError, match="not a directory"):
    _generate(path)


def test_the_partial_file_of_a_killed_generation_on_this_host_is_removed(tmp_path):
  """A generation killed outright (SIGKILL, the out-of-memory killer) cannot remove its temporary file;
  the next one on the same host does. Those of live processes and of other hosts stay."""
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  name = cellspike_generate.h5_name("synth")
  stale, running, elsewhere = (tmp_path / (".%s.%s.%d.tmp" % (name, host, pid)) for host, pid in (
      (socket.gethostname(), dead.pid), (socket.gethostname(), os.getppid()), ("another-node", dead.pid)))
  for partial in (stale, running, elsewhere):
    partial.write_text("partial")
  _generate(tmp_path, cell_name="synth")
  assert not stale.exists() and running.exists() and elsewhere.exists()
  assert (tmp_path / name).exists()


def test_cli_writes_the_files(tmp_path):
  out = tmp_path / "gen"
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, "tools", "generate_cellspike.py"), "--out_dir=%s" % out,
       "--cell_name=cli", "--num_train=12", "--num_val=3", "--num_test=3", "--seed=1", "--fp16",
       "--workers=1", "--noprogress"],
      cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
      timeout=120)
  assert result.returncode == 0, result.stderr
  h5 = out / "cli_excite.cellSpike_4prB8kHz.data.h5"
  assert result.stdout.strip() == str(h5)
  assert (out / "meta.cellSpike_excite_4prB8kHz.yaml").exists()
  data, meta, _, _ = _read_h5(str(h5))
  assert data["train_frames"].shape == (12, 1600, 4) and data["train_frames"].dtype == np.float16
  assert meta["dataInfo"]["generator"]["seed"] == 1


def test_cli_reports_user_errors_on_one_line(tmp_path):
  (tmp_path / "a_file").write_text("x")
  for flag, status, line in (
      ("--num_train=0", 2, "generate_cellspike.py: error: flag --num_train=0: 0 is not a positive integer"),
      ("--out_dir=%s" % (tmp_path / "a_file"), 1,
       "error: --out_dir=%s exists and is not a directory" % (tmp_path / "a_file"))):
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "generate_cellspike.py"), "--out_dir=%s" % (tmp_path / "x"),
         flag], cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        timeout=60)
    assert result.returncode == status
    assert result.stderr.strip().splitlines() == [line]


def test_interrupted_generation_leaves_no_file(tmp_path, monkeypatch):
  calls = []

  def interrupted(u):
    calls.append(len(u))
    if len(calls) == 2:
      raise KeyboardInterrupt
    return np.full((len(u), neuron_sim.NUM_TIME_BINS, neuron_sim.NUM_FEATURES), -70.0, np.float32)

  monkeypatch.setattr(neuron_sim, "simulate", interrupted)
  with pytest.raises(KeyboardInterrupt):
    _generate(tmp_path, batch_size=16)
  assert len(calls) == 2
  assert os.listdir(str(tmp_path)) == []


def test_progress_rate_leaves_out_the_workers_start_up(monkeypatch, capsys):
  # Two workers that take 8 s to start (and compile the kernel), then finish their first batches of
  # 1,000 samples together, then one batch each second: the ETA must come from the 1,000 samples/s,
  # not from the start-up.
  clock = [100.0]
  monkeypatch.setattr(cellspike_generate.time, "time", lambda: clock[0])
  progress = cellspike_generate._Progress(total=30000, enabled=True, workers=2)
  clock[0] += 9.0
  progress.update("train", 1000)
  clock[0] += 0.01
  progress.update("train", 1000)
  for _ in range(11):
    clock[0] += 1.0
    progress.update("train", 1000)
  last = capsys.readouterr().err.strip().splitlines()[-1]   # 10 s after the previous line
  assert_names(last, "13000/30000 samples (43%)", "1000.0 samples/s", "17 s left", "(train split)")


def test_a_line_before_the_rate_is_measured_gives_no_time_left(monkeypatch, capsys):
  """The first line of a make run came 10 s in, with the workers' first batches: its rate, counted
  from the start, said 204 samples/s and 331 s left, where the generator then ran at 2,000."""
  clock = [100.0]
  monkeypatch.setattr(cellspike_generate.time, "time", lambda: clock[0])
  progress = cellspike_generate._Progress(total=69632, enabled=True, workers=2)
  clock[0] += 10.0
  progress.update("train", 2048, batches=2)
  clock[0] += 10.0
  progress.update("train", 20480, batches=20)
  first, second = capsys.readouterr().err.strip().splitlines()
  assert first.startswith("generating: ") and "samples/s" not in first and "s left" not in first, first
  assert_names(first, "2048/69632 samples (3%)", "workers are starting", "(train split)")
  assert second.startswith("generating: "), second
  assert_names(second, "22528/69632 samples (32%)", "2048.0 samples/s", "23 s left", "(train split)")


def test_batches_that_arrive_together_after_the_start_up_give_no_rate(monkeypatch, capsys):
  """A make run's first line said 8629.8 samples/s and "7 s left", the next 2,457.7 and "17 s left":
  the batches the workers had finished while the held ones were written arrived 0.24 s after the mark,
  and their rate over that moment was taken for the generator's."""
  clock = [100.0]
  monkeypatch.setattr(cellspike_generate.time, "time", lambda: clock[0])
  progress = cellspike_generate._Progress(total=69632, enabled=True, workers=2)
  clock[0] += 9.8
  progress.update("train", 4096, batches=4)    # the held batches, written once the mean/std are known
  clock[0] += 0.24
  progress.update("train", 2048, batches=2)    # finished meanwhile: a line is due, 10 s in
  for _ in range(23):                          # then 1024 samples every 0.45 s
    clock[0] += 0.45
    progress.update("train", 1024)
  first, second = capsys.readouterr().err.strip().splitlines()
  assert first.startswith("generating: ") and "samples/s" not in first, first
  assert_names(first, "6144/69632 samples (9%)", "workers are starting")
  assert second.startswith("generating: "), second
  assert_names(second, "29696/69632 samples (43%)", "2417.4 samples/s", "17 s left", "(train split)")


def test_progress_rate_leaves_out_the_burst_of_batches_held_for_the_normalisation(monkeypatch, capsys):
  """The first batches are held until the normalisation's sample is complete and then written at once:
  counted one by one, the burst made the rate 34,603 samples/s against the 166 the generator wrote."""
  clock = [100.0]
  monkeypatch.setattr(cellspike_generate.time, "time", lambda: clock[0])
  progress = cellspike_generate._Progress(total=768, enabled=True, workers=2)
  clock[0] += 4.0                                  # 512 samples made in 4 s, written in one burst
  progress.update("train", 512, batches=4)
  clock[0] += 2.0
  progress.update("val", 256)
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert_names(last, "768/768 samples (100%)", "128.0 samples/s")


_BUILT_IN = """
import sys
sys.path.insert(0, sys.argv[1])
from absl import logging
logging.set_verbosity(logging.INFO)
from data import cellspike
from run_config import RunConfig
cellspike.DEFAULT_SAMPLES = {"train": 48, "val": 8, "test": 8}  # the built-in dataset, made small
print(cellspike.default_data_path(RunConfig(model="neuron_inverter", data_cache=sys.argv[2])))
"""


def _wait_for_line(process, text):
  lines = []
  for line in process.stderr:
    lines.append(line)
    if text in line:
      return
  raise AssertionError("no %r in:\n%s" % (text, "".join(lines)))


def test_processes_that_start_together_generate_the_built_in_dataset_once(tmp_path):
  """A process that finds another generating the built-in dataset (two jobs, a multi-worker run's
  workers) waits for its file instead of simulating the same dataset beside it. This test is the other
  process: it holds the lock, writes the file once the second is waiting, then lets it go."""
  folder = tmp_path / "cellspike-v3-seed0"
  folder.mkdir()
  path = str(folder / cellspike_generate.h5_name("synth"))
  command = [sys.executable, "-c", _BUILT_IN, REPO, str(tmp_path)]
  with atomic_files.one_writer_at_a_time(path, on_wait=None):
    second = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
      _wait_for_line(second, "Another process is generating the built-in dataset into %s" % folder)
      assert second.poll() is None
      _generate(folder, num_train=48, num_val=8, num_test=8, seed=0, fp16=True)
    except BaseException:
      second.kill()
      raise
  out, err = second.communicate(timeout=120)
  assert second.returncode == 0, err
  assert "Generating the built-in" not in err and "Using the built-in" in err, err
  assert out.strip() == path


@pytest.mark.parametrize("columns", [80, 100, 60])
def test_on_a_terminal_the_status_line_is_a_bar_within_its_width(monkeypatch, capsys, columns):
  """A carriage return goes back to the start of the terminal's last row only: in a 100-column
  terminal the 105-column line wrapped, and each rewrite left a row behind (13 in a make run)."""
  clock = [100.0]
  monkeypatch.setattr(cellspike_generate.time, "time", lambda: clock[0])
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
  monkeypatch.setenv("COLUMNS", str(columns))
  progress = cellspike_generate._Progress(total=69632, enabled=True, workers=2)
  for _ in range(67):
    clock[0] += 0.5
    progress.update("train" if progress.done < 65536 else "val", 1024)
  clock[0] += 0.5
  progress.update("test", 1024)
  err = capsys.readouterr().err
  assert err.endswith("\033[K\n") and err.count("\n") == 1, err[-200:]
  lines = [part.replace("\033[K", "").rstrip("\n") for part in err.split("\r") if part]
  assert len(lines) == 68 and max(len(line) for line in lines) <= columns - 1, max(lines, key=len)
  assert lines[0].startswith("generating [>.........")
  if columns < 80:
    return   # the bar at its narrowest, the words cut at the width
  assert lines[0].endswith("workers starting"), lines[0]
  assert_names(lines[0], "] 1% 1024/69632 samples", "train split")
  assert lines[33].endswith("17 s left"), lines[33]
  assert_names(lines[33], "] 50% 34816/69632 samples", "train split", "2048/s")
  assert lines[-1].endswith("0 s left"), lines[-1]
  assert_names(lines[-1], "=] 100% 69632/69632", "test split", "2048/s")
