"""Token sampling for a recurrent LM: filter logits, draw, loop in one jit.

The LM is recurrent, so generation never re-reads the prompt: the caller runs
the prompt once to get `(carry, last_logits)`, and `generate` then alternates
one sample and one `step_fn` call per new token inside a single `lax.scan`.
Each token costs one step, however long the text so far.

Nothing here knows the model: `step_fn(params, carry, tokens)` returns
`(logits, new_carry)`, with tokens int32 [batch], logits float [batch, vocab]
and carry any pytree (the LSTM (h, c) per layer, in zebra_jax).

Sampling options (temperature, top_k, top_p) are Python values, static under
jit: each combination compiles once, and unused filters cost nothing.
"""

import functools

import jax
import jax.numpy as jnp

from zebra_jax.errors import UserError


def check_options(*, temperature, top_k, top_p, num_new_tokens=None):
  """Raises `UserError` for an option no sampler can honour.

  Host-side and cheap, so entry points can call it before loading a checkpoint.

  Args:
    temperature: 0 for greedy decoding, else > 0.
    top_k: 0 keeps every token, else a positive whole number.
    top_p: in (0, 1]; 1.0 turns nucleus filtering off.
    num_new_tokens: when given, a whole number >= 1.
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
    best = jax.nn.one_hot(jnp.argmax(logits, -1), vocab, dtype=jnp.bool_)
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
  """Keeps the most likely tokens until their probability reaches top_p.

  Sorts the whole vocab per row, O(vocab log vocab): small next to an LM step.
  """
  sorted_logits = -jnp.sort(-logits, axis=-1)                   # [..., vocab]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # Mass strictly before each token: the token is needed while that is below
  # top_p. The first has 0 before it, so the argmax always survives.
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  num_kept = jnp.sum(mass_before < top_p, -1, keepdims=True)    # [..., 1]
  threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)
  return jnp.where(logits < threshold, -jnp.inf, logits)


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
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  filtered = filter_logits(
      logits, temperature=temperature, top_k=top_k, top_p=top_p)
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def generate(step_fn, params, carry, last_logits, key, *, num_new_tokens,
             temperature=1.0, top_k=0, top_p=1.0):
  """Samples `num_new_tokens` tokens per row, carrying the recurrent state.

  Token i is drawn with `fold_in(key, i)`, so a fixed key gives the same
  tokens whatever ran before. The whole loop is one jit, cached per
  (step_fn, num_new_tokens, temperature, top_k, top_p): pass the same step_fn
  object each call (not a fresh lambda or partial) to skip recompiling.

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

  Returns:
    (tokens int32 [batch, num_new_tokens], final_carry). step_fn runs once
    per token, the last one included, so final_carry has consumed every
    returned token: it is the state to continue from.
  """
  check_options(temperature=temperature, top_k=top_k, top_p=top_p,
                num_new_tokens=num_new_tokens)
  run = _jitted_generate(step_fn, int(num_new_tokens), float(temperature),
                         int(top_k), float(top_p))
  return run(params, carry, last_logits, key)


@functools.lru_cache(maxsize=32)
def _jitted_generate(step_fn, num_new_tokens, temperature, top_k, top_p):
  """One compile per static setting; statics bound with partial (STYLE.md)."""
  return jax.jit(functools.partial(
      _generate_loop, step_fn=step_fn, num_new_tokens=num_new_tokens,
      temperature=temperature, top_k=top_k, top_p=top_p))


def _generate_loop(params, carry, last_logits, key, *, step_fn,
                   num_new_tokens, temperature, top_k, top_p):
  options = dict(temperature=temperature, top_k=top_k, top_p=top_p)

  def step(state, i):
    carry, logits = state                                       # [batch, vocab]
    key_i = jax.random.fold_in(key, i)
    tokens = sample_next(key_i, logits, **options)              # [batch]
    new_logits, new_carry = step_fn(params, carry, tokens)
    # scan needs identical carry types; a step may return e.g. weak types.
    new_carry = jax.tree.map(
        lambda new, old: jnp.asarray(new).astype(jnp.result_type(old)),
        new_carry, carry)
    return (new_carry, new_logits.astype(jnp.float32)), tokens

  init = (carry, jnp.asarray(last_logits, jnp.float32))
  (final_carry, _), tokens = jax.lax.scan(
      step, init, jnp.arange(num_new_tokens))                   # [time, batch]
  return tokens.T, final_carry
