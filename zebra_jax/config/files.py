"""Config files and a workdir's config.json, read into ConfigDicts.

`load_file` is the one loader of configs: a shipped config by name
(demo[:variant], from zebra_jax/configs/) or a config file by path
(path/to/mine.py[:variant]); `upgrade` is the one place an older config.json
is brought up to date.
"""

import importlib.util
import json
import os

import ml_collections

from zebra_jax.config import base
from zebra_jax.errors import UserError

# The configs that ship with the package (zebra_jax/configs/), read as files
# like a user's own: NAME names SHIPPED_DIR/NAME.py.
SHIPPED_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# What a model section written before these fields existed means: the full
# head, dense stripes, the lax.scan recurrence. Not today's defaults, which
# may change: an old workdir must keep meaning what it was trained as.
_ABSENT_MODEL_FIELDS = dict(head="full", stripe_input="dense",
                            recurrence="scan")


def shipped_names() -> list[str]:
  """The names of the shipped configs: base, demo, lm1b, wlm, wt103."""
  return [name[:-3] for name in _config_files(SHIPPED_DIR)]


def resolve(path: str) -> str | None:
  """The file a --config names (the part before `:variant`), or None.

  A file on disk wins, so a config of one's own is never shadowed. Otherwise
  a shipped config's name: `demo`, `demo.py`, or any `.../configs/demo.py`,
  which is where the shipped configs lived in the source tree before they
  moved into the package (command lines written then keep working).
  """
  if os.path.isfile(path):
    return path
  folder, name = os.path.split(path)
  name = name.removesuffix(".py")
  if folder and os.path.basename(os.path.normpath(folder)) != "configs":
    return None
  if name in shipped_names():
    return os.path.join(SHIPPED_DIR, f"{name}.py")
  return None


def as_path(spec: str) -> str:
  """spec with a shipped config's name as its file (demo:tiny ->
  .../zebra_jax/configs/demo.py:tiny), for readers of config files by path
  (ml_collections' config flags); as given where nothing resolves."""
  path, colon, variant = spec.partition(":")
  found = resolve(path)
  return f"{found}{colon}{variant}" if found else spec


def load_file(spec: str) -> ml_collections.ConfigDict:
  """demo[:variant] or path/to/mine.py[:variant] -> its get_config(variant),
  or a UserError."""
  path, _, variant = spec.partition(":")
  found = resolve(path)
  if found is None:
    missing = (f"no shipped config {path!r}" if os.sep not in path and
               not path.endswith(".py") else f"no such file {path!r}")
    raise UserError(f"--config={spec}: {missing}; "
                    f"{_where_configs_are(path)}")
  try:
    module_spec = importlib.util.spec_from_file_location("_zebra_config",
                                                         found)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()
  except Exception as e:  # pylint: disable=broad-except
    message = " ".join(str(e).split()) or type(e).__name__
    raise UserError(f"--config={spec} does not load: {type(e).__name__}: "
                    f"{message}") from None


def _where_configs_are(path: str) -> str:
  shipped = (f"shipped configs: {', '.join(shipped_names())} "
             "(--config=NAME[:variant], e.g. --config=demo:tiny)")
  folder = os.path.dirname(path) or ("." if path.endswith(".py") else "")
  known = _config_files(folder) if folder else []
  if known:
    return f"configs in {folder}: {', '.join(known)}; {shipped}"
  return shipped


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
  """runs/demo for demo or demo.py, runs/wt103-tiny for wt103:tiny."""
  path, _, variant = spec.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}-{variant}" if variant else name)


def saved_path(workdir: str) -> str:
  return os.path.join(workdir, "config.json")


def read_saved(workdir: str, fix: str) -> dict:
  """A workdir's config.json as written; UserError (ending in `fix`) if damaged."""
  path = saved_path(workdir)
  try:
    with open(path) as f:
      saved = json.load(f)
  except FileNotFoundError:
    raise UserError(f"workdir {workdir} has no config.json: train first with "
                    f"--mode=train --config=FILE --workdir={workdir}, or pass "
                    "--config=FILE") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path} is damaged ({' '.join(str(e).split())}), e.g. cut "
                    f"short by a full disk: {fix}") from None
  except OSError as e:
    raise UserError(f"cannot read {path}: {e.strerror}: fix its "
                    "permissions") from None
  if not (isinstance(saved, dict) and isinstance(saved.get("model"), dict)):
    raise UserError(f"{path} is not a zebra_jax config (no model section): "
                    "restore it, or train into a new --workdir")
  return saved


def upgrade(saved: dict) -> ml_collections.ConfigDict:
  """A config.json of any version as today's config.

  Model fields it lacks take the meaning they had before they existed
  (_ABSENT_MODEL_FIELDS); any other field it lacks takes its default from
  config/base.py. JSON's lists are read back as the tuples configs hold.
  """
  saved = {**saved, "model": {**_ABSENT_MODEL_FIELDS, **saved["model"]}}
  return ml_collections.ConfigDict(_merge(base.get_config().to_dict(), saved))


def _merge(defaults: dict, saved: dict) -> dict:
  """saved over defaults, JSON's lists read back as tuples where defaults hold one."""
  merged = dict(defaults)
  for key, value in saved.items():
    if key in defaults and isinstance(defaults[key], dict) and isinstance(
        value, dict):
      value = _merge(defaults[key], value)
    elif key in defaults and isinstance(defaults[key], tuple) and isinstance(
        value, list):
      value = tuple(value)
    merged[key] = value
  return merged


def load_saved(workdir: str, fix: str = "restore it from a copy, or train "
               "into a new --workdir") -> ml_collections.ConfigDict:
  """A workdir's config.json, upgraded to today's fields."""
  return upgrade(read_saved(workdir, fix))
