r"""Learning-rate x replica scans, as the reference's scanHpar.sh does: one main.py run per grid point.

    python tools/scan.py --scan_dir=scans/lr --learning_rates=5e-4,1e-3,2e-3 --replicas=1,4 \
        -- --model=neuron_inverter --epochs=10                       # serially, on this machine
    python tools/scan.py --mode=slurm --scan_dir=scans/lr --learning_rates=5e-4,1e-3,2e-3 \
        --sbatch_args="--time=02:00:00" -- --model=neuron_inverter   # a Slurm job array + a report job
    python tools/scan.py --mode=report --scan_dir=scans/lr            # the table and plot again

The grid (points, and the main.py flags after `--`) is fixed in `<scan_dir>/grid.yaml` when the scan
starts; each point trains in its own logdir `<scan_dir>/replicas<R>_lr<LR>` (the rate as Python's repr
writes it) and its log goes beside it. Each point's main.py runs in the folder the scan was started in
(a Slurm point: the submit folder), so relative paths after `--` mean what they mean there. A point
that finished is skipped when the scan runs again; one that stopped with a checkpoint continues with
`--resume`. The report, `<scan_dir>/scan.yaml` and `scan.png`, has the best validation loss of every
point against the learning rate, one curve per replica count (both models train with a validation
split; where no point's summary.yaml holds a validation loss, the points are ranked by their test loss,
and the report says so); points that failed or did not run are listed with their exit status and last
error line, and make the exit status 1.
"""

import math
import os
import shlex
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from errors import parse_flags, report_missing_packages  # noqa: E402  pylint: disable=wrong-import-position
from stop_signals import handles, leave_a_closed_terminal, remember_terminal_outputs  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

import yaml  # noqa: E402  pylint: disable=wrong-import-position
from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position

from run_config import flag_name  # noqa: E402  pylint: disable=wrong-import-position
from training import logs  # noqa: E402  pylint: disable=wrong-import-position
from training.summary import python_command, tool_command, write_yaml  # noqa: E402  pylint: disable=wrong-import-position
MODES = ("serial", "slurm", "point", "report")
FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("scan_dir", None, "Folder of the scan: grid.yaml, one logdir per point, the report.",
                      required=True)
  flags.DEFINE_list("learning_rates", [], "Learning rates to scan (comma-separated).")
  flags.DEFINE_list("replicas", ["1"], "Replica counts to scan (comma-separated).")
  flags.DEFINE_enum("mode", "serial", MODES, "serial: run every point here, then report; slurm: submit "
                    "a job array and a report job; point: run one point (an array task); report: only "
                    "the table and plot.")
  flags.DEFINE_integer("point", None, "--mode=point: the point's index (default: $SLURM_ARRAY_TASK_ID).")
  flags.DEFINE_string("sbatch_args", "", "--mode=slurm: more sbatch options for the array (e.g. --time).")


class ScanError(Exception):
  """A problem with the scan's own input: printed as one `error:` line."""


# --- the grid -------------------------------------------------------------------------------------

def point_name(replicas: int, learning_rate: float) -> str:
  """The point's folder name. The rate as repr writes it (the shortest text that reads back as the same
  float), so distinct rates get distinct folders: %g made 0.0012345671 and 0.0012345679 one folder."""
  rate = repr(float(learning_rate))
  return "replicas%d_lr%s" % (replicas, rate[:-2] if rate.endswith(".0") else rate)


# main.py flags that the scan sets for each point itself (point_command), and the scan's own flags
# that choose them: given after `--`, they would be silently overridden.
_SCAN_SETS = {"learning_rate": "--learning_rates", "replicas": "--replicas", "logdir": "--scan_dir"}


