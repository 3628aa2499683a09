"""Running an absl program with one `error:` line (exit 2) for bad input.

Used by zebra_jax.main and the lab's scripts, so every entry point parses
flags the same way: absl flags, --config files, UserError as one line.
"""

import re
import sys
from typing import Callable, Sequence

from absl import app, flags

from zebra_jax.cli import arguments, overrides
from zebra_jax.config import files
from zebra_jax.errors import UserError
from zebra_jax.runtime import host_memory


def usage_error(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def asks_help(argv: Sequence[str]) -> bool:
  return any(a.startswith("-") and "=" not in a and
             a.lstrip("-").startswith(("help", "h", "?")) for a in argv[1:])


def asks_short_help(argv: Sequence[str]) -> bool:
  """--help, -h, --helpshort or -? (not --helpfull, which absl answers)."""
  return any(a.lstrip("-") in ("help", "h", "?", "helpshort")
             and a.startswith("-") for a in argv[1:])


def parse_flags(argv: list[str],
                check: Callable[[list[str]], None] | None = None,
                own_overrides: bool = False):
  """absl's parser, after `check(argv)` (a UserError there is one line).

  A help flag prints absl's help and exits 0 (absl itself exits 1: a
  script asked for its help has not failed).
  """
  try:
    return _parse_flags(argv, check, own_overrides)
  except SystemExit as e:
    if asks_help(argv) and e.code == 1:
      sys.exit(0)
    raise


def _parse_flags(argv, check, own_overrides):
  """parse_flags without the help's exit status.

  own_overrides: the --config.x=y overrides are kept out of absl's way and
  handed to main as argv[1:], (field, text) pairs, for the program to apply
  to the config it reads once (zebra_jax.main). Otherwise ml_collections'
  --config flag of the program parses them, and a bad one is one line too.
  """
  try:
    if not asks_help(argv):
      if check:
        check(argv)
      spec = arguments.flag_value(argv, "config")
      if spec and not own_overrides:
        files.load_file(spec)
  except UserError as e:
    usage_error(str(e))
  if own_overrides:
    rest, found = overrides.split(argv)
    try:
      return [flags.FLAGS(rest)[0], *found]
    except flags.Error as e:
      usage_error(" ".join(str(e).split()))
  try:
    return flags.FLAGS(_config_as_path(argv))
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    usage_error(_override_error(argv) or " ".join(str(e).split()))


def _config_as_path(argv: list[str]) -> list[str]:
  """argv with --config's shipped name as its file: ml_collections' config
  flag reads files only."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg == "--":
      break
    given = re.match(r"^(--?config=)(.*)$", arg, re.DOTALL)
    if given:
      out[i] = given.group(1) + files.as_path(given.group(2))
    elif arg in ("--config", "-config") and i + 1 < len(out):
      out[i + 1] = files.as_path(out[i + 1])
  return out


def _override_error(argv: list[str]) -> str | None:
  """For a bad --config.a.b override: the one line cli.overrides gives."""
  spec = arguments.flag_value(argv, "config")
  if spec is None:
    return None
  try:
    overrides.apply(files.load_file(spec), overrides.split(argv)[1])
  except UserError as e:
    return str(e)
  return None


def run_tool(main: Callable[[list], int | None],
             own_overrides: bool = False) -> None:
  """app.run(main), a UserError from main being one `error:` line, exit 2.

  own_overrides: as in parse_flags (main reads its config with
  cli.arguments.load). Sets glibc's malloc first, before JAX starts its
  backend (runtime/host_memory.py).
  """
  host_memory.reuse_freed_host_memory()

  def guarded(argv):
    try:
      return main(argv)
    except UserError as e:
      usage_error(str(e))
  app.run(guarded, flags_parser=lambda argv: parse_flags(
      argv, own_overrides=own_overrides))


def default_config(spec: str) -> str:
  """A shipped config's file, as the default of ml_collections' config flag
  (which reads files only): default_config("demo:tiny")."""
  return files.as_path(spec)
