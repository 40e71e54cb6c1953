"""The bad-input battery: every bad flag, file or checkpoint is one clear line and a non-zero
exit, and the outputs of an earlier run in the same --logdir are left exactly as they were.

Each case runs against a copy of a finished tiny run (summary.yaml, run_config.yaml, events,
checkpoints/last and best), snapshotted (names, sizes, mtimes, SHA-256) before and compared after.
Most cases run in this process through the functions main.py calls (`errors.parse_flags`, `flags.to_config`,
`main.train_and_evaluate`; conftest has prepared TensorFlow's start-up environment): a `UserError` is what main.py prints as its one `error:` line
(exit 1) and a flag error is `errors.parse_flags`'s line and exit 2. A few cases run `python main.py` itself
to check the whole contract end to end (exit status, one stderr line, no traceback).
"""

import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import psutil
import pytest
import yaml
from absl import flags as absl_flags
from absl.testing import flagsaver

import flags
import main
from errors import UserError, parse_flags
from training.logs import LOG_FILE
from tests.support.cellspike_files import write_cellspike, write_meta_yaml
from tests.support.helpers import (REPO_ROOT, WITH_DEFAULT_SIGINT, assert_names, assert_one_line_error,
                                   can_mount_tmpfs, hold_lock, run_main)

flags.define_flags()
FLAGS = absl_flags.FLAGS

BASE_ARGS = ("--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=16",
             "--warmup_epochs=0", "--seed=1")
SIZES = {"train": 64, "val": 32, "test": 32}
CKPT = os.path.join("checkpoints", "last", "ckpt-1")


# ---------------------------------------------------------------------------------------------------
# The previous good run, and snapshots of it.

@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
  return write_cellspike(str(tmp_path_factory.mktemp("data") / "good.h5"), sizes=SIZES)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, good_file):
  """A logdir holding a finished 1-epoch run (trained once for the module)."""
  logdir = str(tmp_path_factory.mktemp("finished") / "run")
  result = run_main(*BASE_ARGS, "--epochs=1", "--data_path=" + good_file, "--logdir=" + logdir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert os.path.isfile(os.path.join(logdir, "summary.yaml"))
  assert os.path.isfile(os.path.join(logdir, CKPT + ".index"))
  return logdir


@pytest.fixture
def logdir(tmp_path, finished_run):
  """A private copy of the finished run (copy2 keeps mtimes), for a case to try to damage."""
  copy = str(tmp_path / "run")
  shutil.copytree(finished_run, copy, copy_function=shutil.copy2)
  return copy


def snapshot(folder):
  """{relative path: (size, mtime_ns, sha256) or 'dir'} of everything under `folder`."""
  state = {}
  for root, dirs, files in os.walk(folder):
    for name in dirs:
      state[os.path.relpath(os.path.join(root, name), folder)] = "dir"
    for name in files:
      if name == ".lock":  # the folder's lock (training/run_folder.py), not an output of the run
        continue
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        content = f.read()
      stat = os.stat(path)
      state[os.path.relpath(path, folder)] = content if name == LOG_FILE else (
          stat.st_size, stat.st_mtime_ns, hashlib.sha256(content).hexdigest())
  return state


def assert_untouched(folder, before):
  """Nothing of `before` changed, but the run folder's log, which may only have grown (a failed start
  appends its lines and its error)."""
  after = snapshot(folder)
  changed = sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path)
                   and not (os.path.basename(path) == LOG_FILE and after.get(path, b"").startswith(
                       before.get(path, b""))))
  assert not changed, "a failed run changed the earlier outputs in %s: %s" % (folder, changed)


# ---------------------------------------------------------------------------------------------------
# Running the application in this process, as main.py does.

def parse_flag_error(capsys, *args):
  """Parses flags with main.py's parser; returns (exit status, the stderr lines)."""
  with flagsaver.flagsaver():
    FLAGS.unparse_flags()
    with pytest.raises(SystemExit) as exit_info:
      parse_flags(["main.py"] + list(args))
  return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


