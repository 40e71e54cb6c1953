"""The cellSpike tf.data pipeline: sharding, shuffling within shards, streaming vs in-memory, dtypes."""

import os
import subprocess
import sys

import hypothesis
import h5py
import hypothesis.strategies as st
import numpy as np
import pytest
import tensorflow as tf

from data import cellspike, hdf5_native
from data.splits import Arrays, BatchLayout, eval_layout, split_from_arrays
from errors import UserError
from run_config import RunConfig
from tests.support.cellspike_files import write_cellspike, write_row_marked
from tests.support.helpers import assert_names

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(path, **kwargs):
  base = dict(model="neuron_inverter", data_path=str(path), batch_size=4, read_chunk=8,
              shuffle_buffer=16, seed=1)
  base.update(kwargs)
  return RunConfig(**base)


def _epoch_rows(split, replicas, dataset=None):
  """Row ids per replica for one pass, each global batch split into equal parts in order, the way
  tf.distribute splits global batches (a short last one too)."""
  per_replica = [[] for _ in range(replicas)]
  for frames, targets in (split.dataset if dataset is None else dataset):
    rows = frames.numpy()[:, 0, 0].astype(int)
    np.testing.assert_array_equal(rows, targets.numpy()[:, 0].astype(int))  # frames stay with targets
    for r, part in enumerate(np.split(rows, replicas)):
      per_replica[r].extend(part)
  return per_replica


@pytest.mark.parametrize("in_memory", [False, True])
def test_shards_are_contiguous_disjoint_equal_and_shuffled_within(tmp_path, in_memory):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=103)
  splits = cellspike.load(_config(path, in_memory=in_memory), BatchLayout(3, 4))
  assert splits.train.steps == 8                   # 103 // 3 // 4 * 4 = 32 rows per shard, 8 batches
  first, second = _two_epochs(splits.train, 3, 4)
  for r in range(3):
    assert sorted(first[r]) == list(range(32 * r, 32 * (r + 1)))   # its own contiguous block, all of it
    assert sorted(second[r]) == sorted(first[r])
    assert first[r] != sorted(first[r])                            # shuffled ...
    assert first[r] != second[r]                                   # ... differently every epoch


def _two_epochs(split, replicas, batch_size):
  """The first two passes of the split's endless stream (what one Keras iterator reads)."""
  stream = split.epochs_from(0).take(2 * split.steps)
  rows = _epoch_rows(split, replicas, stream)
  per_epoch = split.steps * batch_size
  return [r[:per_epoch] for r in rows], [r[per_epoch:] for r in rows]


def test_order_depends_only_on_seed_and_epoch(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  run_a = cellspike.load(_config(path), BatchLayout(2, 4))
  _, second_epoch = _two_epochs(run_a.train, 2, 4)
  resumed = cellspike.load(_config(path), BatchLayout(2, 4), first_epoch=1)
  assert _epoch_rows(resumed.train, 2) == second_epoch
  first_epoch = _epoch_rows(cellspike.load(_config(path), BatchLayout(2, 4)).train, 2)
  other_seed = cellspike.load(_config(path, seed=2), BatchLayout(2, 4))
  assert _epoch_rows(other_seed.train, 2) != first_epoch


def test_validation_is_not_shuffled_and_batches_are_static(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  splits = cellspike.load(_config(path), BatchLayout(2, 4))
  assert _epoch_rows(splits.validation, 2) == [list(range(12)), list(range(12, 24))]
  assert splits.train.dataset.element_spec[0].shape.as_list() == [8, 16, 4]
  assert tf.data.experimental.cardinality(splits.train.dataset).numpy() == splits.train.steps


@pytest.mark.parametrize("in_memory", [False, True])
def test_evaluation_that_keeps_the_tail_reads_every_row_once_in_order(tmp_path, in_memory):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64, n_eval=27)
  splits = cellspike.load(_config(path, in_memory=in_memory), BatchLayout(2, 4, eval_keeps_tail=True))
  validation = splits.validation
  # Two shards of 27 // 2 = 13 rows: 3 whole batches of 4 and one of 1 each; 1 row of 27 left out.
  assert (validation.steps, validation.samples) == (4, 26)
  assert [len(frames) for frames, _ in validation.dataset] == [8, 8, 8, 2]
  assert _epoch_rows(validation, 2) == [list(range(13)), list(range(13, 26))]
  again = _epoch_rows(validation, 2, validation.epochs_from(0).take(2 * validation.steps))
  assert again == [2 * list(range(13)), 2 * list(range(13, 26))]      # every pass ends with the tail
  # Training still takes whole batches of a static shape, and a capped evaluation whole ones too.
  assert splits.train.dataset.element_spec[0].shape.as_list() == [8, 16, 4]
  capped = cellspike.load(_config(path, eval_steps=2), BatchLayout(2, 4, eval_keeps_tail=True)).validation
  assert (capped.steps, capped.samples) == (2, 16)


def test_keras_evaluates_every_row_over_replicas_when_the_tail_is_kept(tmp_path):
  """A short last global batch is split between the replicas, and Keras weights each replica's mean
  by its rows: the loss is the mean over all 26 rows (the whole-batch one, over 24, differs)."""
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64, n_eval=27)
  validation = cellspike.load(_config(path), BatchLayout(2, 4, eval_keeps_tail=True)).validation
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    inputs = tf.keras.Input((16, 4))
    net = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(tf.keras.layers.Flatten()(inputs)))
    net.compile(loss="mse")
  loss = net.evaluate(validation.dataset, steps=validation.steps, verbose=0)
  frames = np.broadcast_to(np.arange(26, dtype=np.float32)[:, None, None], (26, 16, 4))
  squared = (net.predict(frames, verbose=0) - np.arange(26, dtype=np.float32)[:, None]) ** 2
  assert loss == pytest.approx(float(np.mean(squared)), rel=1e-5)
  assert loss != pytest.approx(float(np.mean(squared[:24])), rel=1e-3)