def make_grid(learning_rates: list, replicas: list, main_args: list) -> dict:
  for arg in main_args:
    name = flag_name(arg)
    if name in _SCAN_SETS:
      raise ScanError("%s after `--`: the scan sets --%s of each point itself; use the scan's %s"
                      % (arg, name, _SCAN_SETS[name]))
  try:
    rates = [float(value) for value in learning_rates]
    counts = [int(value) for value in replicas]
  except ValueError as error:
    raise ScanError("--learning_rates and --replicas must be numbers (%s)" % error) from None
  if not rates or not counts:
    raise ScanError("a scan needs at least one --learning_rates value and one --replicas value")
  # Values no point could run with (they would also name its folder, "replicas0_lrnan"); a rate that
  # main.py refuses for its own reasons (0, negative) becomes that point's error line in the report.
  bad = ["--learning_rates value %s" % rate for rate in rates if not math.isfinite(rate)]
  bad += ["--replicas value %d" % count for count in counts if count < 1]
  if bad:
    raise ScanError("%s: learning rates must be finite numbers, replica counts at least 1" % ", ".join(bad))
  _refuse_duplicates("--learning_rates", learning_rates, rates)
  _refuse_duplicates("--replicas", replicas, counts)
  points = [{"index": i, "replicas": r, "learning_rate": lr, "name": point_name(r, lr)}
            for i, (r, lr) in enumerate((r, lr) for r in counts for lr in rates)]
  return {"main_args": list(main_args), "points": points}


def _refuse_duplicates(flag: str, given: list, values: list) -> None:
  """Two equal values (1e-3 and 0.001) would be one point run twice, listed twice in the report."""
  same = {}
  for text, value in zip(given, values):
    same.setdefault(value, []).append(text)
  repeated = [" and ".join(texts) for texts in same.values() if len(texts) > 1]
  if repeated:
    raise ScanError("%s lists the same value more than once (%s): give each value once"
                    % (flag, "; ".join(repeated)))


def grid_path(scan_dir: str) -> str:
  return os.path.join(scan_dir, "grid.yaml")


def save_grid(scan_dir: str, grid: dict) -> None:
  """Writes the grid; a scan folder keeps the grid it was started with."""
  path = grid_path(scan_dir)
  if os.path.exists(path):
    if load_grid(scan_dir) != grid:
      raise ScanError("%s holds another scan's grid (other points or main.py flags): continue it with "
                      "the same flags, or choose a fresh --scan_dir" % path)
    return
  try:
    os.makedirs(scan_dir, exist_ok=True)
    write_yaml(path, grid)
  except OSError as error:
    raise ScanError("--scan_dir=%s: cannot write %s (%s)" % (scan_dir, path, error.strerror)) from None


def load_grid(scan_dir: str) -> dict:
  path = grid_path(scan_dir)
  try:
    with open(path) as source:
      grid = yaml.safe_load(source)
  except OSError as error:
    raise ScanError("cannot read %s (%s): start the scan with --learning_rates first"
                    % (path, error.strerror)) from None
  except (UnicodeDecodeError, yaml.YAMLError) as error:
    raise ScanError("%s is not valid YAML (%s)" % (path, " ".join(str(error).split()))) from None
  # A hand-edited or damaged grid: its points are indexed and formatted below.
  if not (isinstance(grid, dict) and isinstance(grid.get("main_args"), list)
          and isinstance(grid.get("points"), list) and grid["points"]
          and all(_is_point(point) for point in grid["points"])):
    raise ScanError("%s does not hold a scan grid (main_args: a list; points: a list of index, replicas, "
                    "learning_rate, name), as tools/scan.py writes it; start the scan again in a fresh "
                    "--scan_dir" % path)
  return grid


def _is_point(point) -> bool:
  return (isinstance(point, dict) and isinstance(point.get("index"), int)
          and isinstance(point.get("replicas"), int) and isinstance(point.get("name"), str)
          and isinstance(point.get("learning_rate"), (int, float)))


# --- one point ------------------------------------------------------------------------------------

def _status_path(scan_dir: str, point: dict) -> str:
  return os.path.join(scan_dir, point["name"] + ".status.yaml")


def read_status(scan_dir: str, point: dict):
  path = _status_path(scan_dir, point)
  if not os.path.exists(path):
    return None
  again = "; delete it to run the point again"
  status = _read_mapping(path, again)
  if not isinstance(status.get("returncode"), int):
    raise ScanError("%s: returncode is %r, expected the exit status of the point's main.py%s"
                    % (path, status.get("returncode"), again))
  return status


def _read_mapping(path: str, hint: str = "") -> dict:
  """A YAML file that must hold a mapping (a point's status, its summary.yaml); `hint` ends a message."""
  try:
    with open(path) as source:
      content = yaml.safe_load(source)
  except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
    raise ScanError("%s is unreadable (%s)%s" % (path, " ".join(str(error).split()), hint)) from None
  if not isinstance(content, dict):
    raise ScanError("%s holds no mapping%s" % (path, hint))
  return content


