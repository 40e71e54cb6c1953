"""Device monitoring into TensorBoard: "is there an nvidia-smi for IPUs?" -- yes, and this samples it.

    python tools/monitor.py --logdir=logs/run1 -- python main.py --model=neuron_inverter --logdir=logs/run1
    python tools/monitor.py --logdir=logs/run1 --duration=600          # sample for 10 minutes

Every `--interval` seconds it samples the IPUs (`gc-info -d <id> --device-info`: utilisation, die
temperature, board power, clock -- the attributes gc-monitor shows), the GPUs (`nvidia-smi`'s CSV query)
or, always, the host (CPU and memory, psutil), and writes them as TensorBoard scalars under
`<logdir>/monitor`, beside the run's own curves. With a command after `--` it runs that command and
samples until it exits, returning its exit status; without one, it samples for `--duration` seconds,
or with none given until Ctrl-C.
"""

import math
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import UserError, parse_flags, report_missing_packages, with_one_line_errors  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

def define_flags() -> None:
  """Flags only when run as a program: tests import this module beside main.py's flags."""
  flags.DEFINE_string("logdir", None, "Run folder; samples go to <logdir>/monitor.", required=True)
  flags.DEFINE_float("interval", 5.0, "Seconds between samples.", lower_bound=0.1)
  flags.DEFINE_float("duration", 0.0, "Stop after this many seconds (0: until the command exits; without "
                     "a command, until Ctrl-C).", lower_bound=0.0)
  # The bounds let inf and nan through: time.sleep(inf) overflows, and a nan duration never ends.
  for name in ("interval", "duration"):
    flags.register_validator(name, math.isfinite, message="--%s must be a finite number of seconds" % name)
  flags.DEFINE_enum("source", "auto", ["auto", "ipu", "gpu", "host"], "What to sample besides the host: "
                    "auto picks IPUs if gc-info exists, else GPUs if nvidia-smi exists.")
  flags.DEFINE_list("ipu_ids", ["0"], "IPU device ids for gc-info (see gc-info -l).")


FLAGS = flags.FLAGS

NVIDIA_QUERY = "index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu"
_NVIDIA_NAMES = ("utilization_percent", "memory_used_mib", "memory_total_mib", "power_w", "temperature_c")
_GC_INFO_KEYS = {"ipu utilisation": "utilisation_percent", "average die temp": "die_temperature_c",
                 "average board temp": "board_temperature_c", "total board power": "board_power_w",
                 "clock": "clock_mhz"}


def _number(text: str):
  match = re.search(r"-?\d+(\.\d+)?", text)
  return float(match.group(0)) if match else None


def parse_nvidia_smi(output: str) -> dict:
  """`nvidia-smi --query-gpu=<NVIDIA_QUERY> --format=csv,noheader,nounits` -> {"gpu0/...": value}."""
  scalars = {}
  for line in output.strip().splitlines():
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != len(_NVIDIA_NAMES) + 1:
      continue
    for name, field in zip(_NVIDIA_NAMES, fields[1:]):
      value = _number(field)  # "[N/A]" (e.g. power on some boards) is skipped
      if value is not None:
        scalars["gpu%s/%s" % (fields[0], name)] = value
  return scalars


def parse_gc_info(output: str, ipu_id: str) -> dict:
  """`gc-info -d <id> --device-info` ("key: value" lines) -> {"ipu<id>/...": value}."""
  scalars = {}
  for line in output.splitlines():
    key, _, value = line.strip().partition(":")
    name = _GC_INFO_KEYS.get(key.strip())
    number = _number(value) if name else None
    if number is not None:
      scalars["ipu%s/%s" % (ipu_id, name)] = number
  return scalars


def sample_host() -> dict:
  import psutil  # pylint: disable=import-outside-toplevel
  memory = psutil.virtual_memory()
  return {"host/cpu_percent": psutil.cpu_percent(interval=None),
          "host/memory_used_gib": (memory.total - memory.available) / 2**30,
          "host/memory_percent": memory.percent}


def _run(command) -> str:
  try:
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return ""  # a busy or missing tool skips one sample; the host sample still goes in


def sample(source: str, ipu_ids) -> dict:
  scalars = sample_host()
  if source == "ipu":
    for ipu_id in ipu_ids:
      scalars.update(parse_gc_info(_run(["gc-info", "-d", ipu_id, "--device-info"]), ipu_id))
  elif source == "gpu":
    scalars.update(parse_nvidia_smi(_run(["nvidia-smi", "--query-gpu=" + NVIDIA_QUERY,
                                          "--format=csv,noheader,nounits"])))
  return scalars


_SOURCE_TOOLS = {"ipu": "gc-info", "gpu": "nvidia-smi"}


def resolve_source(requested: str, ipu_ids=("0",)) -> str:
  """The source to sample; one asked for by name must have its tool (else only the host would be
  sampled, in silence)."""
  if requested in _SOURCE_TOOLS and not shutil.which(_SOURCE_TOOLS[requested]):
    raise UserError("--source=%s needs %s on the PATH, and there is none (--source=host samples only "
                    "the host)" % (requested, _SOURCE_TOOLS[requested]))
  if requested == "ipu" and not [ipu_id for ipu_id in ipu_ids if ipu_id.strip()]:
    raise UserError("--source=ipu needs --ipu_ids (gc-info -l lists them)")
  if requested != "auto":
    return requested
  if shutil.which("gc-info"):
    return "ipu"
  return "gpu" if shutil.which("nvidia-smi") else "host"


def check_arguments(logdir, command) -> None:
  """What would fail only after TensorFlow's start (the summary writer, Popen): one line, at once."""
  from host.output_paths import check_output_path  # pylint: disable=import-outside-toplevel
  check_output_path("--logdir", logdir, folder=True)
  if command and not shutil.which(command[0]):
    raise UserError("%s: command not found (not an executable file%s)" % (
        command[0], "" if os.sep in command[0] else " on the PATH"))


def monitor(logdir, interval, duration, source, ipu_ids, command=None) -> int:
  """Samples until `command` exits (or for `duration` s); returns the command's exit status (or 0)."""
  check_arguments(logdir, command)
  from strategies.environment import quiet_cuda_probe  # pylint: disable=import-outside-toplevel
  with quiet_cuda_probe():  # only the summary writer
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
  writer = tf.summary.create_file_writer(os.path.join(logdir, "monitor"))
  child = subprocess.Popen(command) if command else None
  start, step = time.time(), 0
  try:
    while True:
      with writer.as_default():
        for tag, value in sample(source, ipu_ids).items():
          tf.summary.scalar(tag, value, step=step)
      writer.flush()
      step += 1
      if child is not None and child.poll() is not None:
        return child.returncode
      if duration and time.time() - start >= duration:
        return 0 if child is None else child.wait()
      time.sleep(interval)
  finally:
    writer.close()
    if child is not None and child.poll() is None:
      child.terminate()


def main(argv):
  command = argv[1:]
  sys.exit(monitor(FLAGS.logdir, FLAGS.interval, FLAGS.duration, resolve_source(FLAGS.source, FLAGS.ipu_ids),
                   FLAGS.ipu_ids, command or None))


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  define_flags()
  app.run(with_one_line_errors(main), flags_parser=parse_flags)  # bad flag: `error:` line, exit 2
