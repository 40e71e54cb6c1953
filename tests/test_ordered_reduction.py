"""The CPU replicas' gradient sum: one fixed order, kept through graph optimisation, on both strategies."""

import numpy as np
import pytest
import tensorflow as tf

from run_config import RunConfig
from strategies import ordered_reduction, select
from tests.conftest import TEST_CPU_DEVICES

SCALES = (1e4, 1.0, 1e-3, 1e2)  # unlike magnitudes: the order of the additions shows in the bits
REPLICAS = len(SCALES)


def _in_order(values):
  return ((values[0] + values[1]) + values[2]) + values[3]


def _first_and_third_swapped(values):  # the order AddN takes when it forwards the third input's buffer
  return ((values[2] + values[1]) + values[0]) + values[3]


def _replica_values():
  """Four float32 vectors whose sum has other bits when the first and third change places (as AddN's
  forwarding does to its inputs), so that a test of the order can fail."""
  rng = np.random.default_rng(0)
  values = [(rng.standard_normal(4096) * scale).astype(np.float32) for scale in SCALES]
  assert (_in_order(values) != _first_and_third_swapped(values)).any()  # the precondition: the order shows
  return values


def _optimised_additions(accumulate):
  """(op, data inputs) of the additions in the graph of `accumulate` over four values made on
  alternating logical CPUs, as Grappler leaves it (the partition graphs that run); the values; the sum.
  The values are drawn in the graph by a stateful op: constants would be folded away, and Grappler
  leaves the additions of fed placeholders as they are."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(0)
    placed = []
    for index, scale in enumerate(SCALES):
      with tf.device("/device:CPU:%d" % (index % TEST_CPU_DEVICES)):
        placed.append(tf.random.normal([4096], seed=index) * scale)  # stateful: not folded into a constant
    with tf.device("/device:CPU:0"):
      total = accumulate(placed) * 0.5  # an op after it, as the optimizer's update is
  with tf.compat.v1.Session(graph=graph) as session:
    metadata = tf.compat.v1.RunMetadata()
    values, result = session.run((placed, total), run_metadata=metadata,
                                 options=tf.compat.v1.RunOptions(output_partition_graphs=True))
  additions = [(node.op, len([name for name in node.input if not name.startswith("^")]))
               for partition in metadata.partition_graphs for node in partition.node
               if node.op in ("Add", "AddV2", "AddN")]
  return additions, values, result


def test_the_sum_is_taken_left_to_right_in_the_replicas_order():
  values = _replica_values()
  summed = ordered_reduction.ordered_sum([tf.constant(value) for value in values]).numpy()
  assert summed.tobytes() == _in_order(values).tobytes()
  assert ordered_reduction.ordered_sum([tf.constant(values[0])]).numpy().tobytes() == values[0].tobytes()


def test_graph_optimisation_keeps_it_a_chain_of_two_operand_additions():
  additions, values, result = _optimised_additions(ordered_reduction.ordered_sum)
  assert additions == [("AddV2", 2)] * (REPLICAS - 1)
  assert (_in_order(values) != _first_and_third_swapped(values)).any()
  assert result.tobytes() == (_in_order(values) * np.float32(0.5)).tobytes()


def test_a_chain_on_one_device_is_folded_into_one_addn_as_the_module_says():
  # The reason the partial sums are placed on their operands' devices: without that, Grappler's
  # arithmetic optimizer makes the same four-input AddN that tf.math.add_n would.
  assert _optimised_additions(_in_order)[0] == [("AddN", REPLICAS)]
  assert _optimised_additions(tf.math.add_n)[0] == [("AddN", REPLICAS)]


@pytest.mark.parametrize("gradient_accumulation, strategy_class", [
    (1, tf.distribute.experimental.CentralStorageStrategy), (2, tf.distribute.MirroredStrategy)])
def test_both_cpu_strategies_reduce_with_the_fixed_order(gradient_accumulation, strategy_class):
  backend = select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=TEST_CPU_DEVICES,
                                            gradient_accumulation=gradient_accumulation))
  assert isinstance(backend.strategy, strategy_class)
  reduction = backend.strategy.extended._cross_device_ops  # pylint: disable=protected-access
  assert isinstance(reduction, tf.distribute.ReductionToOneDevice)
  assert reduction.accumulation_fn is ordered_reduction.ordered_sum
  values = backend.strategy.run(
      lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))
  assert float(backend.strategy.reduce("SUM", values, axis=None)) == sum(range(1, TEST_CPU_DEVICES + 1))
