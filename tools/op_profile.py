"""Where the time of a profiled run goes, op by op: a table from the TensorBoard profile that
`main.py --profile_dir=DIR` writes (steps 2-4 of the first epoch on CPU/GPU).

    python main.py --model=neuron_inverter --epochs=1 --steps_per_epoch=6 --profile_dir=/tmp/prof
    python tools/op_profile.py --profile_dir=/tmp/prof [--top=25] [--json=ops.json]

It reads the newest `*.xplane.pb` under DIR (the profiler's raw trace, the file TensorBoard's profile
plugin shows) and sums the time of each TensorFlow op over the executor threads, per profiled step.
The shares are of the total op time: with several threads it exceeds the wall time of a step.
"""

import collections
import glob
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from errors import UserError, parse_flags, report_missing_packages  # noqa: E402  pylint: disable=wrong-import-position
from host.output_paths import check_output_path  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing
from host import atomic_files  # noqa: E402  pylint: disable=wrong-import-position

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position


FLAGS = flags.FLAGS
# Events on executor threads that wrap ops rather than being ops.
_WRAPPERS = {"ExecutorState::Process", "ParallelFor", "ParallelForFixedBlockSize"}


def define_flags():
  flags.DEFINE_string("profile_dir", None, "The --profile_dir of a main.py run.", required=True)
  flags.DEFINE_integer("top", 25, "Ops to list.", lower_bound=1)
  flags.DEFINE_string("json", None, "Also write the whole table to this JSON file.")


def _xplane_module():
  """The profiler's protobuf module; importing it imports TensorFlow, whose CUDA probe stays quiet."""
  from strategies.environment import quiet_cuda_probe  # pylint: disable=import-outside-toplevel
  with quiet_cuda_probe():
    try:  # TF >= 2.12
      from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    except ImportError:  # TF 2.6
      from tensorflow.core.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  return xplane_pb2


def newest_trace(profile_dir: str) -> str:
  traces = [path for path in glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True)
            if os.path.isfile(path)]  # a folder of that name is no trace
  if not traces:
    raise UserError("--profile_dir=%s holds no profile (*.xplane.pb); run main.py with --profile_dir=%s "
                    "and at least 4 steps in the first epoch" % (profile_dir, profile_dir))
  return max(traces, key=os.path.getmtime)


def _op_type(name: str) -> str:
  """"gradient_tape/model/conv2/Conv2DBackpropInput:_MklNativeConv2DBackpropInput" -> the kernel."""
  return name.rsplit(":", 1)[-1]


def op_times(path: str) -> dict:
  """{"steps": n, "ops": [{"name", "type", "ms_per_step", "calls_per_step"}...]} sorted by time."""
  from google.protobuf.message import DecodeError  # pylint: disable=import-outside-toplevel
  space = _xplane_module().XSpace()
  try:
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
  except OSError as error:
    raise UserError("%s: cannot read it (%s)" % (path, error.strerror or error)) from None
  except DecodeError as error:
    raise UserError("%s: not a profiler trace (an XSpace protobuf) or a damaged one (%s)"
                    % (path, " ".join(str(error).split()))) from None
  seconds, calls, steps = collections.Counter(), collections.Counter(), collections.defaultdict(set)
  for plane in space.planes:
    metadata = plane.event_metadata
    for line in plane.lines:
      for event in line.events:
        name = metadata[event.metadata_id].name
        if line.name.startswith("tf_Compute") or line.name.startswith("tf_inter_op"):
          if name not in _WRAPPERS:
            seconds[name] += event.duration_ps * 1e-12
            calls[name] += 1
        elif "train_function" in name:  # Keras' step, seen under one or two names (TF version)
          steps[name.split("_train_function")[0]].add(event.offset_ps)
  step_count = max((len(offsets) for offsets in steps.values()), default=0)
  if not step_count:  # the table is per step: an empty trace, or one of no Keras training step
    raise UserError("%s holds no profiled training step; profile a main.py run with --profile_dir and "
                    "at least 4 steps in the first epoch" % path)
  ops = [{"name": name, "type": _op_type(name), "ms_per_step": 1e3 * s / step_count,
          "calls_per_step": calls[name] / step_count} for name, s in seconds.most_common()]
  return {"trace": path, "steps": step_count, "ops": ops}


def by_type(ops: list) -> list:
  totals = collections.Counter()
  for op in ops:
    totals[op["type"]] += op["ms_per_step"]
  return totals.most_common()


def main(argv):
  del argv
  try:
    if FLAGS.json:  # checked first: a mistyped path would otherwise fail after the table
      check_output_path("--json", FLAGS.json)
    table = op_times(newest_trace(FLAGS.profile_dir))
  except UserError as error:
    print("error: %s" % error, file=sys.stderr)
    return 2
  total = sum(op["ms_per_step"] for op in table["ops"]) or 1.0
  print("%s: %d profiled step(s), %.1f ms of op time per step (all threads)"
        % (table["trace"], table["steps"], total))
  print("\n%8s %6s  %s" % ("ms/step", "share", "op"))
  for op in table["ops"][:FLAGS.top]:
    print("%8.2f %5.1f%%  %s" % (op["ms_per_step"], 100 * op["ms_per_step"] / total, op["name"]))
  print("\n%8s %6s  %s" % ("ms/step", "share", "kernel"))
  for kind, ms in by_type(table["ops"])[:FLAGS.top]:
    print("%8.2f %5.1f%%  %s" % (ms, 100 * ms / total, kind))
  if FLAGS.json:
    with atomic_files.replaced(FLAGS.json) as f:  # whole or not at all, never through a link
      json.dump(table, f, indent=1)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's CPU-feature banner is no part of the table
  define_flags()
  app.run(main, flags_parser=parse_flags)  # a bad flag: one `error:` line, exit status 2