def test_an_evaluation_split_smaller_than_a_batch_is_read_whole_or_refused_where_batches_are_whole(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64, n_eval=3)
  validation = cellspike.load(_config(path), BatchLayout(1, 4, eval_keeps_tail=True)).validation
  assert (validation.steps, validation.samples) == (1, 3)
  with pytest.raises(UserError) as caught:
    cellspike.load(_config(path), BatchLayout(4, 4, eval_keeps_tail=True))
  assert_names(caught.value, "rows.h5: ", "val split", "3 samples", "4 shards", "one sample", "--replicas")
  with pytest.raises(UserError) as caught:
    cellspike.load(_config(path), BatchLayout(1, 4))
  assert_names(caught.value, "val split", "3 samples", "1 shard", "batch of 4", "--batch_size")


def test_replicas_that_take_elements_in_turn_each_end_with_a_short_batch(tmp_path):
  """Multi-worker layouts: each replica reads its own part, and all of them get their short batch in
  the last step, from a file and from arrays alike."""
  layout = BatchLayout(2, 4, element_per_replica=True, eval_keeps_tail=True)
  expected = [[0, 1, 2, 3], [13, 14, 15, 16], [4, 5, 6, 7], [17, 18, 19, 20], [8, 9, 10, 11],
              [21, 22, 23, 24], [12], [25]]                     # 2 parts of 27 // 2 = 13 rows, in turn
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64, n_eval=27)
  validation = cellspike.load(_config(path), layout).validation
  assert (validation.steps, validation.samples) == (4, 26)
  assert [frames.numpy()[:, 0, 0].astype(int).tolist() for frames, _ in validation.dataset] == expected
  rows = np.arange(27, dtype=np.float32)[:, None]
  test = split_from_arrays(Arrays(rows, rows), eval_layout(layout), lambda x, y: (x, y), False, 0, 0, "test")
  assert (test.steps, test.samples) == (4, 26)
  assert [x.numpy()[:, 0].astype(int).tolist() for x, _ in test.dataset] == expected


@pytest.mark.parametrize("element_per_replica", [False, True])
def test_synthetic_data_has_the_real_splits_steps_and_short_batches(tmp_path, element_per_replica):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64, n_eval=27)
  layout = BatchLayout(2, 4, element_per_replica=element_per_replica, eval_keeps_tail=True)
  real = cellspike.load(_config(path), layout)
  synthetic = cellspike.load(_config(path, synthetic_data=True), layout)
  for ours, theirs in ((synthetic.train, real.train), (synthetic.validation, real.validation)):
    assert (ours.steps, ours.samples) == (theirs.steps, theirs.samples)
    assert [len(x) for x, _ in ours.dataset] == [len(x) for x, _ in theirs.dataset]
  # Training batches of static shape, as the real data's: IPU infeeds refuse (None, 1600, 4).
  assert [spec.shape for spec in synthetic.train.dataset.element_spec] == [
      spec.shape for spec in real.train.dataset.element_spec]
  one_pass = [len(x) for x, _ in real.validation.dataset]
  assert one_pass[-1] < one_pass[0]                                   # the short batch
  stream = synthetic.validation.epochs_from(0).take(2 * len(one_pass))
  assert [len(x) for x, _ in stream] == 2 * one_pass                  # every pass ends with it


