"""Every shell command README.md, docs/*.md and lab/notes/*.md show, checked
against the code.

So that a page cannot drift from the software: each command in a fenced
shell block (```bash, ```sh, ```shell, or `$ ` lines of ```console and
untagged blocks) must name a module or script that exists, flags that its
entry point defines, fields of zebra_jax/config/base.py, configs that load,
repository paths that exist, and workdirs that an earlier command on the
same page trains. A workdir trained elsewhere is declared by a comment in
the block: `# runs/demo comes from <where>`. A page showing the lab's
commands (python -m lab.NAME, launch/*.sh) says they run "from the
repository root".

The flags of zebra-jax are read from absl's registry; the lab's, the launch
scripts' and other modules' from their source, without running them.
"""

import dataclasses
import functools
import glob
import os
import re
import shlex
import tomllib

from absl import flags

from zebra_jax.config import base, files
from zebra_jax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_LANGS = ("bash", "sh", "shell", "zsh")
# The repository's top-level entries: a word starting with one names a file.
REPO_ROOTS = ("docs/", "lab/", "launch/", "tests/", "zebra_jax/", "results/",
              "README.md", "pyproject.toml")
WORKDIR_ROOT = "runs/"
# Flags whose value is a path the command writes (not read, need not exist).
OUTPUT_FLAGS = ("out", "json", "plot_out", "export_dir", "trace_dir")
DECLARED = re.compile(r"#\s*(\S+) comes from \S")
WORKING_DIRECTORY = "from the repository root"
WRAPPERS = ("sudo", "exec", "nohup", "time", "/usr/bin/time")
SEPARATORS = ("&&", "||", "|", ";", "&", "(", ")")


@dataclasses.dataclass
class Command:
  """One simple command of a page, its variables expanded."""
  line: int
  words: list[str]
  comment: str = ""


@dataclasses.dataclass(frozen=True)
class Entry:
  """What a command runs: its flags (None: not known, not checked), whether
  it takes --config.x.y overrides, and how it treats --workdir."""
  name: str
  flags: frozenset | None
  takes_config: bool = False
  reads_workdir: bool = False
  trains: bool = False


# --- reading a page -------------------------------------------------------


def shell_blocks(text: str):
  """(first line number, [lines]) of every block of commands on a page."""
  lines = text.split("\n")
  i = 0
  while i < len(lines):
    opening = re.match(r"^\s*```+\s*([\w-]*)", lines[i])
    if not opening:
      i += 1
      continue
    lang, start, body = opening.group(1).lower(), i + 1, []
    i += 1
    while i < len(lines) and not re.match(r"^\s*```", lines[i]):
      body.append(lines[i])
      i += 1
    i += 1
    if lang in SHELL_LANGS:
      yield start + 1, body
    elif lang in ("console", ""):  # only the prompted lines are commands
      prompted = [line[2:] if line.startswith("$ ") else "" for line in body]
      if any(prompted):
        yield start + 1, prompted


def logical_lines(first: int, body: list[str]):
  """(line number, text) with continuations and open quotes joined."""
  i = 0
  while i < len(body):
    number, text = first + i, body[i]
    while i + 1 < len(body) and (text.endswith("\\") or not _closed(text)):
      text = (text[:-1] if text.endswith("\\") else text + "\n") + body[i + 1]
      i += 1
    i += 1
    if text.strip():
      yield number, text


def _closed(text: str) -> bool:
  try:
    shlex.split(text, comments=True)
    return True
  except ValueError:
    return False


