"""One request's sampling parameters: the one type every entry point fills.

`SamplingParams` is what /generate, /v1/completions, /v1/chat/completions,
--mode=sample, training's periodic sample and the Triton model hand the
engine. Each field is bounded here, once (`BOUNDS`): the HTTP layers, the
config's sample section (config/base.py reads `problem`) and the engine all
ask this module, so a value no request can honour is refused before it
reaches a compiled program, where an overflow or a NaN would poison a whole
batch. The field names are the ones OpenAI's and vLLM's APIs use, so a
request's field maps to a parameter by name.

A per-row knob is data to the compiled programs: `ROW_FIELDS` says how each
becomes its row's entry in the running batch, and what a row that is not
sampling holds (`neutral`). Adding a knob: a field and its bound here, its
math in sampler.py, its default in config/base.py. Its annotation picks how
it travels to the Triton model (wire.py).
"""

import dataclasses
import math
import secrets
from typing import NamedTuple

import numpy as np

MAX_LOGPROBS = 20          # alternatives per token (vLLM's default cap)
MAX_LOGIT_BIAS = 300       # entries in one logit_bias (OpenAI's cap)
MAX_STOPS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 1024
INT32_MAX = (1 << 31) - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one row is generated; check() says whether any request may ask it."""
  max_new_tokens: int = 16          # 0: the prompt only (echo scoring)
  temperature: float = 1.0          # 0 = greedy: the first argmax
  top_k: int = 0                    # keep the k most likely; 0 or -1 = off
  top_p: float = 1.0                # nucleus mass kept; 1 = off
  min_p: float = 0.0                # drop tokens below min_p x the top one
  repetition_penalty: float = 1.0   # CTRL's, over prompt and output; 1 = off
  presence_penalty: float = 0.0     # OpenAI's, over the output; 0 = off
  frequency_penalty: float = 0.0    # OpenAI's, per occurrence; 0 = off
  logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) pairs
  seed: int | None = None           # None: a fresh seed per request
  stop: tuple[str, ...] = ()        # cut before the first of these strings
  logprobs: int | None = None       # each new token's log-prob + top N
  prompt_logprobs: int | None = None  # the prompt's too (echo scoring)
  stop_token_ids: tuple[int, ...] = ()  # end at the first of these, not kept
  min_tokens: int = 0               # no stop (ids or strings) before these
  allowed_token_ids: tuple[int, ...] = ()  # draw only these; () = all

  def check(self, vocab_size: int | None = None) -> None:
    """ValueError (`.field` names the field) for the first value out of
    bounds; logit_bias's ids are checked against the vocabulary if known."""
    for f in dataclasses.fields(self):
      message = problem(f.name, getattr(self, f.name))
      if message:
        raise ParamError(f.name, message)
    if self.min_tokens > self.max_new_tokens:
      raise ParamError("min_tokens", f"{self.min_tokens} is more than the "
                       f"{self.max_new_tokens} tokens asked for at most")
    if vocab_size is not None:
      for name, ids in (
          ("logit_bias", [t for t, _ in self.logit_bias]),
          ("stop_token_ids", self.stop_token_ids),
          ("allowed_token_ids", self.allowed_token_ids)):
        for token in ids:
          if not 0 <= token < vocab_size:
            raise ParamError(name, f"token id {token} is outside the "
                             f"vocabulary [0, {vocab_size})")

  def with_seed(self) -> "SamplingParams":
    """The same parameters with a seed: the given one, or a fresh one."""
    if self.seed is not None:
      return self
    return dataclasses.replace(self, seed=secrets.randbits(63))


