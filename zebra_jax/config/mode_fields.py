"""Which config fields each --mode reads, and which a trained model fixes.

Training reads every field. Every other mode runs a trained workdir: its
config.json says what the model is, and the mode applies the fields it
reads from the config it was given (--config=FILE, else config.json) with
the --config.* overrides. For an override given on the command line:

  fixed   (FIXED: the parameters' shapes, the tokenizer and its vocabulary)
          a value other than the workdir's is refused: one error line;
  read    (READS[mode]) applied;
  other   a field the mode does not read: one warning line, then ignored.

Entries name a section ("eval") or one field ("eval.seq_len").
docs/configuration.md states the rule; a test holds the page to it.

In every mode, training included, a field whose meaning begins with
`FIELD=VALUE:` ("source=hf: ...", "head=adaptive: ...") is read only when
its section's FIELD has that VALUE: an override of it otherwise gets one
warning line (`unselected`).
"""

import re

from zebra_jax.config import base
from zebra_jax.errors import UserError

# What a trained model is: changing one would mean other parameters, or
# other token ids for the same text.
FIXED = ("model.vocab_size", "model.embed_size", "model.hidden_size",
         "model.num_layers", "model.num_stripes", "model.stripe_input",
         "model.tie_embeddings", "model.head", "model.adaptive_cutoffs",
         "model.adaptive_div_val", "model.adaptive_tie", "data.tokenizer",
         "data.bpe_vocab_size", "data.min_freq", "data.max_vocab_size")
# How a trained model runs: the compute dtype, the recurrence's code and the
# devices' layout; the same parameters give the same numbers up to rounding.
COMPUTE = ("model.dtype", "model.adaptive_chunk_rows", "model.recurrence",
           "model.cpu_bf16_head", "model.head_logits_dtype",
           "model.head_fused_xent", "model.adaptive_tile", "parallel")
# How a window of tokens runs through the layers at once (scoring, eval,
# export's prompt function); sampling's prompts and tokens go one step at a
# time, which neither the native loops' bf16 products nor unrolling touch.
WINDOWS = ("model.cpu_bf16_projections", "model.cpu_bf16_recurrence",
           "model.unroll")
# The tied head's fused loss, which only a loss over a window runs (eval;
# scoring sums log-probabilities instead).
LOSS = ("model.cpu_fused_head",)
# Which text --mode=eval scores (read with the trained tokenizer).
CORPUS = ("data.source", "data.path", "data.hf_name", "data.hf_config",
          "data.hf_cache_dir", "data.hf_text_column", "data.tfds_name",
          "data.tfds_data_dir", "data.tfds_train_split",
          "data.tfds_valid_split", "data.tfds_test_split", "data.tfds_text_key",
          "data.valid_fraction", "data.test_fraction")
# The serving engine's sizes, which --mode=sample shares with serve.
_ENGINE = ("serve.slots", "serve.queue", "serve.prefill_chunk",
           "serve.prefill_rows", "serve.small_batch_blocks",
           "serve.small_batch_rows", "serve.prefix_cache_bytes")

READS = {
    "train": ("",),  # every field
    "eval": (*COMPUTE, *WINDOWS, *LOSS, "eval", *CORPUS),
    "sample": (*COMPUTE, "sample", *_ENGINE),
    "score": (*COMPUTE, *WINDOWS, "eval.seq_len"),
    "serve": (*COMPUTE, *WINDOWS, "serve", "sample", "eval.seq_len"),  # /score
    # The artifact's config.json and manifest carry these for its servers.
    "export": (*COMPUTE, *WINDOWS, "export", "sample", "serve", "eval"),
    "plot": (),  # curves come from metrics.jsonl: no config at all
}
# What inference takes from the given config rather than the workdir's
# config.json (eval's corpus is chosen by evaluate.run itself).
APPLIED_AT_INFERENCE = (*COMPUTE, *WINDOWS, *LOSS, "eval", "sample", "serve",
                        "export")
_RULES = dict(base.fields())
_CONDITION = re.compile(r"(\w+)=([\w.-]+): ")


