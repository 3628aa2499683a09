"""The command line before absl parses it: fill in what can be inferred.

`resolve` makes the forgiving defaults explicit in argv, so absl and
ml_collections then parse one complete command:
- no --config outside train: the workdir's config.json (zebra_jax/cli/
  saved_config.py), so --config.x=y overrides still apply;
- no --workdir: runs/<config name>[-<variant>];
- a missing or broken config file, or a damaged config.json, is a UserError
  here rather than two tracebacks later.
"""

import importlib.util
import json
import os
import re

from zebra_jax.errors import UserError

SAVED_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "saved_config.py")
# Modes that read neither a config nor a workdir's config.json.
_CONFIGLESS_MODES = ("plot", "bench")


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


def _overrides(argv: list[str]) -> list[str]:
  return [a for a in argv if re.match(r"^--?(no)?config\.", a)]


def load_config_file(spec: str):
  """configs/demo.py[:variant] -> its get_config(variant), or a UserError."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    folder = os.path.dirname(path) or "."
    known = _config_files(folder)
    if known:
      hint = f"configs in {folder}: {', '.join(known)}"
    else:
      from zebra_jax.cli import saved_config
      folder = os.path.relpath(saved_config.CONFIGS_DIR)
      hint = (f"e.g. --config={os.path.join(folder, 'demo.py')}"
              if _config_files(folder) else "pass a config file that defines "
              "get_config(), e.g. configs/demo.py of the source tree")
    raise UserError(f"--config={spec}: no such file {path!r}; {hint}")
  try:
    module_spec = importlib.util.spec_from_file_location("_zebra_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()
  except Exception as e:  # pylint: disable=broad-except
    message = " ".join(str(e).split()) or type(e).__name__
    raise UserError(f"--config={spec} does not load: {type(e).__name__}: "
                    f"{message}") from None


def _config_files(folder: str) -> list[str]:
  """The .py files in folder that define get_config (config files)."""
  if not os.path.isdir(folder):
    return []
  found = []
  for name in sorted(os.listdir(folder)):
    try:
      if name.endswith(".py") and "def get_config(" in open(
          os.path.join(folder, name), errors="replace").read(100_000):
        found.append(name)
    except OSError:
      continue
  return found


def default_workdir(spec: str) -> str:
  """runs/demo for configs/demo.py, runs/wt103-tiny for configs/wt103.py:tiny."""
  path, _, variant = spec.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}-{variant}" if variant else name)


def check_saved_config(workdir: str, mode: str) -> bool:
  """Whether workdir holds a readable config.json (UserError if damaged)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    return False
  try:
    with open(path) as f:
      saved = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    fix = ("delete it to resume with --config's settings" if mode == "train"
           else "restore it from a copy, or train into a new --workdir")
    raise UserError(f"{path} is damaged ({' '.join(str(e).split())}), e.g. cut "
                    f"short by a full disk: {fix}") from None
  except OSError as e:
    raise UserError(f"cannot read {path}: {e.strerror}: fix its "
                    "permissions") from None
  if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
    raise UserError(f"{path} is not a zebra_jax config (no model section): "
                    f"restore it, or train into a new --workdir")
  return True


def resolve(argv: list[str]) -> list[str]:
  """argv with --config and --workdir filled in where they can be inferred."""
  argv = list(argv)
  mode = flag_value(argv, "mode") or "train"
  config = flag_value(argv, "config")
  workdir = flag_value(argv, "workdir")
  if config:
    load_config_file(config)
    if workdir is None:
      workdir = default_workdir(config)
      argv.append(f"--workdir={workdir}")
  elif mode == "train":
    raise UserError("--mode=train needs --config=FILE, e.g. --config=configs/"
                    "demo.py (other modes read the workdir's config.json)")
  elif workdir is None and mode != "bench":
    raise UserError(f"--mode={mode} needs --workdir=DIR of a trained run (or "
                    f"--config=FILE, whose workdir defaults to runs/NAME)")
  saved = workdir is not None and check_saved_config(workdir, mode)
  if not config and saved:
    argv.insert(1, f"--config={SAVED_CONFIG}:{workdir}")  # before overrides
  elif not config and mode not in _CONFIGLESS_MODES:
    raise UserError(f"workdir {workdir} has no config.json: train first with "
                    f"--mode=train --config=FILE --workdir={workdir}, or pass "
                    f"--config=FILE")
  elif not config and _overrides(argv):
    raise UserError(f"{_overrides(argv)[0]}: there is no config to override "
                    f"without --config=FILE or a --workdir holding config.json")
  return argv


def config_field_error(argv: list[str]) -> str | None:
  """For a bad --config.a.b override: which field is unknown, and the valid ones."""
  spec = flag_value(argv, "config")
  if spec is None:
    return None
  try:
    cfg = load_config_file(spec)
  except UserError:
    return None
  for arg in _overrides(argv):
    dotted = arg.split("=", 1)[0].split("config.", 1)[1]
    node, walked = cfg, []
    for part in dotted.split("."):
      if not hasattr(node, "keys") or part not in node:
        where = ".".join(walked) or "the config"
        valid = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else ""
        return (f"--config.{dotted}: {where} has no field {part!r}; valid "
                f"fields: {valid}")
      node, walked = node[part], walked + [part]
  return None
