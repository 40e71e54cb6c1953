"""Reading the pages (README.md, docs/*.md) as the documentation checks do: their code blocks and the
commands in them, the flags they name and whose flags those are, the repository paths and links.

Used by tests/test_docs.py (flags, paths, links) and tests/e2e/test_docs_commands.py (the commands of
the blocks marked `<!-- tested -->`). Pure text handling: nothing here starts a program.

Rules for the pages' authors, as these checks read them:
- A fenced ```sh block right after a line `<!-- tested -->` is run, one command line at a time (a `\\`
  at the end of a line continues it; `#` comments and blank lines are dropped; a here-document stays
  with its command), in the repository, with `/tmp/ni-check` standing for a fresh folder.
- Every `--flag` must exist. In a code block or inline code it belongs to the program of its command
  line: `main.py`, `tools/X.py`, a job script that hands its arguments to main.py, or another program
  (EXTERNAL_PROGRAMS, whose own flags are not checked; a main.py further on the line is). A flag of no
  known program is main.py's in a code block, and in inline code or prose it must be a flag of main.py,
  of a tool, or one of PROSE_EXTERNAL_FLAGS.
- Every repository path in a code block or inline code must exist (a glob, at least one file):
  words starting with a top-level entry of the repository (`tools/`, `main.py`, ...), also after `=`.
  `<name>` in a path is a placeholder (any name); `{a,b}` lists alternatives; `:line` is dropped.
- Relative links must point at files that exist, and their `#anchor` at a heading of that page.
"""

import dataclasses
import fnmatch
import glob
import os
import re
import shlex
import subprocess

TESTED_MARK = "<!-- tested -->"
TESTED_LANGUAGES = ("sh", "bash", "shell")

# Programs whose own flags the pages may name freely on a command line (the key is the program's
# name as typed, or its basename): each is someone else's program, with its own documentation.
EXTERNAL_PROGRAMS = {
    "sbatch": "Slurm: submit a batch job",
    "srun": "Slurm: run a job step",
    "salloc": "Slurm: allocate nodes",
    "squeue": "Slurm: list jobs",
    "scancel": "Slurm: cancel jobs",
    "sacct": "Slurm: job accounting",
    "poprun": "Graphcore's multi-instance launcher",
    "mpirun": "MPI's launcher",
    "singularity": "the container runtime",
    "apptainer": "the container runtime (Singularity's successor)",
    "docker": "the container runtime",
    "pip": "Python's package installer",
    "pip3": "Python's package installer",
    "pytest": "the test runner",
    "ssh": "OpenSSH client",
    "make": "GNU make (its variables are checked: MAKE_VARIABLE_OWNERS)",
    "tensorboard": "TensorBoard's own command",
    "git": "git",
    "vipu": "Graphcore's V-IPU client",
    "popc": "Graphcore's Poplar compiler",
    "venv": "python -m venv, Python's virtual environments",
}
EXTERNAL_PROGRAM_PREFIXES = ("gc-",)  # Graphcore's gc-monitor, gc-info, gc-reset, ...

# Flags of other programs that prose and inline code may name on their own (without their program).
PROSE_EXTERNAL_FLAGS = {
    "ipus": "srun --ipus, Graphcore's Slurm plugin",
    "signal": "sbatch --signal",
    "array": "sbatch --array",
    "gres": "sbatch/srun --gres",
    "gpus": "sbatch/srun --gpus",
    "gpus-per-task": "sbatch/srun --gpus-per-task",
    "ntasks": "sbatch/srun --ntasks",
    "ntasks-per-node": "sbatch/srun --ntasks-per-node",
    "nodes": "sbatch/srun --nodes",
    "nv": "singularity/apptainer exec --nv",
    "bind": "singularity/apptainer exec --bind",
    "fakeroot": "singularity/apptainer build --fakeroot",
    "num-replicas": "poprun --num-replicas",
    "num-instances": "poprun --num-instances",
    "ipus-per-replica": "poprun --ipus-per-replica",
    "vipu-partition": "poprun --vipu-partition",
    "vipu-server-host": "poprun --vipu-server-host",
    "executable-cache-path": "poprun --executable-cache-path",
    "executable_cache_path": "TF_POPLAR_FLAGS=--executable_cache_path, Graphcore's TensorFlow",
    "cpus-per-task": "sbatch/srun --cpus-per-task",
    "dry-run": "sbatch/poprun --dry-run",
}

