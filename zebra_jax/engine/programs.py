"""The engine's compiled programs over one running batch: prefill (prompt
chunks into slots), decode (a block of tokens for every slot) and, with the
prefix cache, restore (cached prefix states into slots).

All are pure functions of the batch's device state, called with the same
shapes whatever the traffic. Prefill and decode also take static switches
(whether any row wants prompt log-probabilities; params.Features): the
scheduler jits one program per value, so math no row uses is not in it.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import params as params_lib
from . import sampler


class State(NamedTuple):
  """The running batch, all on the device; row r is slot r."""
  carry: Any          # the model state after every consumed token
  logits: jax.Array   # float32 [S, V]: the next token's logits
  seen: jax.Array     # bool [S, V]: tokens in prompt + output
  counts: jax.Array   # int32 [S, V]: each token's count in the output
  key: jax.Array      # uint32 [S, 2]: the row's PRNG key
  step: jax.Array     # int32 [S]: tokens the row has drawn
  row: dict           # the rows' parameters, packed (params.pack)


def initial_state(init_carry, slots: int, vocab_size: int) -> State:
  """Host arrays of an empty batch."""
  carry = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                       jax.eval_shape(lambda: init_carry(slots)))
  return State(carry=carry, logits=np.zeros((slots, vocab_size), np.float32),
               seen=np.zeros((slots, vocab_size), bool),
               counts=np.zeros((slots, vocab_size), np.int32),
               key=np.zeros((slots, 2), np.uint32),
               step=np.zeros(slots, np.int32),
               row=params_lib.pack(params_lib.neutral_rows(slots)))


def decode(params, state: State, active, *, step_fn, block,
           features: params_lib.Features):
  """`block` tokens for every slot, with the groups of per-row math in
  `features` (static: one program per set, the host picks it from the busy
  rows' parameters).

  Rows not decoding (free, or between two chunks of their prompt) keep their
  state; their tokens are computed with whatever parameters their slot holds
  and never read.

  Returns:
    (state, tokens int32 [S, block], (logprobs float32 [S, block], top ids
    int32 [S, block, K], top logprobs float32 [S, block, K]), or None
    without features.logprobs).
  """
  rows = jnp.arange(state.step.shape[0])
  row = params_lib.unpack(state.row)
  on = active[:, None]

  def one(state, _):
    logits = state.logits
    if features.edits:
      logits = sampler.penalize_rows(logits, state.seen, state.counts, row)
      logits = sampler.restrict_rows(logits, row, state.step)
    if features.sample:
      keys = jax.vmap(jax.random.fold_in)(state.key, state.step)
      tokens = sampler.draw_rows(keys, logits, row, features.filters)
    else:
      tokens = sampler.first_argmax(logits)
    logprobs = (sampler.logprob_rows(state.logits, tokens)
                if features.logprobs else None)
    new_logits, new_carry = step_fn(params, state.carry, tokens)
    # Only busy rows move: a row between two prefill chunks keeps its carry.
    new_carry = jax.tree.map(
        lambda n, o: jnp.where(on, n.astype(o.dtype), o), new_carry,
        state.carry)
    return state._replace(
        carry=new_carry,
        logits=jnp.where(on, new_logits.astype(jnp.float32), state.logits),
        seen=state.seen.at[rows, tokens].max(active),
        counts=state.counts.at[rows, tokens].add(active.astype(jnp.int32)),
        step=state.step + active), (tokens, logprobs)

  state, (tokens, logprobs) = jax.lax.scan(one, state, None, length=block)
  return state, tokens.T, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1),
                                       logprobs)


def prefill(params, state: State, tokens, lengths, slots, fresh, key, index,
            row, *, step_fn, init_carry, with_logprobs: bool):
  """Consumes up to C prompt tokens for each of P rows into their slots;
  with_logprobs (static: the host knows whether a row wants its prompt's)
  computes the tokens' log-probabilities and ranks.

  Args:
    tokens: int32 [P, C]; row i's first lengths[i] are consumed.
    lengths: int32 [P]; 0 for an unused row.
    slots: int32 [P]; the slot row i lives in; S (out of range) = unused.
    fresh: bool [P]; True: the row's first chunk (zero carry, nothing seen).
    key: uint32 [P, 2], the rows' seeds' keys; index: int32 [P], the row's
      sample index (its key is fold_in(key, index) unless index is 0).
    row: the rows' parameters, packed (params.pack), [P, ...].

  Returns:
    (state, (logprobs float32 [P, C], top ids int32 [P, C, K], top logprobs
    float32 [P, C, K], ranks int32 [P, C]) or None without with_logprobs,
    float32 [P, N]): each consumed token's log-probability and rank given
    what precedes it (a fresh row's first is meaningless); and the rows'
    state after the chunk, for the prefix cache, packed (pack_rows).
  """
  num_slots = state.step.shape[0]
  take = jnp.minimum(slots, num_slots - 1)
  fresh2 = fresh[:, None]
  carry = jax.tree.map(lambda z, c: jnp.where(fresh2, z, c[take]),
                       init_carry(tokens.shape[0]), state.carry)
  seen = jnp.where(fresh2, False, state.seen[take])
  counts = jnp.where(fresh2, 0, state.counts[take])
  logits = state.logits[take]
  rows = jnp.arange(tokens.shape[0])

  def one(c, t):
    carry, logits, seen = c
    valid = (t < lengths)[:, None]
    logprobs = (sampler.logprob_rows(logits, tokens[:, t])
                + (sampler.token_ranks(logits, tokens[:, t]),)
                if with_logprobs else None)
    new_logits, new_carry = step_fn(params, carry, tokens[:, t])
    carry = jax.tree.map(
        lambda n, o: jnp.where(valid, n.astype(o.dtype), o), new_carry,
        carry)
    logits = jnp.where(valid, new_logits.astype(jnp.float32), logits)
    seen = seen.at[rows, tokens[:, t]].max(valid[:, 0])
    return (carry, logits, seen), logprobs

  (carry, logits, seen), logprobs = jax.lax.scan(
      one, (carry, logits, seen), jnp.arange(tokens.shape[1]))
  state = _place(state, slots, carry, logits, seen, counts, key, index, row)
  return (state, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), logprobs),
          pack_rows(carry, logits))


def pack_rows(carry, logits):
  """Each row's carry leaves (flattened) then its logits, side by side in
  one float32 array [P, N]: the host fetches one array a call where a
  fetch per leaf cost ~27 us each. Exact for float32 carries (the model's)
  and narrower floats; the host casts each leaf back (unpack_row)."""
  leaves = [x.reshape(x.shape[0], -1).astype(jnp.float32)
            for x in jax.tree.leaves(carry)]
  return jnp.concatenate(leaves + [logits.astype(jnp.float32)], axis=1)


def unpack_row(packed, template) -> tuple[tuple, np.ndarray]:
  """(carry leaves, logits) of one row of pack_rows' array, each a copy of
  its own; `template`: a batch's carry (host arrays), for the leaves'
  shapes and dtypes."""
  leaves, at = [], 0
  for leaf in jax.tree.leaves(template):
    size = leaf[0].size
    leaves.append(packed[at:at + size].reshape(leaf.shape[1:]).astype(
        leaf.dtype))
    at += size
  return tuple(leaves), packed[at:].copy()


def restore(state: State, slots, carry, logits, seen, key, index, row):
  """Puts P rows resumed from the prefix cache into their slots: the carry
  and logits a prefill left at that boundary, the prefix's tokens `seen`
  (bool [P, V]), nothing drawn yet. Arguments as prefill's."""
  counts = jnp.zeros(seen.shape, jnp.int32)
  return _place(state, slots, carry, logits, seen, counts, key, index, row)


def _place(state: State, slots, carry, logits, seen, counts, key, index,
           row) -> State:
  """Writes P rows into their slots (S, out of range, writes nothing)."""
  key = jax.vmap(lambda k, j: jnp.where(j == 0, k, jax.random.fold_in(k, j)))(
      key, index)
  put = lambda dst, src: dst.at[slots].set(src, mode="drop")
  return State(
      carry=jax.tree.map(put, state.carry, carry),
      logits=put(state.logits, logits), seen=put(state.seen, seen),
      counts=put(state.counts, counts), key=put(state.key, key),
      step=put(state.step, jnp.zeros_like(slots)),
      row=jax.tree.map(put, state.row, row))
