"""Config validation: every bad value becomes one line that says how to fix it."""

import math

import ml_collections

from zebra_jax.data import batching, sources, tokenizers
from zebra_jax.errors import UserError
from zebra_jax.model.adaptive_softmax import cluster_bounds

_CHOICES = {
    "data.source": tuple(sources.SOURCES),
    "data.tokenizer": tuple(tokenizers.TOKENIZERS),
    "data.batching": tuple(batching.BATCHERS),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.head": ("full", "adaptive"),
    "model.stripe_input": ("dense", "grouped"),
    "model.recurrence": ("scan", "pallas"),
    "optim.name": ("adam", "adamw", "sgd", "lamb"),
}
# Every numeric, boolean and text field, by what it may hold.
_RULES = {
    "positive int": (
        "data.batch_size", "data.seq_len", "data.bpe_vocab_size",
        "model.embed_size", "model.hidden_size", "model.num_layers",
        "model.num_stripes", "model.unroll", "model.adaptive_div_val",
        "model.adaptive_chunk_rows", "train.num_steps", "train.log_every",
        "train.eval_every", "train.grad_accum_steps",
        "train.max_consecutive_skips", "train.loss_scale.growth_interval",
        "eval.batch_size", "eval.seq_len", "checkpoint.every_steps",
        "checkpoint.keep_latest", "sample.max_new_tokens",
        "sample.num_samples", "sample.chunk", "serve.max_body_bytes",
        "serve.max_new_tokens", "serve.max_prompt_tokens", "serve.max_rows",
        "serve.max_score_tokens"),
    "non-negative int": (
        "data.min_freq", "data.max_vocab_size", "model.vocab_size",
        "optim.warmup_steps", "train.eval_max_batches", "checkpoint.keep_best",
        "profile.start_step", "profile.num_steps", "sample.top_k"),
    "int": ("seed", "sample.seed"),
    "positive number": (
        "optim.learning_rate", "optim.eps", "train.loss_scale.initial_scale",
        "train.loss_scale.min_scale", "sample.repetition_penalty"),
    "non-negative number": (
        "optim.weight_decay", "optim.clip_norm", "train.time_budget_minutes",
        "sample.temperature"),
    "rate": ("model.dropout_embed", "model.dropout_hidden",
             "model.dropout_output", "optim.momentum", "optim.b1", "optim.b2"),
    "ratio": ("optim.min_lr_ratio",),
    "shrink factor": ("train.loss_scale.backoff_factor",),
    "growth factor": ("train.loss_scale.growth_factor",),
    "fraction": ("data.valid_fraction", "data.test_fraction"),
    "probability mass": ("sample.top_p",),
    "bool": ("model.tie_embeddings", "model.adaptive_tie", "model.remat",
             "train.report_at_end", "train.sample_at_eval", "sample.stream"),
    "text": ("data.path", "data.hf_name", "data.hf_config",
             "data.hf_cache_dir", "sample.prompt", "sample.stop"),
}


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
  return (isinstance(v, (int, float)) and not isinstance(v, bool)
          and math.isfinite(v))


# kind -> (test, what the value must be, an example of a good one)
_KINDS = {
    "positive int": (lambda v: _is_int(v) and v > 0,
                     "must be a positive whole number", "1"),
    "non-negative int": (lambda v: _is_int(v) and v >= 0,
                         "must be a whole number >= 0", "0"),
    "int": (_is_int, "must be a whole number", "0"),
    "positive number": (lambda v: _is_number(v) and v > 0,
                        "must be positive", "1e-3"),
    "non-negative number": (lambda v: _is_number(v) and v >= 0,
                            "must be a number >= 0", "0"),
    "rate": (lambda v: _is_number(v) and 0 <= v < 1,
             "is outside [0, 1)", "0.1 (0 = off)"),
    "ratio": (lambda v: _is_number(v) and 0 <= v <= 1,
              "is outside [0, 1]", "0.1"),
    "shrink factor": (lambda v: _is_number(v) and 0 < v < 1,
                      "is outside (0, 1)", "0.5"),
    "growth factor": (lambda v: _is_number(v) and v > 1,
                      "must be above 1", "2.0"),
    "fraction": (lambda v: _is_number(v) and 0 < v < 0.5,
                 "is outside (0, 0.5)", "0.05 (hold out a small share)"),
    "probability mass": (lambda v: _is_number(v) and 0 < v <= 1,
                         "is outside (0, 1]", "0.95 (1 = off)"),
    "bool": (lambda v: isinstance(v, bool), "must be true or false", "true"),
    "text": (lambda v: isinstance(v, str), "must be text", "''"),
}


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
  for kind, names in _RULES.items():
    test, requirement, example = _KINDS[kind]
    for name in names:
      value = _get(cfg, name)
      if not test(value):
        raise UserError(f"--config.{name}={value!r} {requirement}: set it to "
                        f"e.g. {example}")
  m = cfg.model
  if m.hidden_size % m.num_stripes:
    raise UserError(
        f"model.hidden_size={m.hidden_size} is not divisible by "
        f"model.num_stripes={m.num_stripes}: pick num_stripes that divides "
        f"hidden_size (e.g. {_divisor_hint(m.hidden_size, m.num_stripes)})")
  if m.head == "adaptive":
    _check_cutoffs(m.adaptive_cutoffs)
  if sources.SOURCES[cfg.data.source].needs_path and not cfg.data.path:
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
