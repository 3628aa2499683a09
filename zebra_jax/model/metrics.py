"""Jittable loss math. Steps return sums and counts; the host divides once.

Perplexity is exp(total loss / total tokens) over everything seen, never an
average of per-batch perplexities (which over-weights short batches).
"""

import math

import jax
import jax.numpy as jnp

from zebra_jax.model import softmax_xent


def argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, -1)` as int32: the first largest entry's index (the
  first NaN's, where there is one).

  On a CPU, a max (which XLA shares with the cross-entropy's) and a min over
  the indices that hold it. XLA's CPU backend runs jnp.argmax as one
  reduction over (value, index) pairs that it does not vectorise, slower
  than the whole cross-entropy beside it; a max and a min are vectorised
  reductions. The price is an int32 array of x's size, which XLA
  writes before the min: host memory, cheaper on a CPU than the time.
  Elsewhere jnp.argmax is one fused reduction, and runs as it is.
  """
  if jax.default_backend() != "cpu":
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  hit, index = _hits(x)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def _hits(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(where x is its row's max or NaN, each entry's index in its row): the
  first hit is what `argmax` returns."""
  top = jnp.max(x, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return (x == top) | jnp.isnan(x), index


def correct(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """`argmax(logits) == targets` (bool [...]), without the argmax on a CPU.

  `argmax` returns the first entry that is the row's max or NaN; that is
  the target exactly when the target's entry is one and no entry before it
  is: one fused pass that reduces to a bool per row, its max the one the
  cross-entropy beside it computes. In the LM train step XLA's plan then
  holds fewer temporaries (no int32 array of the logits' size), at no cost
  in time against `argmax`. Elsewhere argmax is one fused reduction.
  """
  if jax.default_backend() != "cpu":
    return argmax(logits) == targets
  hit, index = _hits(logits)
  before = jnp.any(hit & (index < targets[..., None]), axis=-1)
  at = jnp.take_along_axis(hit, targets[..., None], axis=-1)[..., 0]
  return at & ~before


def token_sums(logits: jax.Array, targets: jax.Array,
               with_accuracy: bool = True) -> dict[str, jax.Array]:
  """Summed cross-entropy, correct top-1 predictions and token count.

  Args:
    logits: [batch, time, vocab], any float dtype (cast to float32 here).
    targets: [batch, time] int32.
    with_accuracy: count "correct" (a pass over the logits that the loss
      does not need; training leaves it out).
  Returns:
    {"loss_sum", "count"[, "correct"]} float32 scalars.
  """
  logits = logits.astype(jnp.float32)
  losses = softmax_xent.cross_entropy(logits, targets)
  sums = {"loss_sum": losses.sum(),
          "count": jnp.asarray(targets.size, jnp.float32)}
  if with_accuracy:
    sums["correct"] = correct(logits, targets).astype(jnp.float32).sum()
  return sums


def summarize(loss_sum: float, correct: float | None,
              count: float) -> dict[str, float]:
  """Host-side: loss per token, perplexity and accuracy from the sums.

  correct=None (not counted: adaptive-head training) gives acc None, never a
  made-up number.
  """
  loss = loss_sum / max(count, 1.0)
  acc = None if correct is None else correct / max(count, 1.0)
  return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "acc": acc,
          "tokens": count}
