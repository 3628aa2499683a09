"""A config file for ml_collections' --config: a workdir's own config.json.

  --config=zebra_jax/cli/saved_config.py:WORKDIR

The command line passes this for every mode but train when --config is left
out, so --config.x=y overrides apply to the workdir's config. Fields a newer
version added (absent from an older config.json) come from configs/base.py
when the source tree is at hand.
"""

import json
import os

import ml_collections

# The source tree's configs/ (absent when the package is installed alone).
CONFIGS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), "configs")


def _base() -> dict:
  path = os.path.join(CONFIGS_DIR, "base.py")
  if not os.path.isfile(path):
    return {}
  import importlib.util
  spec = importlib.util.spec_from_file_location("zebra_configs_base", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config().to_dict()


def _merge(defaults: dict, saved: dict) -> dict:
  """saved over defaults, JSON's lists read back as the tuples configs hold."""
  merged = dict(defaults)
  for key, value in saved.items():
    old = defaults.get(key)
    if isinstance(old, dict) and isinstance(value, dict):
      value = _merge(old, value)
    elif isinstance(old, tuple) and isinstance(value, list):
      value = tuple(value)
    merged[key] = value
  return merged


def get_config(workdir: str) -> ml_collections.ConfigDict:
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  return ml_collections.ConfigDict(_merge(_base(), saved))
