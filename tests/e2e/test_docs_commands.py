"""The pages' commands, run as a user runs them: each ```sh block right after a line `<!-- tested -->`
in README.md and docs/*.md (tests/support/docs_check.py reads them).

Each command line runs in bash (pipefail) in the repository, one after the other, with this test's
Python for a leading `.venv/bin/python`, `python` or `python3`, and a fresh folder of the test for
/tmp/ni-check (which is not made beforehand: a block makes what it needs, as on a new machine). A
command must end with status 0 within TIMEOUT; then what it wrote is looked at where that is cheap:
a main.py run's summary.yaml and its keys, tools/predict.py's sum_pred.yaml, tools/generate_cellspike.py's
file. A run that would write into the repository (main.py without --logdir) is refused before it
starts. The cache folder is the user's, as for the rest of the suite: a fresh one would build the
CPU kernel again for every block.
"""

import glob
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import yaml

from analysis import evaluation
from tests.support import docs_check
from tests.support.helpers import REPO_ROOT, assert_names
from training import summary

TIMEOUT = 900  # seconds for one command: a short training run takes well under a minute on 2 cores
HELP_FLAGS = ("help", "helpfull", "helpshort", "helpxml", "only_check_args")
# What a finished main.py run's summary.yaml has, that the pages tell users to read.
SUMMARY_KEYS = ("val_loss", "test_loss", "wall_seconds")