def test_fp16_file_stays_float16_on_the_host(tmp_path):
  path = write_cellspike(str(tmp_path / "c.h5"), dtype=np.float16)
  splits = cellspike.load(_config(path), BatchLayout(1, 4))
  frames, targets = next(iter(splits.train.dataset))
  assert frames.dtype == tf.float16 and targets.dtype == tf.float16 and frames.shape == (4, 1600, 4)
  assert splits.summary_extras["mean_predictor_val_loss"] == pytest.approx(1 / 3, rel=0.3)


@pytest.mark.parametrize("storage", [dict(chunks=(5, 16, 4), compression="gzip", shuffle=True),
                                     dict(dtype=">f4")])
def test_chunked_compressed_and_big_endian_files_read_the_same_batches(tmp_path, storage):
  """A contiguous file is memory-mapped; a chunked/compressed one is staged; both give equal batches."""
  plain = write_row_marked(str(tmp_path / "plain.h5"), n_train=64)
  other = write_row_marked(str(tmp_path / "other.h5"), n_train=64, **storage)
  layout = BatchLayout(2, 4, first_shard=2, num_shards=4)   # a second process: staging its rows only
  for split in ("train", "validation"):
    batches = [getattr(cellspike.load(_config(p, stage_dir=str(tmp_path / "stage")), layout), split)
               for p in (plain, other)]
    for (x_a, y_a), (x_b, y_b) in zip(*(b.epochs_from(1).take(6) for b in batches)):
      np.testing.assert_array_equal(x_a.numpy(), x_b.numpy())
      np.testing.assert_array_equal(y_a.numpy(), y_b.numpy())


def test_splits_linked_from_another_file_read_that_files_rows(tmp_path):
  """An external link's dataset lives in the linked file: mapped at its offset in the outer file it
  read other bytes (a validation loss of inf); it is staged through h5py instead."""
  plain = write_row_marked(str(tmp_path / "plain.h5"), n_train=64)
  with h5py.File(plain, "r") as source, h5py.File(str(tmp_path / "links.h5"), "w") as links:
    for key in source:
      links[key] = h5py.ExternalLink("plain.h5", key)
  for split in ("train", "validation"):
    batches = [getattr(cellspike.load(_config(p), BatchLayout(2, 4)), split)
               for p in (plain, str(tmp_path / "links.h5"))]
    for (x_a, y_a), (x_b, y_b) in zip(*(b.epochs_from(1).take(6) for b in batches)):
      np.testing.assert_array_equal(x_a.numpy(), x_b.numpy())
      np.testing.assert_array_equal(y_a.numpy(), y_b.numpy())


def test_the_baselines_cover_the_rows_the_evaluation_reads(tmp_path):
  """With --eval_steps the losses cover part of a split: their baseline, over all of it, compared unlike
  figures ("0.994 of the baseline" for a model no better than it)."""
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64, n_eval=64)
  mean = cellspike.training_mean(path)
  with h5py.File(path, "r") as f:
    targets = f["val_unitStar_par"][:].astype(np.float64)
  def baseline(rows):
    return float(np.mean((targets[rows] - mean) ** 2))
  whole = cellspike.load(_config(path), BatchLayout(2, 4)).summary_extras["mean_predictor_val_loss"]
  assert whole == pytest.approx(baseline(np.arange(64)), rel=1e-12)
  capped = cellspike.load(_config(path, eval_steps=2), BatchLayout(2, 4))   # 8 rows of each 32-row shard
  assert capped.validation.samples == 16
  assert capped.summary_extras["mean_predictor_val_loss"] == pytest.approx(
      baseline(np.r_[0:8, 32:40]), rel=1e-12)
  assert capped.summary_extras["mean_predictor_val_loss"] != pytest.approx(whole, rel=1e-6)


