"""Config validation: every bad value becomes one line that says how to fix it."""

import ml_collections

from zebra_jax.errors import UserError
from zebra_jax.model.adaptive_softmax import cluster_bounds

_CHOICES = {
    "data.source": ("embedded", "wikitext", "text", "hf"),
    "data.tokenizer": ("char", "word", "bpe"),
    "data.batching": ("streams", "random"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.head": ("full", "adaptive"),
    "optim.name": ("adam", "adamw", "sgd", "lamb"),
}
_POSITIVE = ("data.batch_size", "data.seq_len", "data.bpe_vocab_size", "model.embed_size",
             "model.hidden_size", "model.num_layers", "model.num_stripes",
             "model.unroll", "model.adaptive_div_val",
             "model.adaptive_chunk_rows", "train.num_steps", "train.log_every",
             "train.eval_every", "eval.batch_size", "eval.seq_len",
             "checkpoint.every_steps", "checkpoint.keep_latest",
             "optim.learning_rate")
_NON_NEGATIVE = ("data.min_freq", "data.max_vocab_size", "model.vocab_size",
                 "optim.weight_decay", "optim.warmup_steps", "optim.clip_norm",
                 "optim.min_lr_ratio", "train.time_budget_minutes",
                 "train.eval_max_batches", "checkpoint.keep_best")
_RATES = ("model.dropout_embed", "model.dropout_hidden", "model.dropout_output")
_FRACTIONS = ("data.valid_fraction", "data.test_fraction")


def _get(cfg, dotted):
  node = cfg
  for part in dotted.split("."):
    if part not in node:
      raise UserError(f"config has no field {dotted}: start from configs/demo.py "
                      f"or configs/wt103.py, which define every field")
    node = node[part]
  return node


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Raises UserError for the first bad value found."""
  for name, choices in _CHOICES.items():
    if _get(cfg, name) not in choices:
      raise UserError(f"--config.{name}={_get(cfg, name)!r} is not one of "
                      f"{', '.join(choices)}: pick one of those")
  for name in _POSITIVE:
    if not _get(cfg, name) > 0:
      raise UserError(f"--config.{name}={_get(cfg, name)} must be positive: "
                      f"set it to a value above 0")
  for name in _NON_NEGATIVE:
    if _get(cfg, name) < 0:
      raise UserError(f"--config.{name}={_get(cfg, name)} is negative: set it "
                      f"to 0 or more")
  for name in _RATES:
    if not 0.0 <= _get(cfg, name) < 1.0:
      raise UserError(f"--config.{name}={_get(cfg, name)} is outside [0, 1): "
                      f"use a dropout rate such as 0.1 (0 = off)")
  for name in _FRACTIONS:
    if not 0.0 < _get(cfg, name) < 0.5:
      raise UserError(f"--config.{name}={_get(cfg, name)} is outside (0, 0.5): "
                      f"hold out a small share such as 0.05")
  m = cfg.model
  if m.hidden_size % m.num_stripes:
    raise UserError(
        f"model.hidden_size={m.hidden_size} is not divisible by "
        f"model.num_stripes={m.num_stripes}: pick num_stripes that divides "
        f"hidden_size (e.g. {_divisor_hint(m.hidden_size, m.num_stripes)})")
  if m.head == "adaptive":
    _check_cutoffs(m.adaptive_cutoffs)
  if cfg.data.source not in ("embedded", "hf") and not cfg.data.path:
    raise UserError(f"data.source={cfg.data.source!r} needs a path: set "
                    f"--config.data.path to the folder or file(s) to read")


def _check_cutoffs(cutoffs) -> None:
  """A sequence of increasing positive ints (those >= vocab are dropped later)."""
  if not isinstance(cutoffs, (list, tuple)) or not all(
      isinstance(c, int) and not isinstance(c, bool) for c in cutoffs):
    raise UserError(f"--config.model.adaptive_cutoffs={cutoffs!r} is not a "
                    "tuple of word ids: use e.g. '(20000, 40000, 200000)'")
  cluster_bounds(0, cutoffs)  # positive and strictly increasing


def _divisor_hint(hidden: int, stripes: int) -> int:
  divisors = [d for d in range(1, hidden + 1) if hidden % d == 0]
  return min(divisors, key=lambda d: abs(d - stripes))
