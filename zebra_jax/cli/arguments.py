"""The command line's config: read once, from a file or the workdir, overrides applied.

- --config=FILE[:variant]: that file's get_config(variant);
- no --config outside train: the workdir's config.json (upgraded to today's
  fields), so --config.x=y overrides apply to it as well; --config=FILE
  outside train: config.json with the file's settings for running a model
  (config/mode_fields.py);
- outside train, an override that would change the trained model is
  refused, one the mode does not read is warned about;
- no --workdir: runs/<config name>[-<variant>];
- a missing or broken config file, a damaged config.json, an unknown field
  or a bad value is a UserError, before JAX starts.
"""

import os
import re
import sys

import ml_collections

from zebra_jax.cli import overrides as config_overrides
from zebra_jax.config import files, mode_fields
from zebra_jax.errors import UserError

# Flags that held numbers, now config fields (--config.sample.*).
REMOVED_FLAGS = {
    "temperature": "sample.temperature", "top_k": "sample.top_k",
    "top_p": "sample.top_p", "seed": "sample.seed",
    "repetition_penalty": "sample.repetition_penalty", "stop": "sample.stop",
    "stream": "sample.stream", "stream_chunk": "sample.chunk",
    "max_new_tokens": "sample.max_new_tokens",
    "num_samples": "sample.num_samples"}
# Modes that became the lab's own commands (lab/, beside the package: they
# run from a checkout of the repository, not from the wheel).
REMOVED_MODES = {
    "bench": "python -m lab.bench (e.g. --quick)",
    "infer_bench": "python -m lab.infer_bench --workdir=DIR"}


def flag_value(argv: list[str], name: str) -> str | None:
  """The last value given as --name=v, --name v (or with one dash)."""
  value = None
  pattern = re.compile(rf"^--?{re.escape(name)}(=(.*))?$", re.DOTALL)
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    match = pattern.match(arg)
    if match and match.group(1) is not None:
      value = match.group(2)
    elif match and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def check_removed(argv: list[str]) -> None:
  """UserError naming the replacement of a flag or mode that moved."""
  for arg in argv[1:]:
    if arg == "--":
      break
    name = re.sub(r"^--?(no)?", "", arg.split("=", 1)[0])
    if arg.startswith("-") and name in REMOVED_FLAGS:
      value = f"={arg.split('=', 1)[1]}" if "=" in arg else ""
      raise UserError(f"--{name} is now a config field: use "
                      f"--config.{REMOVED_FLAGS[name]}{value}")
  mode = flag_value(argv, "mode")
  if mode in REMOVED_MODES:
    raise UserError(f"--mode={mode} is its own command now: run "
                    f"{REMOVED_MODES[mode]} in a checkout of the repository")


def load(mode: str, spec: str | None, workdir: str | None,
         overrides: list[tuple[str, str | None]], needs_config: bool = True
         ) -> tuple[ml_collections.ConfigDict | None, str]:
  """(config with overrides applied, workdir), each read once."""
  if overrides and not needs_config:
    raise UserError(f"--config.{overrides[0][0]}: --mode={mode} reads no "
                    "config: drop the override")
  if spec:
    cfg = files.load_file(spec)
    workdir = workdir or files.default_workdir(spec)
    if mode_fields.runs_trained_model(mode) and os.path.exists(
        files.saved_path(workdir)):
      # The file says how to run the model; the workdir what it is and
      # which corpus it was trained on (eval's default).
      cfg = mode_fields.run_settings_into(files.load_saved(workdir), cfg)
  elif mode == "train":
    raise UserError("--mode=train needs --config=NAME or FILE, e.g. "
                    "--config=demo (other modes read the workdir's "
                    "config.json)")
  elif workdir is None:
    raise UserError(f"--mode={mode} needs --workdir=DIR of a trained run (or "
                    f"--config=FILE, whose workdir defaults to runs/NAME)")
  elif needs_config:
    cfg = files.load_saved(workdir)
  else:
    cfg = None
  if cfg is not None:
    config_overrides.apply(cfg, overrides)
    fields = [field for field, _ in overrides]
    ignored = set()
    if mode_fields.runs_trained_model(mode):
      ignored = _check_overrides(mode, cfg, workdir, fields)
    for warning in mode_fields.unselected(
        [f for f in fields if f not in ignored], cfg):
      print(f"warning: {warning}", file=sys.stderr, flush=True)
  return cfg, workdir


def _check_overrides(mode: str, cfg: ml_collections.ConfigDict, workdir: str,
                     fields: list[str]) -> set[str]:
  """Refuses what would change the trained model; one warning line for
  each field the mode does not read (config/mode_fields.py). The fields
  warned about."""
  if not fields:
    return set()
  saved = (files.load_saved(workdir)
           if os.path.exists(files.saved_path(workdir)) else None)
  warned = set()
  for field in fields:
    for warning in mode_fields.check_overrides(mode, [field], cfg, saved,
                                               workdir):
      print(f"warning: {warning}", file=sys.stderr, flush=True)
      warned.add(field)
  return warned
