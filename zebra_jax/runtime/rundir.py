"""A run directory's config.json: written by training, read by every mode.

`prepare` is the training entry (it validates the config, prepares data and
writes config.json); `load_config` reads a workdir's config back, the
architecture coming from the workdir and the settings a user may change at
inference time from the caller's config.
"""

import os

import jax
import ml_collections

from zebra_jax.config import files
from zebra_jax.data import pipeline
from zebra_jax.errors import UserError
from zebra_jax import strict_json
from zebra_jax.runtime import config_checks, distributed

# Fields that change the parameters' shapes or meaning: a workdir is tied to them.
_ARCHITECTURE = ("embed_size", "hidden_size", "num_layers", "num_stripes",
                 "stripe_input", "tie_embeddings", "vocab_size", "head")
_ADAPTIVE = ("adaptive_cutoffs", "adaptive_div_val", "adaptive_tie")  # if used


def config_path(workdir: str) -> str:
  return files.saved_path(workdir)


def _same(a, b) -> bool:
  """Equal, reading JSON's lists as the tuples configs hold."""
  as_tuple = lambda x: tuple(x) if isinstance(x, (list, tuple)) else x
  return as_tuple(a) == as_tuple(b)


def _check_same_architecture(saved: ml_collections.ConfigDict,
                             model: ml_collections.ConfigDict,
                             workdir: str) -> None:
  """saved: the workdir's (upgraded) config; model: the model section asked for."""
  saved = saved.model
  adaptive = model.head == "adaptive" == saved.head
  for field in _ARCHITECTURE + (_ADAPTIVE if adaptive else ()):
    old, new = saved[field], model[field]
    if not _same(old, new):
      raise UserError(
          f"workdir {workdir} holds a model with model.{field}={old}, but the "
          f"config asks for {new}: use a new --workdir, or the same model "
          f"settings to resume")


def prepare(cfg: ml_collections.ConfigDict, workdir: str):
  """Validates, tokenizes (cached), writes config.json with the vocabulary size.

  Returns (vocab_size, tokenizer, splits); `cfg` itself is left as it was.
  """
  config_checks.validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  tokenizer, splits = distributed.process_zero_first(
      lambda: pipeline.prepare_data(cfg, workdir), "preparing the data")
  if cfg.model.vocab_size not in (0, tokenizer.vocab_size):
    raise UserError(
        f"--config.model.vocab_size={cfg.model.vocab_size} differs from the "
        f"tokenizer's {tokenizer.vocab_size}: leave it at 0 (take it from data)")
  record = cfg.to_dict()
  record["model"]["vocab_size"] = tokenizer.vocab_size
  if os.path.exists(config_path(workdir)):
    _check_same_architecture(
        files.load_saved(workdir, "delete it to resume with --config's "
                         "settings"),
        ml_collections.ConfigDict(record["model"]), workdir)
  if jax.process_index() == 0:
    _write_atomically(config_path(workdir), record)
  return tokenizer.vocab_size, tokenizer, splits


def _write_atomically(path: str, record: dict) -> None:
  """Writes a JSON file that readers see whole or not at all.

  Other processes of the run read config.json while process 0 rewrites it; a
  plain open("w") would let them read a truncated file.
  """
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    strict_json.dump(record, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def load_config(cfg: ml_collections.ConfigDict,
                workdir: str) -> ml_collections.ConfigDict:
  """The workdir's config.json with `cfg`'s eval, sample and compute settings.

  The architecture comes from the workdir (config.json of any version,
  upgraded); eval and sample settings, the compute dtype and the head's
  chunking (memory only) come from `cfg`, so they can be overridden on the
  command line.
  """
  if not os.path.exists(config_path(workdir)):
    raise UserError(f"workdir {workdir} has no config.json: train first with "
                    f"--mode=train --workdir={workdir}")
  merged = files.load_saved(workdir)
  merged.eval, merged.sample = cfg.eval, cfg.sample
  merged.serve = cfg.serve  # how to serve, not what the model is
  merged.parallel = cfg.parallel  # how to lay the model out: not its shape
  merged.model.dtype = cfg.model.dtype  # compute dtype may differ from training
  merged.model.adaptive_chunk_rows = cfg.model.adaptive_chunk_rows  # memory only
  return merged
