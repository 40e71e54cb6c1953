"""The pages cannot drift: every flag that README.md and docs/*.md name exists, every repository path
they name exists, and their links lead to a file and a section that exist. Then the readers behind
these checks (tests/support/docs_check.py), each shown able to fail on a small text.

The pages' `<!-- tested -->` commands run in tests/e2e/test_docs_commands.py.
"""

import glob
import os
import sys
import textwrap

import pytest

from tests.support import docs_check
from tests.support.helpers import REPO_ROOT, assert_names


def _pages():
  """README.md and docs/*.md, as paths relative to the repository."""
  docs = sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))
  return ["README.md"] + [os.path.relpath(path, REPO_ROOT) for path in docs]


PAGES = _pages()


def _read(path):
  with open(path if os.path.isabs(path) else os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
    return f.read()


def _page(name):
  return docs_check.parse_page(_read(name))


class ProgramFlags:
  """The flags of main.py and of each tool, from their --helpfull (--help for argparse tools), each
  program asked once and only when a page needs it (a tool's help starts its imports)."""

  def __init__(self):
    self._flags = {}
    self._tools = None
    self._env = dict(os.environ)
    for variable in ("TF_USE_LEGACY_KERAS", "TF2_BEHAVIOR"):  # set by importing TensorFlow in pytest
      self._env.pop(variable, None)

  def of(self, program):
    """The flag names of "main.py" or "tools/X.py"; None if there is no such file."""
    if not os.path.isfile(os.path.join(REPO_ROOT, program)):
      return None
    if program not in self._flags:
      help_text = docs_check.program_help(REPO_ROOT, program, sys.executable, env=self._env)
      self._flags[program] = docs_check.listed_flags(help_text)
    return self._flags[program]

  def known_anywhere(self, name):
    """A flag named without its program: main.py's, an external one of PROSE_EXTERNAL_FLAGS, or a
    tool's (the tools the pages name are asked first, the others only if still not found)."""
    if name in docs_check.PROSE_EXTERNAL_FLAGS or name in self.of("main.py"):
      return True
    if self._tools is None:
      named = docs_check.named_tools(_read(page) for page in PAGES)
      every = sorted(glob.glob(os.path.join(REPO_ROOT, "tools", "*.py")))
      self._tools = named + [tool for tool in (os.path.relpath(path, REPO_ROOT) for path in every)
                             if tool not in named]
    return any(name in (self.of(tool) or ()) for tool in self._tools)


@pytest.fixture(scope="module")
def program_flags():
  return ProgramFlags()


@pytest.fixture(scope="module")
def top_level():
  return docs_check.top_level_entries(REPO_ROOT)


# ---- the pages --------------------------------------------------------------------------------

def test_readme_has_tested_commands():
  """README.md's cheap CPU commands are run from its own code blocks, so it must mark some."""
  tested = [block.start for block in _page("README.md").blocks if block.tested]
  assert tested, ("README.md has no ```sh block right after a line `%s`: mark its cheap CPU commands "
                  "(the --help output, a short main.py run, tools/predict.py on it, a flag file) so that "
                  "tests/e2e/test_docs_commands.py runs them" % docs_check.TESTED_MARK)


@pytest.mark.parametrize("page", PAGES)
def test_tested_marks_precede_sh_blocks(page):
  stray = _page(page).stray_marks
  assert not stray, "%s, lines %s: `%s` must be the line right before a ```sh block, else nothing runs" % (
      page, stray, docs_check.TESTED_MARK)


@pytest.mark.parametrize("page", PAGES)
def test_flags_exist(page, program_flags):
  problems = docs_check.check_flags(_page(page), program_flags.of, program_flags.known_anywhere)
  assert not problems, "%s names flags that do not exist:\n  %s" % (page, "\n  ".join(problems))


@pytest.mark.parametrize("page", PAGES)
def test_repository_paths_exist(page, top_level):
  problems = docs_check.check_paths(_page(page), REPO_ROOT, top_level)
  assert not problems, "%s names paths that do not exist:\n  %s" % (page, "\n  ".join(problems))


@pytest.mark.parametrize("page", PAGES)
def test_links_lead_somewhere(page):
  problems = docs_check.check_links(_page(page), os.path.join(REPO_ROOT, page), _read)
  assert not problems, "%s has broken links:\n  %s" % (page, "\n  ".join(problems))


# ---- the readers, on small texts ---------------------------------------------------------------

ABSL_HELP = """\
flags:

absl.app:
  -?,--[no]help: show this help
    (default: 'false')
  --profile_file: Dump profile information to a file (for python -m pstats).
    --not_a_flag: a continuation line that starts with a dash
main.py:
  --backend: <auto|ipu|gpu|cpu>: Where to run; with --mentioned_only in its help
    (default: 'auto')
  --[no]resume: Continue the run in --logdir from its last checkpoint.
  -v,--verbosity: Logging verbosity level.
"""

ARGPARSE_HELP = """\
usage: parity.py [-h] [--data_path DATA_PATH] [--in_usage_only X]

options:
  -h, --help            show this help message and exit
  --data_path DATA_PATH
                        cellSpike .h5 file, see --mentioned_only
  --design {dev,ontra4}
  --bf16, --no-bf16     mixed bfloat16
"""


def test_listed_flags_reads_absl_and_argparse_help():
  assert docs_check.listed_flags(ABSL_HELP) == {
      "help", "nohelp", "profile_file", "backend", "resume", "noresume", "verbosity"}
  assert docs_check.listed_flags(ARGPARSE_HELP) == {"help", "data_path", "design", "bf16", "no-bf16"}


def test_main_help_lists_its_flags(program_flags):
  flags = program_flags.of("main.py")
  assert {"model", "replicas", "logdir", "resume", "noresume", "flagfile", "helpfull"} <= flags
  assert program_flags.of("tools/no_such_tool.py") is None


def test_command_lines_join_continuations_and_drop_comments():
  block = textwrap.dedent("""\
      # a comment line

      python main.py --model=mnist \\
          --epochs=1   # a trailing comment
      echo 'a # in quotes' "and #this" x#y
      cat > /tmp/ni-check/mnist.flags <<'EOF'
      # a flag file's comment stays
      --model=mnist
      EOF
      python main.py --flagfile=/tmp/ni-check/mnist.flags
      """).splitlines()
  assert docs_check.command_lines(block, 10) == [
      (12, "python main.py --model=mnist     --epochs=1"),
      (14, "echo 'a # in quotes' \"and #this\" x#y"),
      (15, "cat > /tmp/ni-check/mnist.flags <<'EOF'\n# a flag file's comment stays\n--model=mnist\nEOF"),
      (19, "python main.py --flagfile=/tmp/ni-check/mnist.flags"),
  ]


@pytest.mark.parametrize("line, expected", [
    ("python main.py --model=mnist --noresume", [("model", "main.py"), ("noresume", "main.py")]),
    (".venv/bin/python tools/predict.py --logdir=RUN", [("logdir", "tools/predict.py")]),
    ("python3 -u tools/predict.py --logdir=RUN", [("logdir", "tools/predict.py")]),
    ("./main.py --epochs=1 | tee log && tools/predict.py --outdir=x > out 2>&1",
     [("epochs", "main.py"), ("outdir", "tools/predict.py")]),
    # Another program's own flags are not checked; main.py's after it are.
    ("srun --ipus=4 python3 main.py --replicas=4", [("ipus", None), ("replicas", "main.py")]),
    ("sudo singularity exec --nv --bind /d:/d x.sif python3 /opt/neuron_inverter/main.py --model=mnist",
     [("nv", None), ("bind", None), ("model", "main.py")]),
    ("IPUS=4 sbatch --ipus=4 tools/slurm/ipu.sbatch --data_path=x.h5", [("ipus", None), ("data_path", "main.py")]),
    ("POPRUN_ARGS='--vipu-partition=p' tools/slurm/poprun.sh 2 4 2 --pipeline_stages=2",
     [("pipeline_stages", "main.py")]),
    ("make run RUN_ARGS=\"--epochs=6 --replicas=2\"", [("epochs", "main.py"), ("replicas", "main.py")]),
    ("python -m pytest tests/e2e/test_main.py --durations=5", [("durations", None)]),
    ("pytest tests/e2e/test_main.py --durations=5", [("durations", None)]),
    ("gc-monitor --no-card-info", [("no-card-info", None)]),
    # tools/scan.py hands what follows `--` to main.py; a flag's value is not searched for flags.
    ("python3 tools/scan.py --sbatch_args=\"--time=02:00:00\" -- --epochs=10",
     [("sbatch_args", "tools/scan.py"), ("epochs", "main.py")]),
    ("sbatch --array=0-3 tools/slurm/scan.sbatch scans/lr --oops",
     [("array", None), ("oops", docs_check.NO_FLAGS)]),
    # No program known here: main.py's (in a code block), e.g. the lines of a flag file.
    ("--model=mnist", [("model", "main.py")]),
    ("printf -- '--model=mnist\\n--epochs=1\\n' > f.flags", [("model", "main.py"), ("epochs", "main.py")]),
    ("python tests/helper.py --x", [("x", "unknown script tests/helper.py")]),
    ("python3 --version && python3 -c 'print(\"--x\")'", [("version", None)]),
])
def test_command_flags_belong_to_their_program(line, expected):
  assert docs_check.command_flags(line, "main.py") == expected


FLAG_PAGE = """\
# Title

Train with `--replicas=4` and --epochs, or `srun --ipus=4`; --replicass is a typo, and so is
`python main.py
--bogus_span`.
<!-- a comment naming --no_such_flag is not read -->

```sh
srun --ipus=4 python3 main.py --replicas=4 \\
    --typo_after_continuation
tools/predict.py --logdir=x --epochs=2
```

    python3 main.py --in_an_indented_block

- a list item

    --in_list_text_not_code
"""


def test_check_flags_reports_each_flag_that_does_not_exist():
  programs = {"main.py": {"replicas", "epochs", "logdir", "model"}, "tools/predict.py": {"logdir", "outdir"}}
  known = lambda name: (name in programs["main.py"] | programs["tools/predict.py"]
                        or name in docs_check.PROSE_EXTERNAL_FLAGS)
  problems = docs_check.check_flags(docs_check.parse_page(FLAG_PAGE), programs.get, known)
  reported = [(problem.split(":")[0], problem.split()[2]) for problem in problems]
  assert sorted(reported) == sorted([
      ("line 3", "--replicass"), ("line 4", "--bogus_span"), ("line 9", "--typo_after_continuation"),
      ("line 11", "--epochs"), ("line 14", "--in_an_indented_block"), ("line 18", "--in_list_text_not_code")])
  assert_names(next(p for p in problems if "--epochs" in p), "no flag", "tools/predict.py")


def _repository(tmp_path):
  for path in ("main.py", "tools/predict.py", "tests/test_one.py", "configs/reference.flags", "docs/a.md"):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text("")
  return {"main.py", "tools", "tests", "configs", "docs"}


def test_check_paths_reports_each_path_that_does_not_exist(tmp_path):
  top_level = _repository(tmp_path)
  text = textwrap.dedent("""\
      See `tools/predict.py:12`, `tests/test_*.py`, `tools/{predict,gone}.py`, `tools/` and `main.py`;
      `tools/missing.py`, `tests/test_nothing_*.py`, `model/x.py` (not an entry), `tools/<name>.py`.

      ```sh
      python main.py --flagfile=configs/reference.flags --logdir=logs/run  # see docs/a.md, docs/b.md
      python tools/predict.py --data_path=/data/tools/x.h5 --flagfile=configs/none.flags
      ```
      """)
  problems = docs_check.check_paths(docs_check.parse_page(text), str(tmp_path), top_level)
  assert [(problem.split(":")[0], problem.split()[2]) for problem in problems] == [
      ("line 5", "docs/b.md"), ("line 6", "configs/none.flags"), ("line 1", "tools/gone.py"),
      ("line 2", "tools/missing.py"), ("line 2", "tests/test_nothing_*.py")]
  assert all("does not exist" in problem for problem in problems) and "(matches nothing)" in problems[-1]


def test_check_links_reports_missing_files_and_sections(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "a.md").write_text("# Page A\n\n## Convolution forms and --autotune\n\n## Run\n\n## Run\n")
  readme = tmp_path / "README.md"
  readme.write_text(textwrap.dedent("""\
      ## Quick start

      [a](docs/a.md), [b](docs/a.md#convolution-forms-and---autotune), [c](docs/a.md#run-1),
      [d](docs/a.md#no-such-section), [e](docs/gone.md), ![f](docs/plot.png), [g](#quick-start),
      [h](#nowhere), [i](https://example.org/x.md#y), `[j](docs/in_code.md)`

      [ref]: docs/also_gone.md
      """))
  read = lambda path: open(path, encoding="utf-8").read()
  problems = docs_check.check_links(docs_check.parse_page(readme.read_text()), str(readme), read)
  expected = [("line 4", "docs/a.md", "#no-such-section"), ("line 4", "docs/gone.md", "does not exist"),
              ("line 4", "docs/plot.png", "does not exist"), ("line 5", "this page", "#nowhere"),
              ("line 7", "docs/also_gone.md", "does not exist")]
  assert len(problems) == len(expected), problems
  for problem, (line, *names) in zip(problems, expected):
    assert problem.startswith(line + ": "), problem
    assert_names(problem, *names)


@pytest.mark.parametrize("heading, slug", [
    ("Convolution forms and --autotune", "convolution-forms-and---autotune"),
    ("The first conv block's C++ kernel", "the-first-conv-blocks-c-kernel"),
    ("The default job (make run)", "the-default-job-make-run"),
    ("`summary.yaml` and [its keys](x.md)", "summaryyaml-and-its-keys"),
])
def test_github_slug(heading, slug):
  assert docs_check.github_slug(heading) == slug


def test_tested_blocks_and_stray_marks():
  text = textwrap.dedent("""\
      <!-- tested -->
      ```sh
      python main.py --help
      ```

      <!-- tested -->

      ```sh
      python main.py --model=mnist
      ```
      <!-- tested -->
      ```python
      print()
      ```
      """)
  page = docs_check.parse_page(text)
  assert [(block.start, block.language, block.tested) for block in page.blocks] == [
      (2, "sh", True), (8, "sh", False), (12, "python", False)]
  assert page.stray_marks == [6, 11]


def test_substitute_python_and_the_check_folder():
  python, folder = "/env/bin/python3", "/tmp/pytest-1/ni-check"
  assert docs_check.substitute(".venv/bin/python main.py --logdir=/tmp/ni-check/run", python, folder) == (
      "/env/bin/python3 main.py --logdir=/tmp/pytest-1/ni-check/run")
  assert docs_check.substitute("TF_CPP_MIN_LOG_LEVEL=3 python3 x.py /tmp/ni-check", python, folder) == (
      "TF_CPP_MIN_LOG_LEVEL=3 /env/bin/python3 x.py /tmp/pytest-1/ni-check")
  for unchanged in ("echo python main.py", "pythonic x", "ls /tmp/ni-checks /tmp/ni-check.old"):
    assert docs_check.substitute(unchanged, python, folder) == unchanged