def point_command(scan_dir: str, grid: dict, point: dict) -> list:
  logdir = os.path.join(scan_dir, point["name"])
  command = [sys.executable, os.path.join(REPO_ROOT, "main.py")] + grid["main_args"] + [
      "--learning_rate=%r" % point["learning_rate"], "--replicas=%d" % point["replicas"],
      "--logdir=" + logdir]
  if os.path.isdir(os.path.join(logdir, "checkpoints", "last")):
    command.append("--resume")  # a point stopped earlier (time limit, SIGTERM) continues
  return command


def run_point(scan_dir: str, grid: dict, point: dict) -> int:
  """Runs one point (unless it already finished); records its exit status; returns it."""
  status = read_status(scan_dir, point)
  if status and status["returncode"] == 0:
    print("point %d (%s): finished earlier, skipped" % (point["index"], point["name"]), flush=True)
    return 0
  command = point_command(scan_dir, grid, point)
  log_path = os.path.join(scan_dir, point["name"] + ".log")
  # The interpreter as a user would type it, so that the line can be pasted to run the point alone.
  shown = "%s %s" % (python_command(), shlex.join(command[1:]))  # shlex.join: Python >= 3.8
  print("point %d (%s): %s > %s" % (point["index"], point["name"], shown, shlex.quote(log_path)), flush=True)
  started = time.time()
  with open(log_path, "a") as log:
    returncode, stop = _run_passing_on_stops(command, log)
  write_yaml(_status_path(scan_dir, point), {"returncode": returncode,
                                              "seconds": round(time.time() - started, 1)})
  print("point %d (%s): exit status %d" % (point["index"], point["name"], returncode), flush=True)
  if stop is not None:
    raise ScanStopped(stop)
  return returncode


class ScanStopped(Exception):
  """Ctrl-C or SIGTERM: the point's run has stopped (with a checkpoint once it trained), and so does
  the scan; the same command continues it."""


def _run_passing_on_stops(command, log):
  """Runs a point's main.py and waits for it; returns (its exit status, the stop signal or None).

  The run has a session of its own, so a terminal's Ctrl-C reaches the scan alone, which passes the
  first Ctrl-C, SIGTERM or SIGHUP on and waits while the run saves its checkpoint. (subprocess.call
  would kill it 0.25 s after a Ctrl-C, in the middle of that save, and the scan would end in a
  traceback. Unhandled, the SIGHUP of a terminal that closes ended the scan and left the run training
  on its own.)"""
  # In the user's folder, as main.py would run there: relative paths after `--` (--data_path,
  # --flagfile, --stage_dir) mean what they meant where the scan was typed. main.py is named by its
  # absolute path, so it finds its modules from anywhere; a Slurm point runs in the submit folder
  # (tools/slurm/scan.sbatch), which is where `--mode=slurm` ran.
  child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  stops = []
  remember_terminal_outputs()

  def pass_on(signum, frame):
    del frame
    if signum == signal.SIGHUP:
      leave_a_closed_terminal()
    if not stops:
      stops.append(signum)
      child.send_signal(signum)
  previous = {signum: signal.signal(signum, pass_on)
              for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if handles(signum)}
  try:
    return child.wait(), (stops[0] if stops else None)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


# --- the report -----------------------------------------------------------------------------------

def _last_error(log_path: str) -> str:
  try:
    with open(log_path) as log:
      lines = [line.strip() for line in log if line.strip()]
  except OSError:
    return ""
  errors = [line for line in lines if line.startswith("error:") or "Error" in line]
  return (errors or lines or [""])[-1][:200]


def point_result(scan_dir: str, point: dict) -> dict:
  row = {key: point[key] for key in ("index", "replicas", "learning_rate", "name")}
  status = read_status(scan_dir, point)
  summary_path = os.path.join(scan_dir, point["name"], "summary.yaml")
  if status is None:
    return dict(row, status="not run")
  if status["returncode"] != 0 or not os.path.exists(summary_path):
    return dict(row, status="failed", returncode=status["returncode"],
                error=_last_error(os.path.join(scan_dir, point["name"] + ".log")))
  summary = _read_mapping(summary_path)
  return dict(row, status="finished", best_val_loss=summary.get("best_val_loss"),
              best_val_epoch=summary.get("best_val_epoch"), test_loss=summary.get("test_loss"),
              test_accuracy=summary.get("test_accuracy"),  # a classifier's (mnist); None for a regression
              wall_seconds=round(summary.get("wall_seconds") or 0.0, 1))