class ParamError(ValueError):
  """A parameter no request can honour; `field` names it."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field, self.reason = field, message


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v) -> bool:
  return (isinstance(v, (int, float, np.integer, np.floating))
          and not isinstance(v, bool) and math.isfinite(v))


def _int_in(low, high, example):
  def test(v):
    if not _is_int(v) or not low <= v <= high:
      return f"must be a whole number in [{low}, {high}], e.g. {example}"
    return None
  return test


def _number_in(low, high, example, low_open=False):
  def test(v):
    if not _is_number(v) or (v <= low if low_open else v < low) or v > high:
      lower = "(" if low_open else "["
      return f"must be a number in {lower}{low}, {high}], e.g. {example}"
    return None
  return test


def _optional(test):
  return lambda v: None if v is None else test(v)


def _stops(v):
  if (not isinstance(v, tuple) or len(v) > MAX_STOPS
      or not all(isinstance(s, str) and s for s in v)):
    return f"must be up to {MAX_STOPS} non-empty strings"
  return None


def _bias(v):
  if not isinstance(v, tuple) or len(v) > MAX_LOGIT_BIAS:
    return f"must map at most {MAX_LOGIT_BIAS} token ids to numbers"
  for pair in v:
    if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0])
            and 0 <= pair[0] <= INT32_MAX and _is_number(pair[1])
            and -100 <= pair[1] <= 100):
      return ("must map token ids to biases in [-100, 100], e.g. "
              "{\"50\": -100} bans token 50")
  return None


def _ids(limit):
  def test(v):
    if (not isinstance(v, tuple) or len(v) > limit
        or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in v)):
      return f"must be a list of at most {limit} token ids"
    return None
  return test


# Every field's bound, the one place it is stated.
BOUNDS = {
    "max_new_tokens": _int_in(0, INT32_MAX, 16),
    "temperature": _number_in(0, 100, "0.8 (0 = greedy)"),
    "top_k": _int_in(-1, INT32_MAX, "40 (0 or -1 = off)"),
    "top_p": _number_in(0, 1, "0.95 (1 = off)", low_open=True),
    "min_p": _number_in(0, 1, "0.05 (0 = off)"),
    "repetition_penalty": _number_in(0, 100, "1.2 (1 = off)", low_open=True),
    "presence_penalty": _number_in(-2, 2, "0.5 (0 = off)"),
    "frequency_penalty": _number_in(-2, 2, "0.5 (0 = off)"),
    "logit_bias": _bias,
    "seed": _optional(_int_in(-(1 << 63), (1 << 64) - 1, 1234)),
    "stop": _stops,
    "logprobs": _optional(_int_in(0, MAX_LOGPROBS, 1)),
    "prompt_logprobs": _optional(_int_in(0, MAX_LOGPROBS, 1)),
    "stop_token_ids": _ids(MAX_STOP_TOKEN_IDS),
    "min_tokens": _int_in(0, INT32_MAX, 4),
    "allowed_token_ids": _ids(MAX_ALLOWED_TOKEN_IDS),
}


def problem(name: str, value) -> str | None:
  """What is wrong with `value` for field `name`, or None."""
  return BOUNDS[name](value)


@dataclasses.dataclass(frozen=True)
class RowField:
  """How a parameter becomes its row's entry in the running batch."""
  dtype: type
  neutral: object          # what a row that is not sampling holds
  value: object = None     # params -> the row's value (default: the field)
  shape: tuple = ()


def _top_k(p):
  return min(p.top_k, INT32_MAX) if p.top_k > 0 else 0


def _padded(ids, width) -> np.ndarray:
  """A row's token ids as a fixed-width array, padded with INT32_MAX (which
  a scatter drops)."""
  out = np.full(width, INT32_MAX, np.int32)
  out[:len(ids)] = ids
  return out


def _bias_ids(p):
  return _padded([t for t, _ in p.logit_bias], MAX_LOGIT_BIAS)


def _bias_values(p):
  values = np.zeros(MAX_LOGIT_BIAS, np.float32)
  values[:len(p.logit_bias)] = [b for _, b in p.logit_bias]
  return values


ROW_FIELDS = {
    "temperature": RowField(np.float32, 0.0),
    "top_k": RowField(np.int32, 0, _top_k),
    "top_p": RowField(np.float32, 1.0),
    "min_p": RowField(np.float32, 0.0),
    "repetition_penalty": RowField(np.float32, 1.0),
    "presence_penalty": RowField(np.float32, 0.0),
    "frequency_penalty": RowField(np.float32, 0.0),
    "logprobs": RowField(np.int32, -1,
                         lambda p: -1 if p.logprobs is None else p.logprobs),
    "prompt_logprobs": RowField(
        np.int32, -1,
        lambda p: -1 if p.prompt_logprobs is None else p.prompt_logprobs),
    "bias_ids": RowField(np.int32, INT32_MAX, _bias_ids, (MAX_LOGIT_BIAS,)),
    "bias_values": RowField(np.float32, 0.0, _bias_values, (MAX_LOGIT_BIAS,)),
    "min_tokens": RowField(np.int32, 0),
    "stop_ids": RowField(
        np.int32, INT32_MAX,
        lambda p: _padded(p.stop_token_ids, MAX_STOP_TOKEN_IDS),
        (MAX_STOP_TOKEN_IDS,)),
    "allowed_ids": RowField(
        np.int32, INT32_MAX,
        lambda p: _padded(p.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS),
        (MAX_ALLOWED_TOKEN_IDS,)),
}