def run_in_process(*args):
  """main.py without the process: flags -> RunConfig -> main.train_and_evaluate; returns the UserError."""
  with flagsaver.flagsaver():
    FLAGS.unparse_flags()
    parse_flags(["main.py"] + list(args))  # a flag error exits here (SystemExit), failing the test
    config = flags.to_config(FLAGS)
  with pytest.raises(UserError) as error:
    main.train_and_evaluate(config)
  return str(error.value)


def assert_clear(message, *names):
  assert "\n" not in message, message       # main.py prints it as one `error:` line
  assert_names(message, *names)


def check_bad_run(logdir, fragments, *args):
  """Runs the application with `args` on `logdir`: a UserError naming `fragments`, outputs untouched."""
  before = snapshot(logdir)
  assert_clear(run_in_process(*BASE_ARGS, "--logdir=" + logdir, *args), *fragments)
  assert_untouched(logdir, before)


def check_bad_resume(logdir, fragments, *args):
  """check_bad_run for a command that continues the finished run in `logdir` for one more epoch: the
  run it would write into is left as it was. (A new run there is refused before anything is read.)"""
  check_bad_run(logdir, fragments, *args, "--resume", "--epochs=2")


# ---------------------------------------------------------------------------------------------------
# Flags: parse-time validation (exit 2), before anything is read or written.

@pytest.mark.parametrize("args, fragments", [
    (["--backend=ipu", "--ipus_per_replica=2", "--gradient_accumulation=3"],
     ["--gradient_accumulation", "multiple of 4 (got 3)"]),
    (["--backend=ipu", "--ipus_per_replica=2", "--pipeline_schedule=interleaved",
      "--gradient_accumulation=3"], ["--gradient_accumulation", "multiple of 2 (got 3)"]),
    (["--backend=ipu", "--ipus_per_replica=2", "--pipeline_stages=4", "--pipeline_schedule=interleaved",
      "--gradient_accumulation=8"], ["interleaved", "one IPU per stage"]),
    (["--backend=ipu", "--ipus_per_replica=4", "--pipeline_stages=2", "--gradient_accumulation=8"],
     ["--pipeline_stages", "at least", "--ipus_per_replica"]),
    (["--resume", "--epochs=2"], ["--resume needs --logdir"]),
    (["--data_path=/no/such/cellA.h5"], ["--data_path", "does not exist"]),
    (["--batch_size=0"], ["--batch_size"]),
    (["--design=ontra5"], ["--design", "dev", "ontra4"]),
], ids=["pipeline_depth_grouped", "pipeline_depth_interleaved", "interleaved_shared_ipus", "stages_below_ipus", "resume_no_logdir",
        "missing_file", "zero_batch", "unknown_design"])
def test_contradictory_or_bad_flags(capsys, args, fragments):
  status, lines = parse_flag_error(capsys, *BASE_ARGS, *args)
  assert status == 2 and len(lines) == 1, lines
  assert_clear(lines[0], "error:", *fragments)


def test_logdir_that_is_a_file_is_refused_unchanged(capsys, tmp_path):
  existing = tmp_path / "summary.yaml"
  existing.write_text("model: mnist\n")
  before = snapshot(str(tmp_path))
  status, lines = parse_flag_error(capsys, *BASE_ARGS, "--logdir=%s" % existing)
  assert status == 2 and len(lines) == 1, lines
  assert_names(lines[0], "--logdir", "existing file")
  assert_untouched(str(tmp_path), before)


def test_ipu_replicas_not_a_power_of_two_end_to_end(logdir):
  before = snapshot(logdir)
  result = run_main(*BASE_ARGS, "--backend=ipu", "--replicas=3", "--logdir=" + logdir, timeout=120)
  assert result.returncode == 2
  assert_one_line_error(result, "--replicas=3", "--ipus_per_replica=1", "3 IPUs", "powers of two")
  assert_untouched(logdir, before)


# ---------------------------------------------------------------------------------------------------
# Data files: found when the file is opened, before any output is written.

