"""A run directory's config.json: written by training, read by every mode.

`prepare` is the training entry (it validates the config, prepares data and
writes config.json); `load_config` reads a workdir's config back, the
architecture coming from the workdir and the settings a user may change at
inference time from the caller's config.
"""

import json
import os

import jax
import ml_collections

from zebra_jax.data import pipeline
from zebra_jax.errors import UserError
from zebra_jax.runtime import config_checks, distributed

# Fields that change the parameters' shapes or meaning: a workdir is tied to them.
_ARCHITECTURE = ("embed_size", "hidden_size", "num_layers", "num_stripes",
                 "stripe_input", "tie_embeddings", "vocab_size", "head")
_ADAPTIVE = ("adaptive_cutoffs", "adaptive_div_val", "adaptive_tie")  # if used
# What a config.json written before the adaptive head and grouped stripes
# means: the full head, dense stripes.
_LEGACY_MODEL = dict(head="full", stripe_input="dense")


def config_path(workdir: str) -> str:
  return os.path.join(workdir, "config.json")


def _with_legacy_fields(saved: dict) -> dict:
  """A saved config with the model fields older versions did not write."""
  return {**saved, "model": {**_LEGACY_MODEL, **saved["model"]}}


def _same(a, b) -> bool:
  """Equal, reading JSON's lists as the tuples configs hold."""
  as_tuple = lambda x: tuple(x) if isinstance(x, (list, tuple)) else x
  return as_tuple(a) == as_tuple(b)


def _check_same_architecture(saved: dict, cfg: ml_collections.ConfigDict,
                             workdir: str) -> None:
  saved = _with_legacy_fields(saved)["model"]
  wanted = _with_legacy_fields({"model": cfg.model.to_dict()})["model"]
  adaptive = wanted["head"] == "adaptive" == saved["head"]
  for field in _ARCHITECTURE + (_ADAPTIVE if adaptive else ()):
    old, new = saved.get(field), wanted[field]
    if not _same(old, new):
      raise UserError(
          f"workdir {workdir} holds a model with model.{field}={old}, but the "
          f"config asks for {new}: use a new --workdir, or the same model "
          f"settings to resume")


def prepare(cfg: ml_collections.ConfigDict, workdir: str):
  """Validates, tokenizes (cached), fixes vocab_size; returns (cfg, tok, splits)."""
  config_checks.validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  tokenizer, splits = distributed.process_zero_first(
      lambda: pipeline.prepare_data(cfg, workdir), "preparing the data")
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # an unlocked, resolved copy
  if cfg.model.vocab_size not in (0, tokenizer.vocab_size):
    raise UserError(
        f"--config.model.vocab_size={cfg.model.vocab_size} differs from the "
        f"tokenizer's {tokenizer.vocab_size}: leave it at 0 (take it from data)")
  cfg.model.vocab_size = tokenizer.vocab_size
  if os.path.exists(config_path(workdir)):
    with open(config_path(workdir)) as f:
      _check_same_architecture(json.load(f), cfg, workdir)
  if jax.process_index() == 0:
    _write_atomically(config_path(workdir), cfg.to_dict())
  return cfg, tokenizer, splits


def _write_atomically(path: str, record: dict) -> None:
  """Writes a JSON file that readers see whole or not at all.

  Other processes of the run read config.json while process 0 rewrites it; a
  plain open("w") would let them read a truncated file.
  """
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def load_config(cfg: ml_collections.ConfigDict,
                workdir: str) -> ml_collections.ConfigDict:
  """The workdir's config.json with `cfg`'s eval, sample and compute settings.

  The architecture comes from the workdir; eval and sample settings, the
  compute dtype and the head's chunking (memory only) come from `cfg`, so
  they can be overridden on the command line.
  """
  if not os.path.exists(config_path(workdir)):
    raise UserError(f"workdir {workdir} has no config.json: train first with "
                    f"--mode=train --workdir={workdir}")
  with open(config_path(workdir)) as f:
    saved = _with_legacy_fields(json.load(f))
  merged = ml_collections.ConfigDict(saved)
  merged.eval, merged.sample = cfg.eval, cfg.sample
  merged.model.dtype = cfg.model.dtype  # compute dtype may differ from training
  merged.model.adaptive_chunk_rows = cfg.model.adaptive_chunk_rows  # memory only
  return merged
