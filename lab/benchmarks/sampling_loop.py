"""The model-level sampling loop: filter logits, draw, loop in one jit.

The generation benchmarks time this loop, and tests hold the serving
engine's greedy text against it (an independent path: the whole prompt in
one window, then one scan). Requests go through the engine
(zebra_jax.engine), where the options are per-row data.

The LM is recurrent, so generation never re-reads the prompt: the caller runs
the prompt once to get `(carry, last_logits)`, and `generate` then alternates
one sample and one `step_fn` call per new token inside a single `lax.scan`.
Each token costs one step, however long the text so far.

Nothing here knows the model: `step_fn(params, carry, tokens)` returns
`(logits, new_carry)`, with tokens int32 [batch], logits float [batch, vocab]
and carry any pytree (the LSTM (h, c) per layer, in zebra_jax).

Sampling options (temperature, top_k, top_p, repetition_penalty) are Python
values, static under jit: each combination compiles once, and unused filters
cost nothing.

Long or streamed generations run in chunks (`generate_chunk`): a `DecodeState`
(carry, next logits, seen tokens) passes from one jitted chunk to the next, and
token i is always drawn with `fold_in(key, i)`, so chunked and one-shot
generation give the same tokens.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.engine import sampler
from zebra_jax.model import lm, metrics


class DecodeState(NamedTuple):
  """What one generation chunk hands the next."""
  carry: Any              # the model state after every token so far
  logits: jax.Array       # float32 [batch, vocab]: the next token's logits
  seen: jax.Array         # bool [batch, vocab]: tokens in prompt + output


def check_options(*, temperature, top_k, top_p, num_new_tokens=None,
                  repetition_penalty=1.0):
  """Raises `UserError` for an option no sampler can honour.

  Host-side and cheap, so entry points can call it before loading a checkpoint.

  Args:
    temperature: 0 for greedy decoding, else > 0.
    top_k: 0 keeps every token, else a positive whole number.
    top_p: in (0, 1]; 1.0 turns nucleus filtering off.
    num_new_tokens: when given, a whole number >= 1.
    repetition_penalty: > 0; 1.0 turns it off.
  """
  # `not x >= 0` rather than `x < 0`, so that NaN is refused too.
  if not temperature >= 0:
    raise UserError(
        f"temperature={temperature} is negative: use 0 for greedy decoding "
        "or a positive value such as 0.8")
  if not (top_k >= 0 and float(top_k).is_integer()):
    raise UserError(
        f"top_k={top_k} is not a whole number >= 0: use 0 to keep every "
        "token or a positive count such as 40")
  if not 0 < top_p <= 1:
    raise UserError(
        f"top_p={top_p} is outside (0, 1]: use 1.0 to turn nucleus sampling "
        "off or a value such as 0.95")
  if not 0 < repetition_penalty < float("inf"):
    raise UserError(
        f"repetition_penalty={repetition_penalty} is not a positive number: "
        "use 1.0 to turn it off or a value such as 1.2")
  if num_new_tokens is not None and not (
      num_new_tokens >= 1 and float(num_new_tokens).is_integer()):
    raise UserError(
        f"num_new_tokens={num_new_tokens} is not a whole number >= 1: ask "
        "for at least one new token, e.g. 100")


def filter_logits(logits, *, temperature, top_k, top_p):
  """Scales by temperature; sets tokens outside top-k / the nucleus to -inf.

  The result feeds `jax.random.categorical`, which renormalises, so only which
  entries stay finite and their differences matter. top-k runs before top-p
  (as in HF transformers): the nucleus is taken from the renormalised top-k.

  Args:
    logits: float [..., vocab]; computed in float32 (bf16 cumsums drift).
    temperature: > 0 divides the logits; 0 keeps only the argmax (the limit).
    top_k: keep the k largest (ties with the k-th are kept too); 0 = off.
    top_p: keep the smallest set of most likely tokens whose probability
      reaches top_p, always at least the most likely one; 1.0 = off.

  Returns:
    float32 [..., vocab]: kept entries are `logits / temperature`, others -inf
    (with temperature 0: 0 at the first argmax, -inf elsewhere).
  """
  check_options(temperature=temperature, top_k=top_k, top_p=top_p)
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if temperature == 0:  # The T -> 0 limit: all mass on the (first) argmax.
    best = jax.nn.one_hot(metrics.argmax(logits), vocab, dtype=jnp.bool_)
    return jnp.where(best, 0.0, -jnp.inf)
  if temperature != 1:
    logits = logits / temperature
  if 0 < top_k < vocab:
    kth = jax.lax.top_k(logits, int(top_k))[0][..., -1:]        # [..., 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1:
    logits = _nucleus(logits, top_p)
  return logits


def _nucleus(logits, top_p):
  """Keeps the most likely tokens until their probability reaches top_p
  (ties with the last kept one too): the serving engine's bisection on the
  float's bits, no sort (engine/sampler.py's nucleus)."""
  return sampler.nucleus(logits, top_p)


def penalize_repeats(logits, seen, penalty):
  """CTRL's repetition penalty (Keskar et al. 2019, as in HF transformers).

  A token already in the text has its logit divided by `penalty` when
  positive and multiplied by it when negative: penalty > 1 always makes it
  less likely, whatever the logit's sign.

  Args:
    logits: float [batch, vocab].
    seen: bool [batch, vocab], True for tokens in the prompt or output.
    penalty: > 0; 1.0 returns the logits unchanged.
  """
  if penalty == 1:
    return logits
  logits = logits.astype(jnp.float32)
  scaled = jnp.where(logits > 0, logits / penalty, logits * penalty)
  return jnp.where(seen, scaled, logits)


def seen_tokens(prompts, vocab_size: int):
  """bool [batch, vocab] from a list of token-id sequences (host side)."""
  seen = np.zeros((len(prompts), vocab_size), bool)
  for row, ids in enumerate(prompts):
    seen[row, np.asarray(ids, np.int64)] = True
  return seen


def sample_next(key, logits, *, temperature, top_k, top_p):
  """Draws one token per row.

  Args:
    key: PRNG key; rows get independent draws from it.
    logits: float [batch, vocab].
    temperature: 0 is exact greedy decoding (argmax, key unused).
    top_k, top_p: as in `filter_logits`; ignored when greedy.

  Returns:
    int32 [batch].
  """
  check_options(temperature=temperature, top_k=top_k, top_p=top_p)
  if temperature == 0:
    return metrics.argmax(logits)
  filtered = filter_logits(
      logits, temperature=temperature, top_k=top_k, top_p=top_p)
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def generate(step_fn, params, carry, last_logits, key, *, num_new_tokens,
             temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
             seen=None):
  """Samples `num_new_tokens` tokens per row, carrying the recurrent state.

  Token i is drawn with `fold_in(key, i)`, so a fixed key gives the same
  tokens whatever ran before. The whole loop is one jit, cached per
  (step_fn, num_new_tokens, options): pass the same step_fn object each call
  (not a fresh lambda or partial) to skip recompiling.

  Args:
    step_fn: pure `(params, carry, tokens int32 [batch])` ->
      `(logits [batch, vocab], new_carry)`. new_carry must match carry's
      structure and shapes; its dtypes are cast back to carry's.
    params: passed through to step_fn.
    carry: pytree, the state after the prompt.
    last_logits: float [batch, vocab], the logits after the prompt.
    key: PRNG key.
    num_new_tokens: how many tokens to draw, >= 1.
    temperature, top_k, top_p: as in `sample_next`.
    repetition_penalty: as in `penalize_repeats`; 1.0 = off.
    seen: bool [batch, vocab], the prompt's tokens (for the penalty); None =
      none seen.

  Returns:
    (tokens int32 [batch, num_new_tokens], final_carry). step_fn runs once
    per token, the last one included, so final_carry has consumed every
    returned token: it is the state to continue from.
  """
  state = start_state(carry, last_logits, seen)
  tokens, state = generate_chunk(
      step_fn, params, state, key, 0, num_new_tokens=num_new_tokens,
      temperature=temperature, top_k=top_k, top_p=top_p,
      repetition_penalty=repetition_penalty)
  return tokens, state.carry


def start_state(carry, last_logits, seen=None) -> DecodeState:
  """The DecodeState right after the prompt."""
  last_logits = jnp.asarray(last_logits, jnp.float32)
  if seen is None:
    seen = jnp.zeros(last_logits.shape, jnp.bool_)
  return DecodeState(carry, last_logits, jnp.asarray(seen, jnp.bool_))


def generate_chunk(step_fn, params, state: DecodeState, key, start, *,
                   num_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                   repetition_penalty=1.0):
  """Draws tokens start .. start + num_new_tokens - 1 from `state`.

  Args:
    step_fn, params, key, options: as in `generate`.
    state: the DecodeState after the prompt or after the previous chunk.
    start: int, the index of the first token drawn here (for fold_in); a
      traced argument, so chunks at any offset share one compile.

  Returns:
    (tokens int32 [batch, num_new_tokens], the DecodeState to continue from).
  """
  check_options(temperature=temperature, top_k=top_k, top_p=top_p,
                num_new_tokens=num_new_tokens,
                repetition_penalty=repetition_penalty)
  run = _jitted_generate(step_fn, int(num_new_tokens), float(temperature),
                         int(top_k), float(top_p), float(repetition_penalty))
  return run(params, state, key, jnp.asarray(start, jnp.int32))


@functools.lru_cache(maxsize=32)
def _jitted_generate(step_fn, num_new_tokens, temperature, top_k, top_p,
                     repetition_penalty):
  """One compile per static setting; the statics bound with partial."""
  return jax.jit(functools.partial(
      _generate_loop, step_fn=step_fn, num_new_tokens=num_new_tokens,
      temperature=temperature, top_k=top_k, top_p=top_p,
      repetition_penalty=repetition_penalty))


def _generate_loop(params, state, key, start, *, step_fn, num_new_tokens,
                   temperature, top_k, top_p, repetition_penalty):
  options = dict(temperature=temperature, top_k=top_k, top_p=top_p)

  def step(state, i):
    carry, logits, seen = state                                 # [batch, vocab]
    key_i = jax.random.fold_in(key, start + i)
    logits = penalize_repeats(logits, seen, repetition_penalty)
    tokens = sample_next(key_i, logits, **options)              # [batch]
    if repetition_penalty != 1:
      seen = seen | jax.nn.one_hot(tokens, seen.shape[-1], dtype=jnp.bool_)
    new_logits, new_carry = step_fn(params, carry, tokens)
    # scan needs identical carry types; a step may return e.g. weak types.
    new_carry = jax.tree.map(
        lambda new, old: jnp.asarray(new).astype(jnp.result_type(old)),
        new_carry, carry)
    return DecodeState(new_carry, new_logits.astype(jnp.float32), seen), tokens

  state = DecodeState(state.carry, state.logits.astype(jnp.float32),
                      state.seen)
  state, tokens = jax.lax.scan(
      step, state, jnp.arange(num_new_tokens))                  # [time, batch]
  return tokens.T, state


def prime(generator, rows: list[np.ndarray],
          track_seen: bool = True) -> DecodeState:
  """Consumes every row's prompt as one window with a
  zebra_jax.inference.sample.Generator's model: the DecodeState to run
  `generate_chunk` from.

  Rows of equal length are consumed as one batch [n, T]; the results are
  put back in row order. One compile per distinct (n, T).
  """
  cfg = generator.loaded.cfg.model
  by_length: dict[int, list[int]] = {}
  for i, ids in enumerate(rows):
    by_length.setdefault(len(ids), []).append(i)
  order, parts = [], []
  for length, members in by_length.items():
    del length
    tokens = np.stack([rows[i] for i in members])            # [n, T]
    carry = lm.init_carry(cfg, len(members))
    parts.append(generator._consume(generator.params, tokens, carry))  # pylint: disable=protected-access
    order.extend(members)
  inverse = np.argsort(np.asarray(order))                    # row -> place
  join = lambda *xs: jnp.concatenate(xs, axis=0)[inverse]
  last_logits, carry = jax.tree.map(join, *parts)
  # The [rows, vocab] mask only matters to the repetition penalty.
  seen = (seen_tokens(rows, generator.tokenizer.vocab_size)
          if track_seen else None)
  return start_state(carry, last_logits, seen)
