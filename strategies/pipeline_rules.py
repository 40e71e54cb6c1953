"""Graphcore's rules for IPU placement and pipelined models, as plain Python (no TensorFlow), written
once: `flags.py` checks the command line with them before TensorFlow starts, and `strategies/ipu.py`
checks its RunConfig (from a saved run too) and applies them to the splits.

Sources: graphcore/tensorflow `compiler/plugin/poplar/driver/visitors/pipeline_visitor.cc`
(VerifyPipelineArgumentsFixed), `pipeline_visitor_utils.h` (ScheduleOffsets) and
`python/ipu/ops/pipelining_ops.py`.
"""


def ipu_count_problem(replicas: int, ipus_per_replica: int):
  """IPU devices (multi-IPU groups) come in powers of two: why this count is not one, or None."""
  total = replicas * ipus_per_replica
  if total & (total - 1) == 0:
    return None
  return ("--replicas=%d x --ipus_per_replica=%d = %d IPUs: IPU devices come in powers of two "
          "(1, 2, 4, 8, ...)" % (replicas, ipus_per_replica, total))


def ipu_flag_problem(values: dict):
  """The IPU backend's flag rule (strategies/registry.py FLAG_RULES) over the parsed flag values."""
  return ipu_count_problem(values["replicas"], values["ipus_per_replica"])


def stage_devices(stages: int, ipus_per_replica: int) -> list:
  """The pipeline's device mapping: stage i on IPU i mod ipus_per_replica."""
  return [i % ipus_per_replica for i in range(stages)]


def pipeline_overlap(schedule: str, stages: int, ipus_per_replica: int, training: bool) -> int:
  """The multiple a pipeline's iteration count must be (and its least value).

  pipeline_visitor.cc: "The number of iterations of the pipeline must be a multiple of N", N =
  ScheduleOffsets(stage mapping).size(): Grouped, every stage of the mapping; Interleaved, the
  rotations of the mapping that share no device at any position; Sequential, 1. A training
  pipeline's mapping has its backward stages appended in reverse, so Grouped training needs
  2 x stages and inference only `stages`.
  """
  if schedule == "sequential" or stages == 1:
    return 1
  mapping = stage_devices(stages, ipus_per_replica)
  if training:
    mapping += mapping[::-1]
  if schedule == "grouped":
    return len(mapping)
  rotated = lambda k: mapping[k:] + mapping[:k]  # noqa: E731
  offsets = [0]
  for shift in range(1, len(mapping)):
    if all(a != b for k in offsets for a, b in zip(rotated(k), rotated(shift))):
      offsets.append(shift)
  return len(offsets)


def pipeline_problem(schedule: str, stages: int, ipus_per_replica: int, accumulation: int):
  """Why these training settings cannot run as a pipeline (one line), or None."""
  if stages < ipus_per_replica:
    # stage_devices puts stage i on IPU i: with fewer stages, a replica's last IPUs hold nothing, and IPU
    # Keras, which counts a replica's IPUs from the mapping (keras/ipu/extensions/extensions_base.py
    # `_get_shard_count`), would make more replicas than --replicas of fewer IPUs each.
    return ("--pipeline_stages must be at least --ipus_per_replica (every IPU of a replica needs a stage): "
            "--pipeline_stages=%d with --ipus_per_replica=%d" % (stages, ipus_per_replica))
  if schedule == "interleaved" and stages > ipus_per_replica:
    # pipelining_ops.py: "The pipelining schedule 'Interleaved' does not currently support multiple
    # pipeline stages on the same device for training graphs."
    return ("--pipeline_schedule=interleaved needs one IPU per stage in training: --pipeline_stages=%d "
            "with --ipus_per_replica=%d (use grouped or sequential)" % (stages, ipus_per_replica))
  multiple = pipeline_overlap(schedule, stages, ipus_per_replica, training=True)
  if accumulation % multiple:
    return ("--pipeline_schedule=%s with %d stages needs --gradient_accumulation to be a multiple of %d "
            "(got %d): the pipeline must fill and drain within one step"
            % (schedule, stages, multiple, accumulation))
  return None
