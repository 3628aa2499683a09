"""Per-row sampling on the device: every row has its own parameters, as data.

A row's parameters (params.ROW_FIELDS) are arrays with one entry per row, so
one compiled program serves every mix of requests. Which groups of this
math a program contains is the caller's static choice (params.Features):
for a row that does not use a group, the group is the identity, bit for bit,
so a program without it gives that row the same tokens.
Orders as in vLLM and HF: logit bias and penalties on the raw logits, then
temperature, then top-k, top-p and min-p, then the draw.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .params import INT32_MAX, MAX_LOGPROBS


def first_argmax(x):
  """int32 [...]: the first index of the largest entry along the last axis
  (a max and a min; XLA's CPU argmax is several times slower)."""
  v = x.shape[-1]
  best = jnp.max(x, -1, keepdims=True)
  iota = jnp.arange(v, dtype=jnp.int32)
  return jnp.minimum(jnp.min(jnp.where(x == best, iota, v), -1), v - 1)


def _order_keys(logits):
  """float32 -> uint32 in the same order (negative floats reversed), so that
  bisection on the keys is bisection on the floats. Finite and infinite
  floats never map to 0 or 0xFFFFFFFF."""
  bits = jax.lax.bitcast_convert_type(logits, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _key_float(key):
  return jax.lax.bitcast_convert_type(
      jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key),
      jnp.float32)


def nucleus(logits, top_p):
  """Keeps the most likely tokens until their probability reaches top_p.

  The cut is the smallest logit value v whose strictly larger logits hold
  less than top_p of the probability; every logit >= v stays (ties with the
  last kept token too). v is found by bisection on the float's bits: 32
  passes over the vocabulary, each a masked sum, instead of sorting it: on a
  CPU, XLA's sort of a batch of rows costs several times the LM step it
  follows, the bisection a small part of it.

  Args:
    logits: float32 [..., V].
    top_p: a number, or an array broadcasting to [..., 1] (one per row).
  """
  probs = jax.nn.softmax(logits, axis=-1)
  keys = _order_keys(logits)

  def above(key):  # mass of the logits strictly above the float of key
    return jnp.sum(jnp.where(keys > key, probs, 0.0), -1, keepdims=True)

  # Invariant: mass above lo >= top_p > mass above hi.
  lo = jnp.min(keys, -1, keepdims=True) - 1
  hi = jnp.max(keys, -1, keepdims=True)

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    small = above(mid) < top_p
    return jnp.where(small, lo, mid), jnp.where(small, mid, hi)

  _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  return jnp.where(logits < _key_float(hi), -jnp.inf, logits)


def top_k_rows(logits, k):
  """Keeps each row's k largest logits (ties with the k-th too), k per row.

  The k-th largest value is found by bisection on the float's bits, so k is
  data: 32 masked counts over the vocabulary, no sort, no static k.

  Args:
    logits: float32 [rows, V].
    k: int32 [rows, 1]; rows with k <= 0 or k >= V are returned unchanged.
  """
  keys = _order_keys(logits)
  # Invariant: at least k keys are >= lo; fewer than k are > hi.
  lo = jnp.min(keys, -1, keepdims=True)
  hi = jnp.max(keys, -1, keepdims=True)
  kk = jnp.maximum(k, 1)

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo + 1) // 2               # upper middle: progress
    enough = jnp.sum(keys >= mid, -1, keepdims=True) >= kk
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  kept = jnp.where(logits < _key_float(lo), -jnp.inf, logits)
  on = (k > 0) & (k < logits.shape[-1])
  return jnp.where(on, kept, logits)


def min_p_rows(logits, min_p):
  """Drops tokens less likely than min_p times the most likely one:
  p < min_p * p_max is logit < max + log(min_p). min_p: float32 [rows, 1];
  0 keeps every token."""
  cut = jnp.max(logits, -1, keepdims=True) + jnp.log(min_p)
  return jnp.where((min_p > 0) & (logits < cut), -jnp.inf, logits)


def _when(pred, fn, x):
  """fn(x) where pred (a scalar) holds, else x, without computing fn."""
  return jax.lax.cond(pred, fn, lambda y: y, x)


def scale_rows(logits, row):
  """logits / temperature, per row; greedy rows (0) are left unscaled."""
  t = row["temperature"]
  return logits / jnp.where(t > 0, t, 1.0)[:, None]