def commands(text: str):
  """Every simple command of a page's blocks, in order, variables expanded
  (assignments carry over to later blocks, as in one shell session)."""
  variables = {}
  for first, body in shell_blocks(text):
    comments = " ".join(line for line in body if line.lstrip().startswith("#")
                        or " # " in line)
    for number, line in logical_lines(first, body):
      line = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line)
      lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
      lexer.whitespace_split = True
      lexer.commenters = "#"
      try:
        words = list(lexer)
      except ValueError:
        continue
      for simple in _split(words):
        simple = _expand(simple, variables)
        while simple and re.match(r"^[A-Za-z_]\w*=", simple[0]):
          name, _, value = simple.pop(0).partition("=")
          if not simple:
            variables[name] = value
        if simple and simple[0] == "export":
          for word in simple[1:]:
            name, _, value = word.partition("=")
            variables[name] = value
          continue
        if simple:
          yield Command(number, simple, comments)


def _split(words: list[str]):
  current = []
  for word in words:
    if word in SEPARATORS:
      if current:
        yield current
      current = []
    else:
      current.append(word)
  if current:
    yield current


def _expand(words: list[str], variables: dict[str, str]) -> list[str]:
  out = []
  for word in words:
    whole = re.fullmatch(r"\$\{?(\w+)\}?", word)
    if whole and whole.group(1) in variables:
      out.extend(shlex.split(variables[whole.group(1)]))
      continue
    out.append(re.sub(r"\$\{?(\w+)\}?",
                      lambda m: variables.get(m.group(1), m.group(0)), word))
  return out


# --- what a command runs --------------------------------------------------


@functools.cache
def config_fields() -> frozenset:
  return frozenset(name for name, _ in base.fields())


def _flags_of(*modules: str) -> frozenset:
  return frozenset(flag.name for module in modules
                   for flag in flags.FLAGS.get_flags_for_module(module))


@functools.cache
def absl_builtin_flags() -> frozenset:
  """Every absl program's: help, flag files, logging, debugging."""
  from absl import app, logging  # pylint: disable=g-import-not-at-top,unused-import
  return _flags_of("absl.app", "absl.logging") | {
      "help", "helpshort", "helpfull", "helpxml", "flagfile", "undefok"}


@functools.cache
def main_entry() -> Entry:
  """zebra-jax's flags, as absl holds them once zebra_jax.main is imported."""
  import zebra_jax.main  # pylint: disable=g-import-not-at-top,unused-import
  return Entry("zebra-jax", absl_builtin_flags() | _flags_of(
      "zebra_jax.main", "zebra_jax.runtime.distributed"), takes_config=True,
               reads_workdir=True, trains=True)


@functools.cache
def source_entry(path: str) -> Entry:
  """A script's flags as its source defines them (absl, ml_collections'
  config flag, argparse); None where it defines none (it hands its
  arguments on, e.g. to tritonserver)."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  names = set(re.findall(r"DEFINE_\w+\(\s*['\"](\w+)['\"]", source))
  names |= set(re.findall(r"add_argument\(\s*['\"]--([\w-]+)['\"]", source))
  if not names:
    return Entry(os.path.relpath(path, REPO), None)
  workdir_help = re.search(
      r"DEFINE_string\(\s*['\"]workdir['\"],[^,]*,\s*['\"]([^'\"]*)", source)
  takes_config = "config" in names or "own_overrides=True" in source
  return Entry(os.path.relpath(path, REPO),
               frozenset(names) | absl_builtin_flags(), takes_config,
               reads_workdir=bool(workdir_help and "trained" in
                                  workdir_help.group(1)))


@functools.cache
def launch_entry(path: str) -> Entry:
  """A launch script: its own --options (its `case` patterns) and those of
  the program it hands the rest of its arguments to."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  patterns = re.findall(r"^\s*(--[\w-]+(?:\|--[\w-]+)*)\)", source, re.M)
  own = frozenset(option[2:] for pattern in patterns
                  for option in pattern.split("|"))
  if "zebra_jax.main" in source:
    inner = main_entry()
  else:
    module = re.search(r"python3? -m (lab(?:\.\w+)+)", source)
    inner = (module_entry(module.group(1)) if module and os.path.isfile(
        module_path(module.group(1))) else None)
  if inner is None or inner.flags is None:
    return Entry(os.path.relpath(path, REPO), own or None)
  return dataclasses.replace(inner, name=os.path.relpath(path, REPO),
                             flags=inner.flags | own, reads_workdir=False)


