"""The cellSpike tf.data pipeline: sharding, shuffling within shards, streaming vs in-memory, dtypes."""

import numpy as np
import pytest
import tensorflow as tf

from data import cellspike
from data.splits import BatchLayout
from errors import UserError
from run_config import RunConfig
from tests.cellspike_files import write_cellspike, write_row_marked


def _config(path, **kwargs):
  base = dict(model="neuron_inverter", data_path=str(path), batch_size=4, read_chunk=8,
              shuffle_buffer=16, seed=1)
  base.update(kwargs)
  return RunConfig(**base)


def _epoch_rows(split, replicas, batch_size):
  """Row ids per replica for one pass, split the way tf.distribute splits global batches."""
  per_replica = [[] for _ in range(replicas)]
  for frames, targets in split.dataset:
    rows = frames.numpy()[:, 0, 0].astype(int)
    np.testing.assert_array_equal(rows, targets.numpy()[:, 0].astype(int))  # frames stay with targets
    for r in range(replicas):
      per_replica[r].extend(rows[r * batch_size:(r + 1) * batch_size])
  return per_replica


@pytest.mark.parametrize("in_memory", [False, True])
def test_shards_are_contiguous_disjoint_equal_and_shuffled_within(tmp_path, in_memory):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=103)
  splits = cellspike.load(_config(path, in_memory=in_memory), BatchLayout(3, 4))
  assert splits.train.steps == 8                   # 103 // 3 // 4 * 4 = 32 rows per shard, 8 batches
  first, second = _epoch_rows(splits.train, 3, 4), _epoch_rows(splits.train, 3, 4)
  for r in range(3):
    assert sorted(first[r]) == list(range(32 * r, 32 * (r + 1)))   # its own contiguous block, all of it
    assert sorted(second[r]) == sorted(first[r])
    assert first[r] != sorted(first[r])                            # shuffled ...
    assert first[r] != second[r]                                   # ... differently every epoch


def test_order_depends_only_on_seed_and_epoch(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  run_a = cellspike.load(_config(path), BatchLayout(2, 4))
  _epoch_rows(run_a.train, 2, 4)
  second_epoch = _epoch_rows(run_a.train, 2, 4)
  resumed = cellspike.load(_config(path), BatchLayout(2, 4), first_epoch=1)
  assert _epoch_rows(resumed.train, 2, 4) == second_epoch
  first_epoch = _epoch_rows(cellspike.load(_config(path), BatchLayout(2, 4)).train, 2, 4)
  other_seed = cellspike.load(_config(path, seed=2), BatchLayout(2, 4))
  assert _epoch_rows(other_seed.train, 2, 4) != first_epoch


def test_validation_is_not_shuffled_and_batches_are_static(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  splits = cellspike.load(_config(path), BatchLayout(2, 4))
  assert _epoch_rows(splits.validation, 2, 4) == [list(range(12)), list(range(12, 24))]
  assert splits.train.dataset.element_spec[0].shape.as_list() == [8, 16, 4]
  assert tf.data.experimental.cardinality(splits.train.dataset).numpy() == splits.train.steps


def test_fp16_file_feeds_float32(tmp_path):
  path = write_cellspike(str(tmp_path / "c.h5"), dtype=np.float16)
  splits = cellspike.load(_config(path), BatchLayout(1, 4))
  frames, targets = next(iter(splits.train.dataset))
  assert frames.dtype == tf.float32 and targets.dtype == tf.float32 and frames.shape == (4, 1600, 4)
  assert splits.summary_extras["mean_predictor_val_loss"] == pytest.approx(1 / 3, rel=0.3)


def test_steps_per_epoch_caps_the_split(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  splits = cellspike.load(_config(path, steps_per_epoch=3, eval_steps=1), BatchLayout(1, 4))
  assert splits.train.steps == 3 and len(list(splits.train.dataset)) == 3
  assert splits.validation.steps == 1


def test_too_few_samples_for_the_shards(tmp_path):
  path = write_row_marked(str(tmp_path / "rows.h5"), n_train=64)
  with pytest.raises(UserError, match="val split has 24 samples: too few for 7 shard"):
    cellspike.load(_config(path), BatchLayout(7, 4))


def test_streaming_memory_is_bounded_by_the_window():
  reader = cellspike.BlockReader("x.h5", "train", (0, 1_000_000), 192, 512, 4096, 0, 0, True, False)
  assert reader.memory_rows == 4096 + 192
  in_memory = cellspike.BlockReader("x.h5", "train", (0, 1_000_000), 192, 512, 4096, 0, 0, True, True)
  assert in_memory.memory_rows == 1_000_000


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
    rows.append(_epoch_rows(cellspike.load(_config(path), layout).train, 2, 4))
  assert [sorted(r) for r in rows[0]] == [list(range(0, 16)), list(range(16, 32))]
  assert [sorted(r) for r in rows[1]] == [list(range(32, 48)), list(range(48, 64))]