# What the points are ranked by: their best validation loss, never the test loss while any point has
# one (choosing by the test split would leave no untouched data to report). Only where no finished
# point recorded a validation loss (a summary.yaml without one), their test loss -- said in the table,
# the plot and scan.yaml.
RANKINGS = {"best_val_loss": "best validation loss", "test_loss": "test loss"}


def ranked_by(rows: list) -> str:
  finished = [row for row in rows if row["status"] == "finished"]
  for key in RANKINGS:
    if any(row.get(key) is not None for row in finished):
      return key
  return "best_val_loss"


def plot(rows: list, path: str, title: str, key: str, best: dict = None) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  figure, axes = plt.subplots(figsize=(6.4, 4.4))
  for replicas in sorted({row["replicas"] for row in rows}):
    done = sorted((row["learning_rate"], row[key]) for row in rows
                  if row["replicas"] == replicas and row["status"] == "finished" and row.get(key) is not None)
    if done:
      axes.plot(*zip(*done), marker="o", label="%d replica%s" % (replicas, "" if replicas == 1 else "s"))
  if best:
    axes.plot([best["learning_rate"]], [best[key]], marker="*", markersize=16, color="#d7191c",
              linestyle="none", label="best: %s, %.4f" % (best["name"], best[key]))
  missing = [row for row in rows if row["status"] != "finished"]
  axes.set_title(title, fontsize=10)
  if missing:
    axes.text(0.5, 1.08, "not finished: " + ", ".join(row["name"] for row in missing), fontsize=8,
              color="red", ha="center", transform=axes.transAxes)
  if any(row["status"] == "finished" and row["learning_rate"] > 0 for row in rows):
    axes.set_xscale("log")
  axes.set_xlabel("learning rate")
  axes.set_ylabel(RANKINGS[key])
  axes.grid(alpha=0.3)
  if axes.get_legend_handles_labels()[0]:
    axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def report(scan_dir: str) -> int:
  """Writes scan.yaml and scan.png; prints the table; 1 if any point did not finish."""
  rows = [point_result(scan_dir, point) for point in load_grid(scan_dir)["points"]]
  key = ranked_by(rows)
  finished = [row for row in rows if row["status"] == "finished" and row.get(key) is not None]
  best = min(finished, key=lambda row: row[key]) if finished else None
  table = {"points": rows, "ranked_by": key, "best": best,
           "not_finished": [row["name"] for row in rows if row["status"] != "finished"]}
  write_yaml(os.path.join(scan_dir, "scan.yaml"), table)
  plot(rows, os.path.join(scan_dir, "scan.png"), "The %s of each point of %s" % (RANKINGS[key], scan_dir),
       key, best)
  print("%-24s %-9s %14s %10s" % ("point", "status", "best val loss", "test loss"))
  for row in rows:
    print("%-24s %-9s %14s %10s  %s" % (
        row["name"], row["status"], _number(row.get("best_val_loss")), _number(row.get("test_loss")),
        "exit %s: %s" % (row.get("returncode"), row.get("error")) if row["status"] == "failed" else ""))
  accuracy = "" if not best or best.get("test_accuracy") is None else ", test accuracy %.4f" % best["test_accuracy"]
  if best and key == "best_val_loss":  # a classifier's (mnist) test accuracy of the chosen point after it
    print("best: %s, validation loss %.4f (epoch %s)%s" % (best["name"], best["best_val_loss"],
                                                            best.get("best_val_epoch"), accuracy))
  elif best:
    print("best: %s, test loss %.4f%s (no point's summary.yaml has a validation loss, so the points are "
          "ranked by their test loss)" % (best["name"], best["test_loss"], accuracy))
  print("report: %s, %s" % (os.path.join(scan_dir, "scan.yaml"), os.path.join(scan_dir, "scan.png")))
  print("TensorBoard, one HParams row per point: " + tool_command("serve_tensorboard.py", scan_dir))
  if table["not_finished"]:
    print("error: %d of %d scan points did not finish: %s" % (len(table["not_finished"]), len(rows),
                                                              ", ".join(table["not_finished"])))
    return 1
  return 0


def _number(value) -> str:
  return "-" if value is None else "%.4f" % value