def _edited(path, key, data):
  with h5py.File(path, "a") as f:
    del f[key]
    if data is not None:
      f.create_dataset(key, data=data)
  return path


def _with_nonfinite(path, key, index, value):
  with h5py.File(path, "a") as f:
    array = f[key][()]
    array[index] = value
    f[key][...] = array
  return path


DATA_CASES = {
    "missing_key": (lambda p: _edited(p, "val_unitStar_par", None), ["missing key", "'val_unitStar_par'"]),
    "frames_rank": (lambda p: _edited(p, "train_frames", np.zeros((64, 1600), np.float32)),
                    ["'train_frames'", "(64, 1600)", "rank 3"]),
    "targets_rank": (lambda p: _edited(p, "test_unitStar_par", np.zeros((32, 15, 2), np.float32)),
                     ["'test_unitStar_par'", "(32, 15, 2)", "rank 2"]),
    "probes_differ": (lambda p: _edited(p, "val_frames", np.ones((32, 1600, 3), np.float32)),
                      ["splits disagree", "frame shape"]),
    "lengths_differ": (lambda p: _edited(p, "train_unitStar_par", np.zeros((63, 15), np.float32)),
                       ["'train_frames'", "64 samples", "'train_unitStar_par'", "has 63"]),
    "empty_split": (lambda p: _edited(_edited(p, "test_frames", np.zeros((0, 1600, 4), np.float32)),
                                      "test_unitStar_par", np.zeros((0, 15), np.float32)),
                    ["the test split is empty"]),
    "last_sample_unwritten": (
        lambda p: _edited(p, "val_frames", np.concatenate([np.ones((31, 1600, 4), np.float32),
                                                           np.zeros((1, 1600, 4), np.float32)])),
        ["last sample", "'val_frames'", "(row 31)", "zero"]),
    "integer_dtype": (lambda p: _edited(p, "train_frames", np.zeros((64, 1600, 4), np.int16)),
                      ["'train_frames'", "int16", "float16 or float32"]),
    "nan_one_cell": (lambda p: _with_nonfinite(p, "train_frames", (37, 811, 2), np.nan),
                     ["'train_frames'", "NaN or Inf", "(row 37)"]),
    "inf_target": (lambda p: _with_nonfinite(p, "val_unitStar_par", (17, 3), -np.inf),
                   ["'val_unitStar_par'", "NaN or Inf", "(row 17)"]),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_malformed_data_file(tmp_path, logdir, case):
  damage, fragments = DATA_CASES[case]
  path = damage(write_cellspike(str(tmp_path / "bad.h5"), sizes=SIZES, extra_keys=False))
  check_bad_resume(logdir, [path + ": "] + fragments, "--data_path=" + path)


def test_not_hdf5_file(tmp_path, logdir):
  path = tmp_path / "notes.h5"
  path.write_text("train_frames: [1, 2, 3]\n")
  check_bad_resume(logdir, [str(path), "not a readable HDF5 file"], "--data_path=%s" % path)


def test_folder_where_a_file_is_expected(tmp_path, logdir):
  folder = tmp_path / "cellA.h5"
  folder.mkdir()
  check_bad_resume(logdir, ["--data_path=%s" % folder, "meta.cellSpike_excite_4prB8kHz.yaml"],
                "--data_path=%s" % folder)


def test_fewer_samples_than_one_global_batch(good_file, logdir):
  # 64 training samples, 2 replicas x 48: not one global batch (the file itself is valid).
  check_bad_resume(logdir, ["train split", "64", "--batch_size"], "--data_path=" + good_file,
                "--replicas=2", "--batch_size=48")


def test_frames_too_short_for_the_design(tmp_path, logdir):
  # Named as the run's file (a resume takes a moved copy by its name), so the design's check speaks.
  os.makedirs(str(tmp_path / "moved"))
  path = write_cellspike(str(tmp_path / "moved" / "good.h5"), sizes=SIZES, time_bins=20)
  check_bad_resume(logdir, ["--design=dev", "20 time bins"], "--data_path=" + path)


def test_truncated_mid_dataset_end_to_end(tmp_path, logdir):
  path = write_cellspike(str(tmp_path / "cut.h5"), sizes=SIZES)
  with h5py.File(path, "r") as f:  # cut in the middle of train_frames' chunks
    chunks = [f["train_frames"].id.get_chunk_info(i) for i in range(f["train_frames"].id.get_num_chunks())]
  os.truncate(path, (min(c.byte_offset for c in chunks) + max(c.byte_offset + c.size for c in chunks)) // 2)
  before = snapshot(logdir)
  result = run_main(*BASE_ARGS, "--data_path=" + path, "--logdir=" + logdir, "--epochs=2", "--resume",
                    timeout=120)
  assert result.returncode == 1
  assert_one_line_error(result, path, "not a readable HDF5 file")
  assert_untouched(logdir, before)


# ---------------------------------------------------------------------------------------------------
# Meta yaml (a folder with --cell_name, or beside the file).

def _folder_with_yaml(tmp_path, **yaml_kwargs):
  folder = tmp_path / "data"
  folder.mkdir()
  write_cellspike(str(folder / "cellA_excite.cellSpike_4prB8kHz.data.h5"), sizes=SIZES)
  yaml_path = str(folder / "meta.cellSpike_excite_4prB8kHz.yaml")
  write_meta_yaml(yaml_path, **yaml_kwargs)
  return str(folder), yaml_path


@pytest.mark.parametrize("yaml_text, yaml_kwargs, fragments", [
    ("dataInfo: [unclosed", {}, ["malformed YAML"]),
    ("just a string\n", {}, ["'dataInfo' mapping"]),
    ("dataInfo: {numFeature: 4, numPar: 15}\n", {}, ["dataInfo", "h5nameTemplate, parName"]),
    (yaml.safe_dump({"dataInfo": {"h5nameTemplate": "*_excite.cellSpike_4prB8kHz.data.h5",
                                  "numFeature": "four", "parName": ["a"] * 15, "numPar": 15}}),
     {}, ["dataInfo.numFeature", "'four'", "positive integer"]),
    (b"dataInfo: \xff\xfe\n", {}, ["malformed YAML"]),
    (None, {"num_par": 14}, ["numPar=14", "14 parName entries", "have 15"]),
    (None, {"num_feature": 3}, ["numFeature=3", "4 probes"]),
], ids=["unclosed", "not_mapping", "missing_keys", "not_integer", "not_utf8", "numPar", "numFeature"])
def test_meta_yaml_malformed_or_disagreeing(tmp_path, logdir, yaml_text, yaml_kwargs, fragments):
  folder, yaml_path = _folder_with_yaml(tmp_path, **yaml_kwargs)
  if isinstance(yaml_text, bytes):
    with open(yaml_path, "wb") as f:
      f.write(yaml_text)
  elif yaml_text is not None:
    with open(yaml_path, "w") as f:
      f.write(yaml_text)
  where = "cellA_excite" if yaml_text is None else yaml_path
  check_bad_resume(logdir, [where] + fragments, "--data_path=" + folder, "--cell_name=cellA")


def test_meta_yaml_beside_the_file_is_checked_too(tmp_path, logdir):
  folder, _ = _folder_with_yaml(tmp_path, num_feature=2)
  path = os.path.join(folder, "cellA_excite.cellSpike_4prB8kHz.data.h5")
  check_bad_resume(logdir, [path, "numFeature=2", "4 probes"], "--data_path=" + path)


# ---------------------------------------------------------------------------------------------------
# Outputs: an unwritable logdir.

def test_unwritable_logdir(tmp_path, good_file):
  blocker = tmp_path / "outputs"
  blocker.write_text("a file where the logdir's parent should be\n")
  before = snapshot(str(tmp_path))
  assert_clear(run_in_process(*BASE_ARGS, "--data_path=" + good_file, "--logdir=%s" % (blocker / "run")),
               "--logdir=%s" % (blocker / "run"), "not a writable folder")
  assert_untouched(str(tmp_path), before)


# ---------------------------------------------------------------------------------------------------
# --resume: another model or design, or a damaged checkpoint.

def test_resume_with_another_model_end_to_end(logdir):
  before = snapshot(logdir)
  result = run_main("--model=mnist", "--backend=cpu", "--epochs=2", "--resume", "--logdir=" + logdir,
                    timeout=120)
  assert result.returncode == 1
  assert_one_line_error(result, "--resume", CKPT, "model=neuron_inverter", "model=mnist")
  assert_untouched(logdir, before)


def test_resume_with_another_design(good_file, logdir):
  args = [a for a in BASE_ARGS if not a.startswith("--design")]
  before = snapshot(logdir)
  message = run_in_process(*args, "--design=ontra4", "--data_path=" + good_file, "--logdir=" + logdir,
                           "--epochs=2", "--resume")
  assert_clear(message, "--resume", "design=dev", "design=ontra4")
  assert_untouched(logdir, before)


def _garble(path, offset, length=64):
  with open(path, "r+b") as f:
    f.seek(offset)
    chunk = f.read(length)
    f.seek(offset)
    f.write(bytes(b ^ 0xFF for b in chunk))


def _damage_checkpoint(logdir, how):
  prefix = os.path.join(logdir, CKPT)
  data, index = prefix + ".data-00000-of-00001", prefix + ".index"
  state = os.path.join(os.path.dirname(prefix), "checkpoint")
  if how == "data_truncated":
    os.truncate(data, os.path.getsize(data) // 2)
  elif how == "data_garbled":
    _garble(data, os.path.getsize(data) // 2)
  elif how == "data_missing":
    os.remove(data)
  elif how == "index_truncated":
    os.truncate(index, os.path.getsize(index) // 2)
  elif how == "index_garbled":
    _garble(index, 100)
  elif how == "state_empty":
    open(state, "w").close()


@pytest.mark.parametrize("how", ["data_truncated", "data_garbled", "data_missing", "index_truncated",
                                 "index_garbled", "state_empty"])
def test_resume_from_a_damaged_checkpoint(good_file, logdir, how):
  _damage_checkpoint(logdir, how)
  check_bad_run(logdir, ["--resume", os.path.join(logdir, "checkpoints", "last")],
                "--data_path=" + good_file, "--epochs=2", "--resume")


def test_resume_checks_the_best_checkpoint_before_training(good_file, logdir):
  """The run ends by testing the best weights: a damaged best one stops it at once."""
  best = os.path.join(logdir, "checkpoints", "best")
  (data,) = [os.path.join(best, name) for name in os.listdir(best) if ".data-" in name]
  _garble(data, os.path.getsize(data) // 2)
  check_bad_run(logdir, ["--resume", best, "unreadable"], "--data_path=" + good_file, "--epochs=2",
                "--resume")


def test_resume_from_a_garbled_checkpoint_end_to_end(good_file, logdir):
  _damage_checkpoint(logdir, "data_garbled")
  before = snapshot(logdir)
  result = run_main(*BASE_ARGS, "--data_path=" + good_file, "--logdir=" + logdir, "--epochs=2",
                    "--resume", timeout=120)
  assert result.returncode == 1
  assert_one_line_error(result, "--resume", CKPT, "unreadable")
  assert_untouched(logdir, before)


# ---------------------------------------------------------------------------------------------------
# Run folders.

def test_a_new_run_into_a_finished_one_is_refused_and_keeps_it(logdir, good_file):
  check_bad_run(logdir, ["--logdir=" + logdir, "already holds a run", "--resume", "fresh --logdir"],
                "--data_path=" + good_file, "--epochs=1")


def test_a_new_run_into_a_finished_one_is_refused_before_the_data_is_generated(logdir, tmp_path):
  """Without --data_path the run would first generate the built-in dataset (minutes on a slow CPU):
  the refusal comes before it."""
  cache = tmp_path / "data_cache"
  check_bad_run(logdir, ["--logdir=" + logdir, "already holds a run"], "--data_cache=%s" % cache,
                "--epochs=1")
  assert not cache.exists()


def test_a_data_cache_that_cannot_hold_the_builtin_dataset_is_one_error_line(tmp_path):
  cache = tmp_path / "data_cache"
  cache.write_text("not a folder")
  for logdir, given in ((tmp_path / "run", False), (tmp_path / "made_by_the_user", True)):
    if given:
      logdir.mkdir()
    result = run_main(*BASE_ARGS, "--epochs=1", "--data_cache=%s" % cache, "--logdir=%s" % logdir)
    assert_one_line_error(result, "--data_cache=%s" % cache, "cannot create", cache / "cellspike-v3-seed0")
    # The run folder it made is gone; one the user made stays as it was, empty: a start refused by its
    # checks writes nothing there (its error is on the terminal only).
    assert logdir.exists() == given and (not given or os.listdir(logdir) == [])


@pytest.mark.parametrize("where", ["HOME", "XDG_CACHE_HOME"])
def test_a_home_where_the_caches_cannot_be_made_is_one_line_that_says_how_to_move_them(tmp_path, where):
  """A container's or service account's home may not be writable: the line names where the default
  caches come from and the variable that moves them, all of them at once (the flag named alone was
  --cache_dir, after which the next run failed on --data_cache)."""
  not_a_folder = tmp_path / "a_file"
  not_a_folder.write_text("")
  env = {"HOME": str(not_a_folder), "XDG_CACHE_HOME": ""}
  if where == "XDG_CACHE_HOME":
    env = {"XDG_CACHE_HOME": str(not_a_folder)}
  result = run_main(*BASE_ARGS, "--epochs=1", "--logdir=%s" % (tmp_path / "run"), env=env)
  root = not_a_folder / ".cache" if where == "HOME" else not_a_folder
  source = ["~/.cache", "HOME=%s" % not_a_folder] if where == "HOME" else ["XDG_CACHE_HOME=%s" % not_a_folder]
  hint = ["Not a directory", "default"] + source + ["XDG_CACHE_HOME", "--cache_dir", "--data_cache"]
  assert_one_line_error(result, "--data_cache=%s" % (root / "neuron_inverter"),
                        root / "neuron_inverter" / "cellspike-v3-seed0", *hint)
  # --backend=auto sets every backend's start-up variables, the IPU's executable cache among them, before
  # the data: its folder comes first, with the same hint.
  auto = [arg for arg in BASE_ARGS if not arg.startswith("--backend=")] + ["--backend=auto"]
  result = run_main(*auto, "--epochs=1", "--logdir=%s" % (tmp_path / "run"), env=env)
  executables = root / "neuron_inverter" / "executables"
  assert_one_line_error(result, "--cache_dir=%s" % executables, "cannot be created", *hint)


def test_a_read_only_data_cache_is_one_error_line(tmp_path):
  """The dataset's folder exists but cannot be written: a real read-only bind mount (in a private
  mount namespace), which stops root too."""
  folder = tmp_path / "data_cache" / "cellspike-v3-seed0"
  folder.mkdir(parents=True)
  if not can_mount_tmpfs(str(tmp_path)):
    pytest.skip("cannot mount in a private namespace here (needs unshare and mount rights)")
  script = 'mount --bind "$RO" "$RO" && mount -o remount,bind,ro "$RO" || exit 77; exec "$@"'
  result = run_main(*BASE_ARGS, "--epochs=1", "--data_cache=%s" % folder.parent,
                    "--logdir=" + str(tmp_path / "run"), prefix=("unshare", "-m", "sh", "-c", script, "sh"),
                    env={"RO": str(folder)})
  assert_one_line_error(result, "--data_cache=%s" % folder.parent, "cannot write", folder)


def test_a_data_cache_without_room_for_the_dataset_is_one_error_line(tmp_path):
  """A real 1 MB file system (a tmpfs in a private mount namespace) for the 0.9 GB built-in dataset: refused
  before the simulation starts, instead of h5py's "No space left on device" traceback minutes later."""
  cache = tmp_path / "small_disk"
  cache.mkdir()
  if not can_mount_tmpfs(str(cache)):
    pytest.skip("cannot mount a tmpfs here (needs unshare and mount rights)")
  script = 'mount -t tmpfs -o size=1m tmpfs "$MNT" || exit 77; exec "$@"'
  result = run_main("--model=neuron_inverter", "--epochs=1", "--data_cache=%s" % cache,
                    "--logdir=" + str(tmp_path / "run"), prefix=("unshare", "-m", "sh", "-c", script, "sh"),
                    env={"MNT": str(cache)})
  assert_one_line_error(result, "--data_cache=%s" % cache, "897 MB", cache / "cellspike-v3-seed0", "1 MB free")
  assert "generating" not in result.stderr
  assert not (tmp_path / "run").exists()


def test_a_disk_that_fills_up_during_generation_is_one_error_line_and_no_partial_file(tmp_path):
  """Room at the start, then another writer takes it (here: a filler started once the temporary file
  exists, on a real 8 MB tmpfs): the write's ENOSPC becomes one line naming the flag."""
  mount = tmp_path / "disk"
  mount.mkdir()
  if not can_mount_tmpfs(str(mount)):
    pytest.skip("cannot mount a tmpfs here (needs unshare and mount rights)")
  listing = tmp_path / "left.txt"
  script = """
mount -t tmpfs -o size=8m tmpfs "$MNT" || exit 77
"$@" &
pid=$!
while ! ls -A "$MNT/data" 2>/dev/null | grep -q tmp && kill -0 $pid 2>/dev/null; do sleep 0.01; done
dd if=/dev/zero of="$MNT/filler" bs=64k 2>/dev/null
wait $pid
status=$?
ls -A "$MNT/data" > "$LISTING"
exit $status
"""
  out_dir = mount / "data"
  command = [sys.executable, os.path.join(REPO_ROOT, "tools", "generate_cellspike.py"), "--out_dir=%s" % out_dir,
             "--num_train=200", "--num_val=8", "--num_test=8", "--workers=1", "--noprogress"]
  result = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh"] + command, capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, MNT=str(mount), LISTING=str(listing)))
  assert_one_line_error(result, "--out_dir=%s" % out_dir, "filled up", "partial file was removed")
  assert listing.read_text().split() == []


def test_ctrl_c_while_generating_is_one_line_from_the_whole_process_group(tmp_path):
  """A terminal's Ctrl-C goes to every process of the foreground group: the simulation workers too.
  Each of them printed a KeyboardInterrupt traceback when the signal found it in Python code (seen on a
  first run, about one Ctrl-C in five) before the parent's one line. Here the workers get theirs first,
  which must change nothing, then the whole group gets one."""
  out_dir = tmp_path / "data"
  command = [sys.executable, "-c", WITH_DEFAULT_SIGINT, os.path.join(REPO_ROOT, "tools", "generate_cellspike.py"),
             "--out_dir=%s" % out_dir, "--num_train=200000", "--workers=2", "--batch_size=256", "--noprogress"]
  job = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
  try:
    deadline = time.monotonic() + 60
    while not (out_dir.exists() and any(".tmp" in name for name in os.listdir(out_dir))):
      assert job.poll() is None and time.monotonic() < deadline, job.communicate()
      time.sleep(0.05)
    time.sleep(2)  # the workers started and simulating
    workers = [child.pid for child in psutil.Process(job.pid).children()]  # and the resource tracker
    assert len(workers) >= 2, workers
    for worker in workers:
      os.kill(worker, signal.SIGINT)
    time.sleep(2)  # a kernel call ends and Python code runs, where a KeyboardInterrupt would be raised
    assert job.poll() is None
    os.killpg(job.pid, signal.SIGINT)
    _, err = job.communicate(timeout=60)
  finally:
    if job.poll() is None:
      os.killpg(job.pid, signal.SIGKILL)
      job.wait()
  assert job.returncode == 130, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
  assert err.strip().splitlines()[-1].startswith("interrupted by SIGINT"), err
  assert not os.listdir(out_dir)  # the partial file removed


def test_a_second_job_into_a_busy_folder_is_refused(tmp_path, good_file):
  """The first job holds the folder's lock (here: this process, as a running job would)."""
  from training import run_folder  # pylint: disable=import-outside-toplevel
  busy = str(tmp_path / "busy")
  os.makedirs(busy)
  holder = hold_lock(busy)
  try:
    result = run_main(*BASE_ARGS, "--epochs=1", "--data_path=" + good_file, "--logdir=" + busy)
    assert_one_line_error(result, "--logdir=" + busy, "in use by pid %d" % holder.pid)
  finally:
    holder.kill()
    holder.wait()
  assert not run_folder.holds_run(busy)


def test_main_on_a_really_full_staging_disk_is_one_error_line_and_leaves_nothing(tmp_path):
  mount = tmp_path / "small_disk"
  mount.mkdir()
  if not can_mount_tmpfs(str(mount)):
    pytest.skip("cannot mount a tmpfs here (needs unshare and mount rights); tests/test_staging.py covers it")
  path = write_cellspike(str(tmp_path / "cell.h5"), sizes={"train": 256, "val": 32, "test": 32})
  listing = tmp_path / "left_in_stage_dir.txt"
  # A real 1 MB file system in a private mount namespace; what is left in the staging folder is listed
  # before the namespace (and the tmpfs) goes away.
  script = ('mount -t tmpfs -o size=1m tmpfs "$MNT" || exit 77; "$@"; status=$?; '
            'ls -A "$MNT/local" > "$LISTING" || echo "no folder" > "$LISTING"; exit $status')
  result = run_main("--model=neuron_inverter", "--design=dev", "--data_path=" + path, "--epochs=1",
                    "--batch_size=64", "--stage_dir=%s" % (mount / "local"), "--logdir=%s" % (tmp_path / "run"),
                    prefix=("unshare", "-m", "sh", "-c", script, "sh"),
                    env={"MNT": str(mount), "LISTING": str(listing)})
  assert_one_line_error(result, "train_frames/train_unitStar_par", "6.6 MB", "1.0 MB free", "--stage_dir")
  assert listing.read_text().split() == []


def test_a_cpu_without_avx_is_one_error_line_not_an_abort(tmp_path):
  """TensorFlow's x86 builds abort (SIGABRT) on a CPU without AVX, as a VM's generic CPU model is. The
  application reads /proc/cpuinfo first: here a virtual CPU's, bound over the real one in a private
  mount namespace."""
  if not can_mount_tmpfs(str(tmp_path)):
    pytest.skip("cannot mount in a private namespace here (needs unshare and mount rights)")
  fake = tmp_path / "cpuinfo"
  fake.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: QEMU Virtual CPU version 2.5+\n"
                  "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2\n\n")
  script = 'mount --bind "$FAKE" /proc/cpuinfo || exit 77; exec "$@"'
  result = run_main("--model=neuron_inverter", "--logdir=%s" % (tmp_path / "run"),
                    prefix=("unshare", "-m", "sh", "-c", script, "sh"), env={"FAKE": str(fake)})
  assert result.returncode == 1, result.stderr[-2000:]
  assert_one_line_error(result, "QEMU Virtual CPU", "AVX", "-cpu host")
  assert not (tmp_path / "run").exists()


def _absl_tools() -> list:
  """The tools that parse absl flags (the reference's PyTorch tools use argparse, without absl)."""
  folder = pathlib.Path(REPO_ROOT, "tools")
  return sorted(path.stem for path in folder.glob("*.py") if "app.run(" in path.read_text())


TOOLS_WITH_FLAGS = _absl_tools()


@pytest.mark.parametrize("tool", TOOLS_WITH_FLAGS)
def test_a_tools_unknown_flag_is_one_line_and_exit_status_2(tool):
  """As main.py's: absl's own report is a FATAL line and a hint."""
  result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", tool + ".py"), "--no_such_flag=3"],
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert_names(result.stderr, "%s.py: error:" % tool, "'no_such_flag'")
