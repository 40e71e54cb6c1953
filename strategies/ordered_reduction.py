"""The CPU replicas' gradient sum in one fixed order, so that a run's weights do not depend on timing.

Why: tf.distribute's ReductionToOneDevice adds the replicas' gradients with one `AddN`
(cross_device_ops.py, `_simple_reduce` -> `math_ops.add_n`). TensorFlow's CPU kernel for it
(tensorflow/core/kernels/aggregate_ops.cc, `AddNOp::Compute`, TF 2.6 to 2.21) writes the sum into the
first input whose buffer it may take over (`forward_input_to_output_with_shape`: the buffer has no
other user at that moment) and, when that input is not the first, swaps it to the front. With 4
replicas the sum is then ((g_k + g1) + g2) + g0 ... instead of ((g0 + g1) + g2) + g3: other bits.
Whether a buffer has another user depends on which ops have finished, so on timing. The default job
showed it in `batch_norm/beta`'s gradient alone, the one per-replica gradient that another op also
reads (TensorFlow's gradient of `beta - mean * inv` in `tf.nn.batch_normalization` hands the same
tensor to beta and, negated, to the mean's side): `tools/repeat_step.py` can see a second result there
(about twice in 25,000 repeats with AddN's sum), and where whole runs' weights diverged, a per-step
digest found the first difference in beta and its Adam slots alone (docs/performance.md, "The
fixed-order gradient sum").

How: the sum as a chain of two-operand additions, ((g0 + g1) + g2) + g3, the order that `AddN`
takes when nothing is swapped (so the usual weights stay the same). Floating-point addition of two
numbers is commutative to the bit, so a swap inside one addition changes nothing. Each partial sum is
placed on the device of its newest operand: Grappler's arithmetic optimizer folds a chain of additions
on one device back into a single `AddN` (AddOpsRewriteStage in
tensorflow/core/grappler/optimizers/arithmetic_optimizer.cc absorbs only inputs on the root's device),
and the logical CPU devices share one memory, so the placement costs no copy.

strategies/cpu.py gives it to MirroredStrategy as its cross-device ops, and puts it in place of
CentralStorageStrategy's own reduction, which takes none (`tf_workarounds.replace_central_storage_reduction`).
"""

import contextlib

import tensorflow as tf


def ordered_sum(values: list) -> tf.Tensor:
  """The sum of `values` (dense tensors of one shape) as ((v0 + v1) + v2) + ..., placed so that graph
  optimisation keeps it a chain of two-operand additions (module docstring)."""
  total = values[0]
  for value in values[1:]:
    with tf.device(value.device) if value.device else contextlib.nullcontext():
      total = tf.math.add(total, value)
  return total


def reduction_to_one_device(reduce_to_device=None) -> tf.distribute.CrossDeviceOps:
  """tf.distribute's reduction through one device, with the fixed order of `ordered_sum`."""
  return tf.distribute.ReductionToOneDevice(reduce_to_device=reduce_to_device, accumulation_fn=ordered_sum)