def module_entry(module: str) -> Entry | None:
  """The entry point of `python -m module`, or None for a module of
  another project (pip, pytest, venv...)."""
  if module == "zebra_jax.main":
    return main_entry()
  if module.split(".")[0] not in ("zebra_jax", "lab"):
    return None
  return source_entry(module_path(module))


def module_path(module: str) -> str:
  return os.path.join(REPO, *module.split(".")) + ".py"


def entry_of(words: list[str]) -> tuple[Entry | None, list[str], str | None]:
  """(entry point, its arguments, a problem) of a simple command."""
  while words and (words[0] in WRAPPERS or (words[0].startswith("-") and
                                            words[0] != "--")):
    words = words[1:]  # sudo, time -v, ...
  if not words:
    return None, [], None
  program, args = words[0], words[1:]
  if program == "zebra-jax":
    return main_entry(), args, None
  if re.fullmatch(r"python[\d.]*", program) and args[:1] == ["-m"]:
    module = args[1] if len(args) > 1 else ""
    if module.split(".")[0] in ("zebra_jax", "lab") and not os.path.isfile(
        module_path(module)):
      return None, [], f"python -m {module}: no such module in the repository"
    return module_entry(module), args[2:], None
  if program in ("bash", "sh") and args:
    program, args = args[0], args[1:]
  if program == "sbatch":
    while args and args[0].startswith("-"):
      args = args[1:]
    if not args:
      return None, [], None
    program, args = args[0], args[1:]
  if program.startswith(("launch/", "./launch/")):
    path = os.path.join(REPO, program.removeprefix("./"))
    if not os.path.isfile(path):
      return None, [], f"{program}: no such script in the repository"
    return launch_entry(path), args, None
  return None, args, None


# --- checking -------------------------------------------------------------


def check_page(text: str, page: str = "page") -> list[str]:
  """The problems of a page's commands, one line each ("page:line: ...")."""
  findings, trained = [], set()
  lab_commands = []
  for command in commands(text):
    where = f"{page}:{command.line}"
    entry, args, problem = entry_of(command.words)
    if problem:
      findings.append(f"{where}: {problem}")
      continue
    declared = set(DECLARED.findall(command.comment))
    if entry is not None and (entry.name.startswith(("lab/", "launch/"))):
      lab_commands.append(where)
    trained |= declared
    for message in _check_command(entry, args, trained):
      findings.append(f"{where}: {message}")
  if lab_commands and WORKING_DIRECTORY not in text.lower():
    findings.append(f"{lab_commands[0]}: the lab's commands run from the "
                    f"repository root, and the page does not say so "
                    f"(\"{WORKING_DIRECTORY}\")")
  return findings


def _check_command(entry: Entry | None, args: list[str], trained: set):
  """Yields what is wrong with one command; adds the workdirs it trains."""
  options, positional = _options(args)
  if entry is not None and entry.flags is not None:
    for name in options:
      yield from _check_flag(entry, name)
  spec = options.get("config")
  for value in [spec, *positional]:
    if value and (value == spec or files.resolve(value.partition(":")[0])):
      try:
        files.load_file(value)
      except UserError as e:
        yield f"--config={value}: {e}"
  writes = _writes(entry, options, positional)
  trained |= writes
  for path in _reads(entry, options, args) - writes:
    if not _within(path, trained):
      yield (f"reads {path}, which no earlier command on the page trains "
             f"(add the command that does, or a comment "
             f"'# {path} comes from ...')")
  for path in _repository_paths(options, args):
    if not os.path.exists(os.path.join(REPO, path)) and not _within(
        path, trained):
      yield f"{path}: no such file or folder in the repository"
  for extra in _extras(args):
    if extra not in optional_dependencies():
      yield f"\".[{extra}]\": pyproject.toml defines no such extra"