# Environment and make variables whose value is a list of flags, and whose flags those are.
MAKE_VARIABLE_OWNERS = {
    "RUN_ARGS": "main.py",
    "BENCH_ARGS": "tools/benchmark.py",
    "PARITY_ARGS": "tools/parity.py",
}
EXTERNAL_VARIABLES = {
    "POPRUN_ARGS": "poprun's options (tools/slurm/poprun.sh)",
    "TF_POPLAR_FLAGS": "Graphcore's TensorFlow",
    "POPLAR_ENGINE_OPTIONS": "Poplar",
    "XLA_FLAGS": "XLA",
    "TF_XLA_FLAGS": "TensorFlow's XLA auto-clustering",
    "PYTEST_ADDOPTS": "pytest",
    "SBATCH_ARGS": "sbatch",
}

# The repository's job scripts and where the arguments after them go (None: they take no flags).
REPO_SCRIPTS = {
    "tools/run_container.sh": "main.py",
    "tools/slurm/ipu.sbatch": "main.py",
    "tools/slurm/gpu.sbatch": "main.py",
    "tools/slurm/poprun.sh": "main.py",
    "tools/slurm/scan.sbatch": None,
    "tools/slurm/local_cluster.sh": None,
}

# Tools that hand the arguments after a lone `--` to main.py.
AFTER_DOUBLE_DASH = {"tools/scan.py": "main.py"}

# Programs that only start another: skipped when they start a command line (`sudo docker ...`).
WRAPPERS = ("sudo", "env", "time", "nohup", "exec", "command", "nice")

ANY = "any"              # a flag of main.py or of any tool, or PROSE_EXTERNAL_FLAGS
NO_FLAGS = "no flags"    # a REPO_SCRIPTS entry that takes none
_UNKNOWN = "unknown script "

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
_LIST_ITEM = re.compile(r"^ {0,3}([-*+]|\d{1,9}[.)])(\s|$)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
_FLAG = re.compile(r"(?<![\w-])--(\[no\])?([A-Za-z][\w-]*)")
_ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:name|id)=[\"']([^\"']+)[\"']", re.I)


@dataclasses.dataclass
class Block:
  """A fenced code block: `start` is the line number (from 1) of its opening fence."""
  start: int
  language: str
  lines: list
  tested: bool


@dataclasses.dataclass
class Page:
  blocks: list       # Block: fenced, and indented (4 spaces, after a blank line; language "")
  paragraphs: list   # (line number of the first line, text with its newlines) outside code blocks
  headings: list     # (line number, heading text)
  stray_marks: list  # line numbers of TESTED_MARK lines that no ```sh block follows


def parse_page(text: str) -> Page:
  lines = text.splitlines()
  page = Page([], [], [], [])
  paragraph = []
  in_list = False  # the last paragraph is a list item's: an indented line after it is the item's text
  i = 0

  def end_paragraph():
    if paragraph:
      page.paragraphs.append((paragraph[0][0], "\n".join(line for _, line in paragraph)))
      paragraph.clear()

  while i < len(lines):
    fence = _FENCE.match(lines[i])
    if fence:
      end_paragraph()
      closing = re.compile(r"^ {0,3}%s{%d,}\s*$" % (re.escape(fence.group(1)[0]), len(fence.group(1))))
      end = i + 1
      while end < len(lines) and not closing.match(lines[end]):
        end += 1
      tested = i > 0 and lines[i - 1].strip() == TESTED_MARK and fence.group(2).lower() in TESTED_LANGUAGES
      page.blocks.append(Block(i + 1, fence.group(2).lower(), lines[i + 1:end], tested))
      i = end + 1
      continue
    line = lines[i]
    after_blank = i == 0 or not lines[i - 1].strip() or _HEADING.match(lines[i - 1])
    if _indent(line) >= 4 and line.strip() and after_blank and not in_list:
      end = i
      while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) >= 4):
        end += 1
      while not lines[end - 1].strip():
        end -= 1
      page.blocks.append(Block(i, "", [l.expandtabs(4)[4:] for l in lines[i:end]], False))
      i = end
      continue
    if line.strip() and after_blank and (_indent(line) == 0 or _LIST_ITEM.match(line)):
      in_list = bool(_LIST_ITEM.match(line))
    if line.strip() == TESTED_MARK:
      following = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
      if not following or following.group(2).lower() not in TESTED_LANGUAGES:
        page.stray_marks.append(i + 1)
    heading = _HEADING.match(line)
    if heading:
      page.headings.append((i + 1, heading.group(1)))
    if line.strip():
      paragraph.append((i + 1, line))
    else:
      end_paragraph()
    i += 1
  end_paragraph()
  return page