# On the device the per-row values travel packed, a few arrays instead of
# one per field: each array is a scatter in every prefill call and a select
# in every decode call.
_FLOATS = [n for n, f in ROW_FIELDS.items() if f.dtype == np.float32
           and not f.shape]
_INTS = [n for n, f in ROW_FIELDS.items() if f.dtype == np.int32
         and not f.shape]
_WIDE = [n for n, f in ROW_FIELDS.items() if f.shape]


def pack(rows: dict) -> dict:
  """Named per-row arrays (host) -> {"floats", "ints", and the wide ones}."""
  return {"floats": np.stack([rows[n] for n in _FLOATS], -1),
          "ints": np.stack([rows[n] for n in _INTS], -1),
          **{n: rows[n] for n in _WIDE}}


def unpack(packed: dict) -> dict:
  """The packed arrays (on the device) as named [rows] arrays."""
  named = {n: packed["floats"][:, i] for i, n in enumerate(_FLOATS)}
  named.update({n: packed["ints"][:, i] for i, n in enumerate(_INTS)})
  named.update({n: packed[n] for n in _WIDE})
  return named


def neutral_rows(count: int) -> dict:
  """Host arrays for `count` rows that sample nothing."""
  return {name: np.full((count,) + f.shape, f.neutral, f.dtype)
          for name, f in ROW_FIELDS.items()}


def packed_row(params: SamplingParams) -> dict:
  """One row's values, packed as pack() lays out a batch: computed once a
  request, written into each prefill call's arrays."""
  values = {name: (f.value(params) if f.value is not None
                   else getattr(params, name))
            for name, f in ROW_FIELDS.items()}
  return {"floats": np.array([values[n] for n in _FLOATS], np.float32),
          "ints": np.array([values[n] for n in _INTS], np.int32),
          **{n: values[n] for n in _WIDE}}


_NEUTRAL: dict[int, dict] = {}


def packed_batch(rows: list[dict], count: int) -> dict:
  """A batch of `count` rows' arrays: `rows` (packed_row's) first, rows
  that sample nothing after them."""
  if count not in _NEUTRAL:
    _NEUTRAL[count] = pack(neutral_rows(count))
  batch = {k: v.copy() for k, v in _NEUTRAL[count].items()}
  for i, row in enumerate(rows):
    for name, value in row.items():
      batch[name][i] = value
  return batch


class Features(NamedTuple):
  """Which groups of per-row math a decode program contains: a static tuple,
  so a group no busy row uses is not in the program at all (not a cond).
  `filters` implies `sample` (only drawn rows are filtered). The engine
  compiles two of the sets (DECODE_VARIANTS): each program is a compile at
  every start-up, so more of them would cost every server and test more
  than they save a step."""
  sample: bool = False     # temperature > 0: the Gumbel draw
  filters: bool = False    # top-k, top-p, min-p
  edits: bool = False      # penalties, logit_bias, allowed_token_ids,
                           # min_tokens with stop ids
  logprobs: bool = False   # each new token's log-probability and top N

  def __or__(self, other: "Features") -> "Features":
    return Features(*(a or b for a, b in zip(self, other)))

  def covers(self, other: "Features") -> bool:
    """Whether this variant computes every group `other` needs: for a row,
    a group it does not use is the identity, so a wider variant gives the
    same bits."""
    return all(a or not b for a, b in zip(self, other))


# Every decode program the engine may run, all compiled at start-up.
ALL_FEATURES = Features(True, True, True, True)
# The decode programs the engine compiles at start-up, smallest first: the
# plain one (greedy or drawn rows, no filter, edit or log-probability:
# what most traffic asks) and the one with every group.
DECODE_VARIANTS = (Features(sample=True), ALL_FEATURES)


def variant_for(needs: Features) -> Features:
  """The smallest compiled decode variant that covers `needs`."""
  return next(v for v in DECODE_VARIANTS if v.covers(needs))


def features(p: SamplingParams) -> Features:
  """The groups one request's decoding needs."""
  sample = p.temperature > 0
  return Features(
      sample=sample,
      filters=sample and (_top_k(p) > 0 or p.top_p < 1 or p.min_p > 0),
      edits=(p.repetition_penalty != 1 or p.presence_penalty != 0
             or p.frequency_penalty != 0
             or any(b != 0 for _, b in p.logit_bias)
             or bool(p.allowed_token_ids)
             or (p.min_tokens > 0 and bool(p.stop_token_ids))),
      logprobs=p.logprobs is not None)