def _tested_blocks():
  pages = ["README.md"] + [os.path.relpath(path, REPO_ROOT)
                           for path in sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
  blocks = []
  for page in pages:
    with open(os.path.join(REPO_ROOT, page), encoding="utf-8") as f:
      blocks.extend(pytest.param(page, block, id="%s:%d" % (page, block.start))
                    for block in docs_check.parse_page(f.read()).blocks if block.tested)
  return blocks


def _environment():
  env = dict(os.environ, PWD=REPO_ROOT)       # a shell in the repository
  for variable in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR"):  # set by importing TensorFlow in pytest:
    env.pop(variable, None)                                  # the programs must set them themselves
  return env


def _run(command, env, timeout):
  """`command` in bash, in the repository; (exit status or None at the timeout, stdout, stderr). The
  command's whole process group is ended at the timeout."""
  process = subprocess.Popen(["bash", "-c", "set -o pipefail\n" + command], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout, stderr
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    stdout, stderr = process.communicate()
    return None, stdout, stderr


def _tail(text, lines=40):
  return "\n".join(text.rstrip().splitlines()[-lines:])


def _arguments(words):
  """{flag name: value} of a program's words (`--name=value`, `--name value`, `--name`: True), with
  the lines of the flag files it names (--flagfile, as absl reads them) in their place."""
  values = {}
  for index, word in enumerate(words):
    if not word.startswith("--"):
      continue
    name, equals, value = word[2:].partition("=")
    if not equals:
      following = words[index + 1] if index + 1 < len(words) else None
      value = following if following is not None and not following.startswith("-") else True
    if name == "flagfile" and isinstance(value, str):
      path = os.path.join(REPO_ROOT, value)
      if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
          lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith(("#", "//"))]
        values.update(_arguments(lines))
    values[name] = value
  return values


def _programs(command):
  """(owner, {flag: value}) of each program of a command line: main.py, tools/X.py, ..."""
  found = []
  for words in docs_check.simple_commands(docs_check.split_words(command)):
    found.extend((owner, _arguments(args)) for owner, args in docs_check.flag_segments(words, None)
                 if owner)
  return found


def _inside_repository(path):
  full = os.path.realpath(os.path.join(REPO_ROOT, path))
  return full == os.path.realpath(REPO_ROOT) or full.startswith(os.path.realpath(REPO_ROOT) + os.sep)


def problems_before(command):
  """Why a tested command must not run: it would write into the repository."""
  problems = []
  for owner, args in _programs(command):
    if owner == "main.py" and not any(args.get(flag) for flag in HELP_FLAGS):
      if not isinstance(args.get("logdir"), str):
        problems.append("main.py runs without --logdir, so it would write into the repository's logs/: "
                        "give it --logdir=/tmp/ni-check/<name>")
    for flag in ("logdir", "outdir", "out_dir", "export_dir"):
      if isinstance(args.get(flag), str) and _inside_repository(args[flag]):
        problems.append("--%s=%s is inside the repository: use a folder under /tmp/ni-check" % (flag, args[flag]))
  return problems


def _yaml_mapping(path):
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    content = yaml.safe_load(f)
  return content if isinstance(content, dict) else None


def problems_after(command, stdout):
  """What a command that ended well should have left, where that is cheap to look at."""
  problems = []
  for owner, args in _programs(command):
    where = lambda flag: os.path.join(REPO_ROOT, args[flag])
    if any(args.get(flag) for flag in HELP_FLAGS):
      if "--" not in stdout:
        problems.append("%s printed no flags" % owner)
      continue
    if owner == "main.py" and isinstance(args.get("logdir"), str) and not args.get("compile_only"):
      run_summary = _yaml_mapping(os.path.join(where("logdir"), "summary.yaml"))
      if run_summary is None:
        problems.append("main.py wrote no summary.yaml into %s" % args["logdir"])
      else:
        missing = [key for key in dict.fromkeys(SUMMARY_KEYS + summary.REQUIRED_KEYS) if key not in run_summary]
        if missing:
          problems.append("%s/summary.yaml lacks %s" % (args["logdir"], ", ".join(missing)))
      predicted = os.path.join(where("logdir"), "predict", evaluation.SUM_PRED)
      if args.get("predict") and _yaml_mapping(predicted) is None:
        problems.append("main.py --predict wrote no predict/%s into %s" % (evaluation.SUM_PRED, args["logdir"]))
    if owner == "tools/predict.py" and isinstance(args.get("logdir"), str):
      outdir = where("outdir") if isinstance(args.get("outdir"), str) else os.path.join(where("logdir"), "predict")
      sum_pred = _yaml_mapping(os.path.join(outdir, evaluation.SUM_PRED))
      if sum_pred is None or "parameters" not in sum_pred:
        problems.append("tools/predict.py wrote no %s with per-parameter figures into %s" % (
            evaluation.SUM_PRED, outdir))
    if owner == "tools/generate_cellspike.py" and isinstance(args.get("out_dir"), str):
      if not glob.glob(os.path.join(where("out_dir"), "*.h5")):
        problems.append("tools/generate_cellspike.py wrote no .h5 file into %s" % args["out_dir"])
  return problems


def run_block(page, block, folder, timeout=TIMEOUT):
  """Runs a tested block's commands in order; fails at the first that does not end well, naming it."""
  env = _environment()
  commands = docs_check.command_lines(block.lines, block.start + 1)
  assert commands, "%s:%d: a tested block without commands" % (page, block.start)
  for line, command in commands:
    ran = docs_check.substitute(command, sys.executable, str(folder))
    where = "%s:%d: %s" % (page, line, command) + ("\n  run as: " + ran if ran != command else "")
    refused = problems_before(ran)
    assert not refused, "%s\n  %s" % (where, "\n  ".join(refused))
    status, stdout, stderr = _run(ran, env, timeout)
    if status is None:
      pytest.fail("%s\n  did not end within %d s; its stderr ends:\n%s" % (where, timeout, _tail(stderr)))
    assert status == 0, "%s\n  exit status %d; its stderr ends:\n%s\n  its stdout ends:\n%s" % (
        where, status, _tail(stderr), _tail(stdout, 10))
    problems = problems_after(ran, stdout)
    assert not problems, "%s\n  %s\n  its stderr ends:\n%s" % (where, "\n  ".join(problems), _tail(stderr, 10))


@pytest.mark.parametrize("page, block", _tested_blocks())
def test_tested_block_runs(page, block, tmp_path):
  run_block(page, block, tmp_path / "ni-check")


# ---- the runner itself, on small blocks ------------------------------------------------------------

def _block(text):
  return docs_check.parse_page("<!-- tested -->\n```sh\n" + textwrap.dedent(text) + "```\n").blocks[0]


def test_commands_run_with_this_python_in_a_fresh_folder(tmp_path):
  folder = tmp_path / "ni-check"
  run_block("FIXTURE.md", _block("""\
      mkdir -p /tmp/ni-check   # made by the block, as a user's would
      python3 -c "import sys; print(sys.executable)" \\
          > /tmp/ni-check/which.txt
      test "$PWD" = "$(pwd)" && test -f main.py
      """), folder)
  assert (folder / "which.txt").read_text().strip() == sys.executable


def test_a_failing_command_is_named_with_its_stderr(tmp_path):
  block = _block("""\
      true
      python -c "import sys; sys.stderr.write('the reason\\\\n'); sys.exit(3)" | cat
      echo never runs > /tmp/ni-check/never
      """)
  with pytest.raises(AssertionError) as failure:
    run_block("FIXTURE.md", block, tmp_path / "ni-check")
  message = str(failure.value)
  assert "FIXTURE.md:4: python -c" in message and "exit status 3" in message and "the reason" in message
  assert not (tmp_path / "ni-check").exists()


def test_a_command_that_does_not_end_is_stopped(tmp_path):
  with pytest.raises(pytest.fail.Exception) as caught:
    run_block("FIXTURE.md", _block("sleep 30\n"), tmp_path / "ni-check", timeout=1)
  assert_names(caught.value, "FIXTURE.md:3: sleep 30", "did not end within 1 s")


def test_runs_that_would_write_into_the_repository_are_refused():
  (problem,) = problems_before("/x/python main.py --model=mnist")
  assert_names(problem, "main.py", "without --logdir", "logs/", "--logdir=/tmp/ni-check/<name>")
  (problem,) = problems_before("python tools/predict.py --logdir=/tmp/x/run --outdir=docs/p")
  assert_names(problem, "--outdir=docs/p", "inside the repository", "/tmp/ni-check")
  assert problems_before("python main.py --help") == []
  assert problems_before("python main.py --model=mnist --logdir=/tmp/x/mnist") == []


def test_outputs_are_checked_beyond_the_exit_status(tmp_path):
  """A run folder without summary.yaml's keys, a predict folder without sum_pred.yaml: both reported."""
  run = tmp_path / "run"
  run.mkdir()
  (run / "summary.yaml").write_text("val_loss: 0.5\n")
  flags = tmp_path / "run.flags"
  flags.write_text("# a flag file\n--model=mnist\n--logdir=%s\n" % run)
  problems = problems_after("python main.py --flagfile=%s --predict" % flags, "")
  assert problems[0].startswith("%s/summary.yaml" % run)
  assert_names(problems[0], "test_loss, wall_seconds")
  assert_names(problems[1], "main.py --predict", "predict/sum_pred.yaml", run)
  (problem,) = problems_after("python tools/predict.py --logdir=%s" % run, "")
  assert_names(problem, "tools/predict.py", "sum_pred.yaml", "%s/predict" % run)
  (problem,) = problems_after("python tools/generate_cellspike.py --out_dir=%s" % run, "")
  assert_names(problem, "tools/generate_cellspike.py", ".h5 file", run)
  assert problems_after("python main.py --helpfull", "") == ["main.py printed no flags"]


def test_the_keys_checked_are_the_ones_written():
  assert set(SUMMARY_KEYS) <= set(summary.REQUIRED_KEYS)
  assert evaluation.SUM_PRED == "sum_pred.yaml"