# --- modes ----------------------------------------------------------------------------------------

def submit_to_slurm(scan_dir: str, grid: dict, sbatch_args: list) -> int:
  """A job array (one task per point) and a report job that runs after it, however it ended."""
  env = dict(os.environ, PYTHON=sys.executable, APP_DIR=REPO_ROOT)
  array = ["sbatch", "--parsable", "--array=0-%d" % (len(grid["points"]) - 1),
           "--output=" + os.path.join(scan_dir, "slurm-%A_%a.out")] + sbatch_args + [
               os.path.join(REPO_ROOT, "tools", "slurm", "scan.sbatch"), scan_dir]
  job = _submit(array, env)
  # --wrap is a shell command line: each path quoted, so that spaces in them survive it.
  report_command = [sys.executable, os.path.abspath(__file__), "--mode=report", "--scan_dir=" + scan_dir]
  report_job = _submit(["sbatch", "--parsable", "--dependency=afterany:" + job, "--job-name=scan-report",
                        "--output=" + os.path.join(scan_dir, "slurm-report-%j.out"),
                        "--wrap=" + " ".join(shlex.quote(word) for word in report_command)], env)
  print("submitted: array job %s (%d points), report job %s; report: %s"
        % (job, len(grid["points"]), report_job, os.path.join(scan_dir, "scan.yaml")))
  return 0


def split_sbatch_args(sbatch_args: str) -> list:
  """--sbatch_args as a shell splits it: --sbatch_args="--comment='lr scan' --time=1:00:00" is two
  options (str.split made "--comment='lr" and "scan'" of the first)."""
  try:
    return shlex.split(sbatch_args)
  except ValueError as error:
    raise ScanError("--sbatch_args=%s: %s; expected sbatch options as a shell would take them"
                    % (sbatch_args, error)) from None


def _submit(command: list, env: dict) -> str:
  try:
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError) as error:
    detail = getattr(error, "stderr", "") or str(error)
    raise ScanError("sbatch failed: %s" % detail.strip().splitlines()[-1]) from None
  return result.stdout.strip().split(";")[0]


def run(argv: list) -> int:
  scan_dir = os.path.abspath(FLAGS.scan_dir)
  if FLAGS.mode == "report":
    return report(scan_dir)
  if FLAGS.mode == "point":
    grid = load_grid(scan_dir)
    index = FLAGS.point if FLAGS.point is not None else _array_task_id()
    if not 0 <= index < len(grid["points"]):
      raise ScanError("--point=%d is not a point of %s (0 to %d)" % (index, grid_path(scan_dir),
                                                                    len(grid["points"]) - 1))
    return run_point(scan_dir, grid, grid["points"][index])
  grid = make_grid(FLAGS.learning_rates, FLAGS.replicas, argv[1:])
  sbatch_args = split_sbatch_args(FLAGS.sbatch_args) if FLAGS.mode == "slurm" else []  # before any file
  save_grid(scan_dir, grid)
  if FLAGS.mode == "slurm":
    return submit_to_slurm(scan_dir, grid, sbatch_args)
  for point in grid["points"]:
    run_point(scan_dir, grid, point)  # a failed point is recorded and reported, the scan goes on
  return report(scan_dir)


def _array_task_id() -> int:
  """--mode=point without --point: the point of this Slurm array task."""
  value = os.environ.get("SLURM_ARRAY_TASK_ID")
  if value is None:
    raise ScanError("--mode=point needs --point=<index> (or SLURM_ARRAY_TASK_ID, in a Slurm array task)")
  try:
    return int(value)
  except ValueError:
    raise ScanError("SLURM_ARRAY_TASK_ID=%s is not a point index (an integer); pass --point=<index>"
                    % value) from None


def main(argv):
  logs.setup()  # as main.py: INFO lines from the libraries (matplotlib's "generated new fontManager") dropped
  try:
    sys.exit(run(argv))
  except ScanError as error:
    print("error: %s" % error, file=sys.stderr)
    sys.exit(1)
  except ScanStopped as stopped:
    signum = stopped.args[0]
    print("interrupted by %s: the scan stopped; run the same command again to continue it (finished "
          "points are skipped, a stopped one resumes from its checkpoint)" % signal.Signals(signum).name,
          file=sys.stderr)
    sys.exit(128 + signum)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)  # a bad flag: one `error:` line, exit status 2