def _indent(line: str) -> int:
  return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip())


def strip_comment(line: str) -> str:
  """The line without its shell comment: a `#` that starts a word outside quotes, and what follows."""
  quote = None
  escaped = False
  for index, char in enumerate(line):
    if escaped:
      escaped = False
    elif char == "\\" and quote != "'":
      escaped = True
    elif quote:
      if char == quote:
        quote = None
    elif char in "'\"":
      quote = char
    elif char == "#" and (index == 0 or line[index - 1].isspace() or line[index - 1] in ";&|("):
      return line[:index]
  return line


def command_lines(lines, first_line: int = 1) -> list:
  """A code block's command lines as (line number, command): `\\` continuations joined, `#` comments
  and blank lines dropped; a command with a here-document keeps its body and end line (newlines)."""
  commands = []
  pending, start, heredoc = None, None, None
  for number, raw in enumerate(lines, first_line):
    if heredoc is not None:
      pending += "\n" + raw
      if raw.strip() == heredoc:
        commands.append((start, pending))
        pending, heredoc = None, None
      continue
    if pending is None:
      start, text = number, raw
    else:
      text = pending + raw
    if text.endswith("\\") and not text.endswith("\\\\"):
      pending = text[:-1]
      continue
    pending = None
    command = strip_comment(text).strip()
    if not command:
      continue
    here = re.search(r"(?<!<)<<-?\s*(['\"]?)([\w.-]+)\1", command)
    if here:
      pending, heredoc = command, here.group(2)
      continue
    commands.append((start, command))
  if pending is not None:
    commands.append((start, pending))
  return commands


def split_words(text: str, operators: bool = True) -> list:
  """Shell words (quotes removed), with the operators `| || && ; & ( ) < > >> 2>&1 <<` apart (with
  `operators`; without, `<name>` stays whole)."""
  lexer = shlex.shlex(text, posix=True, punctuation_chars=operators)
  lexer.whitespace_split = True
  lexer.commenters = ""
  try:
    return list(lexer)
  except ValueError:  # an unbalanced quote (a sample of output, an apostrophe): plain words then
    return text.split()


def _is_operator(word: str) -> bool:
  return bool(word) and all(char in "|&;()<>" for char in word)


def simple_commands(words) -> list:
  """`words` cut at `| || && ; & ( )`, with redirections (and their targets) left out."""
  commands, current = [], []
  skip_next = False
  for word in words:
    if skip_next:
      skip_next = False
    elif _is_operator(word):
      if "<" in word or ">" in word:
        skip_next = not word.endswith("&")
      elif current:
        commands.append(current)
        current = []
    else:
      current.append(word)
  if current:
    commands.append(current)
  return commands


def _relative(word: str) -> str:
  return word[2:] if word.startswith("./") else word


def script_owner(path: str) -> str:
  """Whose flags follow a Python script's path: main.py's, a tool's, or an unknown script's."""
  path = _relative(path)
  if os.path.basename(path) == "main.py":
    return "main.py"
  tool = re.search(r"(?:^|/)tools/([\w-]+\.py)$", path)
  if tool:
    return "tools/" + tool.group(1)
  return _UNKNOWN + path


def _external(word: str) -> bool:
  name = os.path.basename(word)
  return name in EXTERNAL_PROGRAMS or name.startswith(EXTERNAL_PROGRAM_PREFIXES)


def _python_start(words, i):
  """At a Python interpreter: (owner of the flags that follow, index of the first of them); None for
  Python's own and for `-c` code."""
  j = i + 1
  while j < len(words) and words[j].startswith("-") and not words[j].startswith("--"):
    option = words[j]
    if option == "-m" and j + 1 < len(words):
      module = words[j + 1]
      if module.split(".")[0] in EXTERNAL_PROGRAMS:
        return None, j + 2
      if module.startswith("tools."):
        return "tools/%s.py" % module[len("tools."):], j + 2
      return ("main.py" if module == "main" else _UNKNOWN + "-m " + module), j + 2
    if option == "-c":
      return None, j + 2
    j += 2 if option in ("-W", "-X") else 1
  if j < len(words) and words[j].endswith(".py"):
    return script_owner(words[j]), j + 1
  return None, j  # Python's own options (`python3 --version`)


