"""Running an absl program with one `error:` line (exit 2) for bad input.

Used by zebra_jax.main and the tools, so every entry point parses flags the
same way: absl flags, ml_collections --config files, UserError as one line.
"""

import sys
from typing import Callable, Sequence

from absl import app, flags

from zebra_jax.cli import arguments
from zebra_jax.errors import UserError


def usage_error(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def asks_help(argv: Sequence[str]) -> bool:
  return any(a.startswith("-") and "=" not in a and
             a.lstrip("-").startswith(("help", "h", "?")) for a in argv[1:])


def parse_flags(argv: list[str],
                resolve: Callable[[list[str]], list[str]] | None = None):
  """absl's parser, after `resolve` (argv -> argv) and a --config check."""
  try:
    if not asks_help(argv):
      argv = resolve(argv) if resolve else argv
      spec = arguments.flag_value(argv, "config")
      if spec:
        arguments.load_config_file(spec)
  except UserError as e:
    usage_error(str(e))
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    usage_error(arguments.config_field_error(argv) or " ".join(str(e).split()))


def run_tool(main: Callable[[list[str]], int | None]) -> None:
  """app.run(main), a UserError from main being one `error:` line, exit 2."""
  def guarded(argv):
    try:
      return main(argv)
    except UserError as e:
      usage_error(str(e))
  app.run(guarded, flags_parser=parse_flags)


def default_config(name: str) -> str | None:
  """configs/<name> of the source tree, if the package runs from one."""
  import os
  from zebra_jax.cli import saved_config
  path = os.path.join(saved_config.CONFIGS_DIR, name.partition(":")[0])
  return os.path.join(saved_config.CONFIGS_DIR, name) if os.path.isfile(
      path) else None