def filter_rows(logits, row):
  """Per-row temperature, then top-k, top-p and min-p.

  Args:
    logits: float32 [rows, V].
    row: the batch's per-row parameters (params.ROW_FIELDS); rows with
      temperature 0 are left unscaled (greedy rows never read the result).
  Returns:
    float32 [rows, V] for `categorical`: kept entries `logits /
    temperature`, the rest -inf.
  """
  logits = scale_rows(logits, row)
  k = row["top_k"][:, None]
  logits = _when(jnp.any((k > 0) & (k < logits.shape[-1])),
                 lambda x: top_k_rows(x, k), logits)
  p = row["top_p"][:, None]
  m = row["min_p"][:, None]

  def nucleus_and_min_p(x):
    x = _when(jnp.any(p < 1), lambda y: jnp.where(p < 1, nucleus(y, p), y), x)
    return min_p_rows(x, m)

  # One test for both in the common case (neither used): a cond costs a
  # call on the CPU, at every token.
  return _when(jnp.any(p < 1) | jnp.any(m > 0), nucleus_and_min_p, logits)


def penalize_rows(logits, seen, counts, row):
  """Logit bias and the penalties, each row its own.

  repetition_penalty (CTRL's, as in HF): a token in the prompt or output has
  its logit divided by the penalty when positive, multiplied when negative.
  presence_penalty and frequency_penalty (OpenAI's): subtract the penalty
  once for a token in the output, and frequency x its count.

  Args:
    logits: float32 [rows, V], the model's.
    seen: bool [rows, V]: tokens in the prompt or the output.
    counts: int32 [rows, V]: each token's count in the output.
  """
  rep = row["repetition_penalty"][:, None]
  presence = row["presence_penalty"][:, None]
  frequency = row["frequency_penalty"][:, None]
  ids, values = row["bias_ids"], row["bias_values"]
  rows = jnp.arange(logits.shape[0])[:, None]

  scaled = jnp.where(logits > 0, logits / rep, logits * rep)
  x = jnp.where(seen & (rep != 1), scaled, logits)
  x = x - frequency * counts - presence * (counts > 0)
  return x.at[rows, ids].add(values, mode="drop")


def restrict_rows(logits, row, step):
  """allowed_token_ids and min_tokens, each row its own: a row draws only
  from its allowed tokens (all when it names none), and none of its stop
  tokens while it has drawn fewer than min_tokens.

  Args:
    logits: float32 [rows, V].
    step: int32 [rows]: the tokens each row has drawn.
  """
  rows = jnp.arange(logits.shape[0])[:, None]
  allowed, stops = row["allowed_ids"], row["stop_ids"]
  limited = allowed[:, :1] != INT32_MAX  # a row's list is not empty
  early = (step < row["min_tokens"])[:, None] & (stops[:, :1] != INT32_MAX)
  mark = lambda x, ids: jnp.zeros(x.shape, bool).at[rows, ids].set(
      True, mode="drop")  # the pad, INT32_MAX, is dropped

  x = jnp.where(mark(logits, allowed) | ~limited, logits, -jnp.inf)
  return jnp.where(mark(x, stops) & early, -jnp.inf, x)


def categorical(key, logits):
  """int32: `jax.random.categorical(key, logits)` for one row, the same token
  for the same key: the Gumbel-max draw jax makes (the first argmax of
  `gumbel(key, logits.shape) + logits`), with first_argmax for jnp.argmax,
  which is slower on the CPU."""
  return first_argmax(
      jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def draw_rows(keys, logits, row, filters: bool = True):
  """One token per row: greedy (first argmax) where temperature is 0, else a
  draw from the filtered distribution with the row's own key. filters=False
  leaves top-k, top-p and min-p out (no row uses them: for such a row they
  change nothing). A batch of greedy rows needs only first_argmax."""
  t = row["temperature"]
  scaled = (filter_rows(logits, row) if filters
            else scale_rows(logits, row))
  drawn = jax.vmap(categorical)(keys, scaled)
  return jnp.where(t == 0, first_argmax(logits), drawn)



def logprob_rows(logits, tokens):
  """The model's own log-probabilities (before penalties, temperature and
  filters, as --mode=score computes them) of `tokens` and of each row's
  MAX_LOGPROBS most likely tokens.

  Returns:
    (float32 [rows], int32 [rows, K], float32 [rows, K]), K = MAX_LOGPROBS.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0]
  top_lp, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
  return chosen, top_ids.astype(jnp.int32), top_lp


def token_ranks(logits, tokens):
  """int32 [rows]: each token's rank among its row's logits, 1 for the most
  likely (vLLM's `rank`)."""
  chosen = jnp.take_along_axis(logits, tokens[:, None], -1)
  return 1 + jnp.sum(logits > chosen, -1, dtype=jnp.int32)


def seed_key(seed: int) -> np.ndarray:
  """uint32 [2]: the raw PRNG key of a 64-bit seed. Equal to
  jax.random.PRNGKey(seed) for 0 <= seed < 2**32; larger and negative seeds
  keep their high word instead of losing it."""
  seed = int(seed)
  return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)