def flag_segments(words, default_owner: str) -> list:
  """One simple command's words as (owner, words) segments: whose flags each run of words holds.

  The owner is "main.py", "tools/X.py", ANY, NO_FLAGS, None (another program's, not checked) or
  "unknown script ..."; `default_owner` is a line's whose first word is no program known here."""
  segments = []
  owner, current = default_owner, []
  at_start = True
  i = 0
  while i < len(words):
    word = words[i]
    assignment = _ASSIGNMENT.match(word)
    if assignment and not word.startswith("-"):
      name = assignment.group(1)
      if name in MAKE_VARIABLE_OWNERS:
        segments.append((MAKE_VARIABLE_OWNERS[name], split_words(assignment.group(2))))
      elif name not in EXTERNAL_VARIABLES:
        segments.append((default_owner, split_words(assignment.group(2))))
      i += 1
      continue
    new_owner, next_index = None, None
    if word == "--" and owner in AFTER_DOUBLE_DASH:
      new_owner, next_index = AFTER_DOUBLE_DASH[owner], i + 1
    elif word.startswith("-"):
      pass
    elif _PYTHON.match(os.path.basename(word)):
      new_owner, next_index = _python_start(words, i)
    elif word.endswith(".py") and (
        at_start or not script_owner(word).startswith(_UNKNOWN)):  # else an argument (`pytest x.py`)
      new_owner, next_index = script_owner(word), i + 1
    elif _relative(word) in REPO_SCRIPTS:
      new_owner, next_index = REPO_SCRIPTS[_relative(word)] or NO_FLAGS, i + 1
    elif at_start and word in WRAPPERS:
      i += 1
      continue
    elif at_start and _external(word):
      new_owner, next_index = None, i + 1
    if next_index is not None:
      segments.append((owner, current))
      owner, current = new_owner, []
      i = next_index
    else:
      current.append(word)
      i += 1
    at_start = False
  segments.append((owner, current))
  return [(owner, words) for owner, words in segments if words]


def flags_in_words(words) -> list:
  """The flag names (`--[no]name` as `name`, `--noname` as `noname`) in `words`, in order: each word's
  flags, where a word can hold several (`"--a=1 --b"`, lines: `printf '--a=1\\n--b=2\\n'`), but not
  those in a flag's value that starts with a dash (`--sbatch_args="--time=2:00:00"`: sbatch's --time)."""
  names = []
  for word in words:
    for line in word.replace("\\n", "\n").split("\n"):
      first, *rest = line.strip().split(None, 1) or [""]
      if first.startswith("--"):
        name, equals, value = first.partition("=")
        names.extend(match.group(2) for match in _FLAG.finditer(name))
        if equals and value.startswith("-"):
          continue
        line = " ".join(rest)
      names.extend(match.group(2) for match in _FLAG.finditer(line))
  return names


def command_flags(text: str, default_owner: str) -> list:
  """(flag name, owner) for each flag of a command line (owner None: another program's, not checked)."""
  found = []
  for command in simple_commands(split_words(text)):
    for owner, words in flag_segments(command, default_owner):
      found.extend((name, owner) for name in flags_in_words(words))
  return found


def code_spans(text: str) -> list:
  """(offset, content) of each inline code span of a paragraph, with its newlines as spaces."""
  return [(match.start(), match.group(2).replace("\n", " ").strip()) for match in _CODE_SPAN.finditer(text)]


def _line_at(first_line: int, text: str, offset: int) -> int:
  return first_line + text.count("\n", 0, offset)


def page_flags(page: Page) -> list:
  """(line number, flag name, owner) of every flag a page names (owner None ones left out)."""
  found = []
  for block in page.blocks:
    for line, command in command_lines(block.lines, block.start + 1):
      found.extend((line, name, owner) for name, owner in command_flags(command, "main.py"))
  for first_line, text in page.paragraphs:
    text = _HTML_COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for offset, span in code_spans(text):
      line = _line_at(first_line, text, offset)
      found.extend((line, name, owner) for name, owner in command_flags(span, ANY))
    prose = _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for match in _FLAG.finditer(prose):
      found.append((_line_at(first_line, prose, match.start()), match.group(2), ANY))
  return [(line, name, owner) for line, name, owner in found if owner is not None]


# ---- the flags a program lists --------------------------------------------------------------------

_ABSL_FLAG = re.compile(r"^  (?:-\S+,)?--(\[no\])?([\w.-]+):")  # continuation lines: 4 spaces
_ARGPARSE_OPTION = re.compile(r"^  (-[^\s].*?)(?:\s{2,}|$)")