def test_steps_per_epoch_caps_the_split(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  splits = cellspike.load(_config(path, steps_per_epoch=3, eval_steps=1), BatchLayout(1, 4))
  assert splits.train.steps == 3 and len(list(splits.train.dataset)) == 3
  assert splits.validation.steps == 1


def test_too_few_samples_for_the_shards(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  with pytest.raises(UserError, match="24 samples.*7 shard"):
    cellspike.load(_config(path), BatchLayout(7, 4))


def _plan(**kwargs):
  base = dict(block=(1000, 1000 + 60 * 8), batch_rows=8, batches=60, chunk_rows=16, window_chunks=3,
              shuffle=True, seed=3, shard=1, whole_block=False)
  base.update(kwargs)
  return cellspike.ShardPlan(**base)


def test_streaming_order_visits_shuffled_chunks_and_shuffles_within_windows():
  plan = _plan()
  order = cellspike.epoch_rows(plan, 5).numpy().reshape(-1)
  assert sorted(order) == list(range(480))                      # every row once, relative to the block
  windows = [order[i:i + 48] for i in range(0, 480, 48)]         # 3 chunks of 16 rows
  assert all(len(set(w // 16)) == 3 for w in windows)            # each window: rows of 3 whole chunks
  assert [w.min() // 16 for w in windows] != sorted(w.min() // 16 for w in windows)   # chunks shuffled
  assert any(list(w) != sorted(w) for w in windows)              # rows shuffled within the window
  np.testing.assert_array_equal(order, cellspike.epoch_rows(plan, 5).numpy().reshape(-1))
  assert list(order) != list(cellspike.epoch_rows(plan, 6).numpy().reshape(-1))
  assert list(order) != list(cellspike.epoch_rows(_plan(shard=2), 5).numpy().reshape(-1))


def test_in_memory_order_shuffles_the_whole_block_and_evaluation_keeps_file_order():
  order = cellspike.epoch_rows(_plan(whole_block=True), 0).numpy().reshape(-1)
  assert sorted(order) == list(range(480)) and len(set(order[:48] // 16)) > 3
  np.testing.assert_array_equal(cellspike.epoch_rows(_plan(shuffle=False), 0).numpy().reshape(-1),
                                np.arange(480))
  assert cellspike.chunk_rows_for(512, 192) == 384 and cellspike.chunk_rows_for(100, 192) == 192


def test_ipu_layout_feeds_replicas_in_turn_and_trims_to_whole_optimizer_steps(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=100)
  layout = BatchLayout(2, 4, element_per_replica=True, steps_multiple=4)
  split = cellspike.load(_config(path, shuffle_buffer=8, read_chunk=8), layout).train
  assert split.steps == 12                                  # 100 // 2 // 4 = 12 micro-batches, 3 x G=4
  elements = [x.numpy()[:, 0, 0].astype(int) for x, _ in split.dataset]
  assert len(elements) == 24 and all(len(e) == 4 for e in elements)
  assert all(e.max() < 48 for e in elements[0::2]) and all(e.min() >= 48 for e in elements[1::2])


def test_accumulation_layout_folds_micro_batches_per_replica(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  layout = BatchLayout(2, 8, eval_replica_rows=4)           # micro-batch 4 x G 2, 2 replicas
  splits = cellspike.load(_config(path), layout)
  assert splits.train.dataset.element_spec[0].shape[0] == 16 and splits.train.steps == 4
  assert splits.validation.dataset.element_spec[0].shape[0] == 8


def test_processes_read_disjoint_shards_of_the_same_file(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  rows = []
  for process in range(2):   # 2 processes x 2 replicas each = 4 shards of 16 rows
    layout = BatchLayout(2, 4, first_shard=2 * process, num_shards=4)
    rows.append(_epoch_rows(cellspike.load(_config(path), layout).train, 2))
  assert [sorted(r) for r in rows[0]] == [list(range(0, 16)), list(range(16, 32))]
  assert [sorted(r) for r in rows[1]] == [list(range(32, 48)), list(range(48, 64))]


_PEAK_RSS_CHILD = """
import resource, sys
import numpy as np
import tensorflow as tf
from data import hdf5_native
for path, size, offset, row_bytes in zip(*[iter(sys.argv[1:])] * 4):
  offset, row_bytes = int(offset), int(row_bytes)
  layout = hdf5_native.RowLayout(path=path, offset=offset, row_shape=(row_bytes,), dtype=np.dtype("uint8"),
                                 file_size=int(size), rows=10)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  rows = tf.data.Dataset.from_tensors(tf.constant([0, 5, 9], tf.int64)).repeat(3)
  batches = tf.data.Dataset.zip((hdf5_native.mapped_file(layout.path, layout.file_size), rows)).map(
      lambda file_bytes, r: hdf5_native.gather_rows(layout, file_bytes, r))
  assert sum(int(tf.reduce_sum(tf.cast(b, tf.int64))) for b in batches) == 3 * 3 * row_bytes * 7
  print(path, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
_MAPPED_FILES = {"aligned": (0, 1024, 0), "odd-sized": (10, 30, 30)}   # offset, row bytes, bytes after the rows


@pytest.fixture(scope="module")
def peak_rss_growth(tmp_path_factory):
  """How much one process's peak RSS grew while it read 3 batches of rows from each sparse file of 600 MB
  (+ tail) of _MAPPED_FILES, one file after the other; the growth by file name. One process for both: a
  copy of the second file would raise the peak above the first's by its 600 MB as well."""
  folder, args = tmp_path_factory.mktemp("mapped"), []
  for name, (offset, row_bytes, tail) in _MAPPED_FILES.items():
    path, size = str(folder / (name + ".bin")), 600 * 2**20 + tail
    with open(path, "wb") as f:   # rows of bytes 7; the rest of the file is a hole that reads as zeros
      f.write(b"\x00" * offset + b"\x07" * 10 * row_bytes)
      f.truncate(size)
    args += [path, str(size), str(offset), str(row_bytes)]
  child = subprocess.run([sys.executable, "-c", _PEAK_RSS_CHILD] + args, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
  assert child.returncode == 0, child.stderr[-2000:]
  return {os.path.basename(path)[:-len(".bin")]: int(growth)
          for path, growth in (line.split() for line in child.stdout.splitlines())}


@pytest.mark.parametrize("name", list(_MAPPED_FILES))
def test_mapping_a_file_costs_no_memory_in_proportion_to_its_size(peak_rss_growth, name):
  """TensorFlow would constant-fold the mapping and copy the whole file (hdf5_native's docstring); also
  with 10-byte units at offset 10 in a file of 600 MB + 30 bytes."""
  size = 600 * 2**20 + _MAPPED_FILES[name][2]
  growth = peak_rss_growth[name]
  assert growth < size / 4, "peak RSS grew by %.0f MB for a %.0f MB file" % (growth / 2**20, size / 2**20)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(offset=st.integers(0, 10**6), row_bytes=st.integers(1, 20000), rows=st.integers(1, 500),
                  tail=st.integers(0, 10**5))
def test_the_gathers_view_of_a_file_is_aligned_and_covers_the_dataset(offset, row_bytes, rows, tail):
  """A view whose end is not 64-byte aligned is a copy of the whole file at every batch (TensorFlow's
  Slice): a 895 MB file streamed 4,839 samples/s instead of 353,210."""
  file_size = offset + rows * row_bytes + tail
  layout = hdf5_native.RowLayout(path="f", offset=offset, row_shape=(row_bytes,), dtype=np.dtype("uint8"),
                                 file_size=file_size, rows=rows)
  viewed = layout.viewed_bytes
  assert offset + rows * row_bytes <= viewed <= file_size and viewed % layout.unit == 0
  if tail >= layout.unit * 64:   # room after the dataset for an end aligned to both
    assert viewed % 64 == 0


@pytest.mark.parametrize("in_memory", [False, True])
def test_the_pipelines_functions_are_traced_without_autograph(tmp_path, monkeypatch, in_memory):
  """AutoGraph parses each function it converts again from source: 36 conversions, about 0.4 s of a
  short main.py run's start-up, for functions whose only branches are on Python values. The MNIST
  path (split_from_arrays) is included."""
  from tensorflow.python.autograph.pyct import transpiler  # pylint: disable=import-outside-toplevel
  converted, transform = [], transpiler.PyToPy.transform
  def recording(self, obj, user_context):
    converted.append("%s.%s" % (getattr(obj, "__module__", "?"), getattr(obj, "__qualname__", obj)))
    return transform(self, obj, user_context)
  monkeypatch.setattr(transpiler.PyToPy, "transform", recording)
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=103)
  splits = cellspike.load(_config(path, in_memory=in_memory), BatchLayout(3, 4))
  arrays = Arrays(np.zeros((24, 2), np.uint8), np.arange(24))
  in_memory_split = split_from_arrays(arrays, BatchLayout(2, 4), lambda x, y: (tf.cast(x, tf.float32), y),
                                      shuffle=True, seed=0, max_steps=0, name="train")
  for split in (splits.train, splits.validation, in_memory_split):
    next(iter(split.epochs_from(0) if split.stream else split.dataset))
  assert converted == [], converted
