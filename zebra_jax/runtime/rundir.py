"""A run directory's config.json: written by training, read by every mode.

`prepare` is the training entry (it validates the config, prepares data and
writes config.json); `load_config` reads a workdir's config back, the
architecture coming from the workdir and the settings inference applies
(config/mode_fields.py) from the caller's config.
"""

import os

import jax
import ml_collections

from zebra_jax.config import files, mode_fields
from zebra_jax.data import pipeline
from zebra_jax.errors import UserError
from zebra_jax import strict_json
from zebra_jax.runtime import config_checks, distributed

# Fields that change the parameters' shapes or meaning: a workdir is tied to
# them (the adaptive head's only when both models use that head).
_MODEL_FIELDS = [f.split(".")[1] for f in mode_fields.FIXED
                 if f.startswith("model.")]
_ARCHITECTURE = tuple(f for f in _MODEL_FIELDS if not f.startswith("adaptive"))
_ADAPTIVE = tuple(f for f in _MODEL_FIELDS if f.startswith("adaptive"))


def config_path(workdir: str) -> str:
  return files.saved_path(workdir)


def _check_same_architecture(saved: ml_collections.ConfigDict,
                             model: ml_collections.ConfigDict,
                             workdir: str) -> None:
  """saved: the workdir's (upgraded) config; model: the model section asked for."""
  saved = saved.model
  adaptive = model.head == "adaptive" == saved.head
  for field in _ARCHITECTURE + (_ADAPTIVE if adaptive else ()):
    old, new = saved[field], model[field]
    if not mode_fields.same(old, new):
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
  """The workdir's config.json with `cfg`'s settings for running the model.

  What the model is comes from the workdir (config.json of any version,
  upgraded); what inference applies (mode_fields.APPLIED_AT_INFERENCE: the
  eval, sample, serve and export sections, the compute dtype, the
  recurrence and the layout) comes from `cfg`, which holds the command
  line's overrides.
  """
  if not os.path.exists(config_path(workdir)):
    raise UserError(f"workdir {workdir} has no config.json: train first with "
                    f"--mode=train --workdir={workdir}")
  return mode_fields.run_settings_into(files.load_saved(workdir), cfg)