def listed_flags(help_text: str) -> set:
  """The flag names in a program's --helpfull (absl) or --help (argparse) output; a boolean absl flag
  `--[no]name` gives `name` and `noname`."""
  names = set()
  for line in help_text.splitlines():
    absl = _ABSL_FLAG.match(line)
    if absl:
      names.add(absl.group(2))
      if absl.group(1):
        names.add("no" + absl.group(2))
      continue
    option = _ARGPARSE_OPTION.match(line)
    if option:
      names.update(re.findall(r"--([A-Za-z][\w-]*)", option.group(1)))
  return names


def program_help(repo_root: str, program: str, python: str, env=None, timeout=120) -> str:
  """`python PROGRAM --helpfull` (absl), or its `--help` where it has no --helpfull (argparse)."""
  for option in ("--helpfull", "--help"):
    result = subprocess.run([python, os.path.join(repo_root, program), option], cwd=repo_root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if result.returncode == 0 and listed_flags(result.stdout):
      return result.stdout
  raise AssertionError("%s %s: exit status %d, no flags listed:\n%s" % (
      program, option, result.returncode, (result.stdout + result.stderr)[-2000:]))


def check_flags(page: Page, flags_of, prose_known) -> list:
  """Problems (text) with the flags a page names. `flags_of(owner)` gives the set of flag names of
  "main.py" or "tools/X.py" (None if no such program); `prose_known(name)` tells whether a flag named
  without its program exists (in main.py, in a tool or in PROSE_EXTERNAL_FLAGS)."""
  problems = []
  for line, name, owner in page_flags(page):
    if owner == ANY:
      if not prose_known(name):
        problems.append("line %d: --%s is no flag of main.py, of any tool, nor one of "
                        "PROSE_EXTERNAL_FLAGS (tests/support/docs_check.py)" % (line, name))
    elif owner == NO_FLAGS:
      problems.append("line %d: --%s follows a program that takes no flags" % (line, name))
    elif owner.startswith(_UNKNOWN):
      problems.append("line %d: --%s follows %s, which is neither main.py nor a tool; another "
                      "program's? then add it to EXTERNAL_PROGRAMS (tests/support/docs_check.py)"
                      % (line, name, owner[len(_UNKNOWN):]))
    else:
      names = flags_of(owner)
      if names is None:
        problems.append("line %d: --%s follows %s, which does not exist" % (line, name, owner))
      elif name not in names:
        problems.append("line %d: --%s is no flag of %s (not in its --helpfull or --help); if it belongs "
                        "to another program on that line, add that program to EXTERNAL_PROGRAMS "
                        "(tests/support/docs_check.py)" % (line, name, owner))
  return problems


def named_tools(pages) -> list:
  """The tools/X.py the pages name, in the order first named."""
  tools = []
  for text in pages:
    for match in re.finditer(r"tools/([\w-]+\.py)", text):
      if "tools/" + match.group(1) not in tools:
        tools.append("tools/" + match.group(1))
  return tools


# ---- repository paths and links ----------------------------------------------------------------

def top_level_entries(repo_root: str) -> set:
  """The repository's top-level files and folders that git tracks (all but hidden ones and .ci
  where git cannot tell): untracked folders such as logs/ are no part of it."""
  try:
    listed = subprocess.run(["git", "ls-files"], cwd=repo_root, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, timeout=60)
    if listed.returncode == 0 and listed.stdout.strip():
      return {line.split("/")[0] for line in listed.stdout.splitlines() if line}
  except OSError:
    pass
  return {name for name in os.listdir(repo_root) if not name.startswith(".") or name == ".ci"}


def expand_braces(text: str) -> list:
  """`a/{b,c}.py` as [a/b.py, a/c.py] (one level, every brace pair)."""
  match = re.search(r"\{([^{}]*,[^{}]*)\}", text)
  if not match:
    return [text]
  return [expanded for choice in match.group(1).split(",")
          for expanded in expand_braces(text[:match.start()] + choice + text[match.end():])]


def path_candidates(word: str, top_level) -> list:
  """The repository paths a word names: its pieces (split at `=`) that start with a top-level entry,
  with `:line`, `#anchor`, quotes and trailing punctuation taken off."""
  candidates = []
  for piece in word.split("="):
    piece = piece.strip().lstrip("([\"'")
    piece = re.split(r"[:#]", piece)[0]
    piece = piece.rstrip(".,;)]\"'")
    piece = _relative(piece)
    if not piece or "$" in piece or "~" in piece:
      continue
    top = piece.split("/")[0]
    if "/" not in piece and "{" not in piece and not any(ch in top for ch in "*?["):
      continue  # a bare name: a top-level entry itself exists, any other is not a path of ours
    if any(fnmatch.fnmatchcase(entry, pattern) for entry in top_level for pattern in expand_braces(top)):
      candidates.append(piece)
  return candidates


def missing_path(path: str, repo_root: str):
  """None if `path` (braces, `<placeholder>`s and globs allowed) names files that exist, else why not."""
  missing = []
  for expanded in expand_braces(path):
    pattern = re.sub(r"<[^<>]*>", "*", expanded)
    full = os.path.join(repo_root, pattern)
    if any(ch in pattern for ch in "*?["):
      if not glob.glob(full):
        missing.append(expanded + " (matches nothing)")
    elif not os.path.exists(full) or (pattern.endswith("/") and not os.path.isdir(full)):
      missing.append(expanded)
  return ", ".join(missing) or None


def page_paths(page: Page, top_level) -> list:
  """(line number, path) of every repository path in the page's code blocks and inline code."""
  found = []
  for block in page.blocks:
    for number, line in enumerate(block.lines, block.start + 1):
      code = strip_comment(line)
      for word in split_words(code, operators=False) + line[len(code):].split():  # comments' too
        found.extend((number, path) for path in path_candidates(word, top_level))
  for first_line, text in page.paragraphs:
    for offset, span in code_spans(text):
      line = _line_at(first_line, text, offset)
      for word in split_words(span, operators=False):
        found.extend((line, path) for path in path_candidates(word, top_level))
  return found


def check_paths(page: Page, repo_root: str, top_level) -> list:
  problems = []
  for line, path in page_paths(page, top_level):
    missing = missing_path(path, repo_root)
    if missing:
      problems.append("line %d: %s does not exist in the repository" % (line, missing))
  return problems


def github_slug(heading: str) -> str:
  """The anchor GitHub gives a heading: links and tags as their text, lower case, punctuation but
  `-` and `_` dropped, each space a `-`."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  text = re.sub(r"<[^>]+>", "", text).strip().lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Page, text: str) -> set:
  """The anchors of a page: its headings' (a repeated heading gets -1, -2, ...) and HTML ids."""
  seen = {}
  result = set()
  for _, heading in page.headings:
    slug = github_slug(heading)
    if slug in seen:
      seen[slug] += 1
      slug = "%s-%d" % (slug, seen[slug])
    else:
      seen[slug] = 0
    result.add(slug)
  result.update(_HTML_ANCHOR.findall(text))
  return result


def page_links(page: Page) -> list:
  """(line number, target) of every link and image of the page's prose (not in code)."""
  found = []
  for first_line, text in page.paragraphs:
    prose = _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for match in _LINK.finditer(prose):
      found.append((_line_at(first_line, prose, match.start()), match.group(1)))
    for offset, line in enumerate(prose.split("\n")):
      definition = _LINK_DEFINITION.match(line)
      if definition:
        found.append((first_line + offset, definition.group(1)))
  return found


def check_links(page: Page, page_path: str, read) -> list:
  """Problems with the page's relative links: a target that does not exist, or an #anchor that is no
  heading there. `read(path)` gives a page's text."""
  problems = []
  for line, target in page_links(page):
    if re.match(r"^[A-Za-z][\w+.-]*:", target) or target.startswith("//"):
      continue  # https:, mailto:, ...
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(page_path), path)) if path else page_path
    if not os.path.exists(full):
      problems.append("line %d: the link target %s does not exist" % (line, target))
    elif anchor and full.endswith(".md"):
      text = read(full)
      if anchor not in anchors(parse_page(text), text):
        problems.append("line %d: %s has no section #%s" % (line, path or "this page", anchor))
  return problems


def substitute(command: str, python: str, folder: str) -> str:
  """A tested command as it runs: a leading `.venv/bin/python`, `python` or `python3` (after any
  VAR=value) is `python`; /tmp/ni-check is `folder`."""
  command = re.sub(r"^((?:[A-Za-z_]\w*=\S*\s+)*)(?:\.venv/bin/python3?|python3?)(?=\s|$)",
                   lambda m: m.group(1) + shlex.quote(python), command)
  return re.sub(r"/tmp/ni-check(?![\w.-])", lambda m: folder, command)