def run_settings_into(trained, given):
  """`trained` (a workdir's config) with APPLIED_AT_INFERENCE taken from
  `given`: the model stays the workdir's, how it runs is the caller's."""
  for entry in APPLIED_AT_INFERENCE:
    section, _, field = entry.partition(".")
    if field:
      trained[section][field] = given[section][field]
    else:
      trained[section] = given[section]
  return trained


def runs_trained_model(mode: str) -> bool:
  """A zebra-jax mode that runs a workdir's model (the lab's commands, which
  load configs the same way, keep every field they are given)."""
  return mode in READS and mode != "train"


def _covers(entries, dotted: str) -> bool:
  return any(e == "" or dotted == e or dotted.startswith(e + ".")
             for e in entries)


def is_fixed(dotted: str) -> bool:
  return _covers(FIXED, dotted)


def reads(mode: str, dotted: str) -> bool:
  """Whether --mode=mode uses the field `dotted` (e.g. "eval.seq_len")."""
  return _covers(READS[mode], dotted)


def verdict(mode: str, dotted: str) -> str:
  """"applied", "fixed" (refused when it differs from the workdir's) or
  "ignored" (warned about) for an override of `dotted` in `mode`."""
  if mode == "train" or reads(mode, dotted):
    return "applied"
  return "fixed" if is_fixed(dotted) else "ignored"


def _get(cfg, dotted: str):
  for part in dotted.split("."):
    cfg = cfg[part]
  return cfg


def same(a, b) -> bool:
  """Equal, reading JSON's lists as the tuples configs hold."""
  as_tuple = lambda x: tuple(x) if isinstance(x, (list, tuple)) else x
  return as_tuple(a) == as_tuple(b)


def check_overrides(mode: str, fields, cfg, saved, workdir: str) -> list[str]:
  """The warnings for `fields` (the dotted overrides given) in `mode`.

  cfg: the config with the overrides applied; saved: the workdir's
  config.json (None when there is none yet: the mode then fails on that).
  Raises UserError for a fixed field set to another value than the
  trained model's, or an applied one outside its rule (training checks
  the whole config itself).
  """
  warnings = []
  for dotted in dict.fromkeys(fields):
    kind = verdict(mode, dotted)
    if kind == "fixed" and saved is not None and not same(
        _get(cfg, dotted), _get(saved, dotted)):
      raise UserError(
          f"--config.{dotted}={_get(cfg, dotted)!r}: the model in {workdir} "
          f"was trained with {dotted}={_get(saved, dotted)!r}, which fixes "
          f"its parameters and token ids; --mode={mode} cannot change it: "
          f"drop the override, or train a new model into another --workdir")
    if kind == "applied" and mode != "train":
      problem = _RULES[dotted].rule.error(dotted, _get(cfg, dotted))
      if problem:
        raise UserError(problem)
    if kind == "ignored":
      warnings.append(
          f"--config.{dotted}: --mode={mode} does not read it (it reads "
          f"{described(mode)}): ignored")
  return warnings


def described(mode: str) -> str:
  """READS[mode] as a reader sees it: "parallel.*, eval.seq_len"."""
  if mode == "train":
    return "every field"
  return ", ".join(e if "." in e else f"{e}.*" for e in READS[mode]) or (
      "no config")


def unselected(fields, cfg) -> list[str]:
  """One warning for each override of a field that another field's value
  leaves unread (its meaning says `FIELD=VALUE:` and FIELD is not VALUE)."""
  warnings = []
  for dotted in dict.fromkeys(fields):
    field = _RULES.get(dotted)
    match = field and _CONDITION.match(field.doc)
    if not match:
      continue
    section = dotted.rpartition(".")[0]
    switch = f"{section}.{match.group(1)}" if section else match.group(1)
    if switch in _RULES and str(_get(cfg, switch)) != match.group(2):
      warnings.append(
          f"--config.{dotted}: read only with {switch}={match.group(2)}, and "
          f"this run has {switch}={_get(cfg, switch)!r}: ignored")
  return warnings