def _options(args: list[str]) -> tuple[dict[str, str], list[str]]:
  """{--name: value ('' for a bare flag)} and the positional words."""
  options, positional = {}, []
  for arg in args:
    if arg == "--":
      break
    match = re.fullmatch(r"--([\w.-]+)(?:=(.*))?", arg, re.DOTALL)
    if match:
      options[match.group(1)] = match.group(2) or ""
    elif not arg.startswith("-"):
      positional.append(arg)
  return options, positional


def _check_flag(entry: Entry, name: str):
  if name.startswith("config."):
    if not entry.takes_config:
      yield f"--{name}: {entry.name} takes no --config.x.y overrides"
    elif name[len("config."):] not in config_fields():
      yield (f"--{name}: no field {name[len('config.'):]} in "
             f"zebra_jax/config/base.py")
  elif name not in entry.flags and not (
      name.startswith("no") and name[2:] in entry.flags):
    yield f"--{name}: {entry.name} defines no such flag"


def _writes(entry, options, positional) -> set[str]:
  """Workdirs and output folders the command creates."""
  out = {options[name] for name in OUTPUT_FLAGS if options.get(name)}
  if entry is None:
    return out
  if entry.trains and options.get("mode", "train") == "train":
    if options.get("workdir"):
      out.add(options["workdir"])
    elif options.get("config"):
      out.add(files.default_workdir(options["config"]))
    config_at = [i for i, word in enumerate(positional)
                 if files.resolve(word.partition(":")[0])]
    if config_at and config_at[0] + 1 < len(positional):
      out.add(positional[config_at[0] + 1])  # launch/*.sh CONFIG WORKDIR
  elif not entry.reads_workdir and options.get("workdir"):
    out.add(options["workdir"])  # a lab script's own runs
  return {path.rstrip("/") for path in out}


def _reads(entry, options, args) -> set[str]:
  """Workdirs the command needs trained already."""
  found = set()
  if entry is not None and entry.reads_workdir and (
      not entry.trains or options.get("mode", "train") != "train"):
    if options.get("workdir"):
      found.add(options["workdir"])
    elif options.get("config"):
      found.add(files.default_workdir(options["config"]))
  if entry is not None and options.get("compare"):
    found.update(options["compare"].split(","))
  for word in _words_and_values(args):
    if word.startswith(WORKDIR_ROOT):
      found.add(word)
  return {path.rstrip("/") for path in found}


def _repository_paths(options, args) -> set[str]:
  written = {options.get(name) for name in OUTPUT_FLAGS}
  return {word.rstrip("/") for word in _words_and_values(args)
          if word.startswith(REPO_ROOTS) and word not in written
          and not re.search(r"[*{]", word)}


def _words_and_values(args: list[str]):
  for arg in args:
    value = arg.partition("=")[2] if arg.startswith("-") else arg
    yield from (part for part in value.split(",") if part)


def _within(path: str, folders: set) -> bool:
  return any(path == folder or path.startswith(folder.rstrip("/") + "/")
             for folder in folders)


def _extras(args: list[str]):
  for arg in args:
    match = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
    if match:
      yield from match.group(1).split(",")


@functools.cache
def optional_dependencies() -> frozenset:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return frozenset(tomllib.load(f)["project"]["optional-dependencies"])


def pages() -> list[str]:
  """README.md, docs/*.md and the lab's notes (lab/notes/*.md), relative to
  the repository root."""
  found = [p for folder in (("docs",), ("lab", "notes"))
           for p in glob.glob(os.path.join(REPO, *folder, "*.md"))]
  return ["README.md"] + sorted(os.path.relpath(p, REPO) for p in found)


def check_repository() -> list[str]:
  findings = []
  for page in pages():
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
      findings.extend(check_page(f.read(), page))
  return findings
