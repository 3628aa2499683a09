"""Softmax cross-entropy over integer labels with a hand-written gradient.

The same numbers as `optax.softmax_cross_entropy_with_integer_labels`, its
loss and its gradient bit for bit (tests/model/test_softmax_xent.py).
Differentiated by JAX, that loss's backward is a program for XLA to fuse:
exp(logits - max) kept from the forward pass, and -1 added at each target
through a scatter into a zero array the logits' size. Here it is one
elementwise pass by construction, whatever XLA makes of it: the backward
keeps only the logits (which the forward holds anyway) and each row's max
and sum of exponentials, and writes exp(logits - max) * (g / sum), minus
g at the target, the order of operations JAX's own derivative of
logsumexp uses, so nothing rounds differently. Never log-softmax and
softmax both as [rows, vocab] float32 arrays."""

import jax
import jax.numpy as jnp


def _shift_and_sum(logits):
  """(row max, finite or 0, as jax.nn.logsumexp takes it; sum of
  exp(logits - max)) per row."""
  top = jnp.max(logits, axis=-1)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  total = jnp.exp(logits - top[..., None]).sum(-1)
  return top, total


def _picked(logits, targets):
  """Each row's logit at its target."""
  return jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """-log softmax(logits)[target] per row: logits [..., V] float, targets
  [...] int -> [...] in the logits' dtype."""
  return _forward(logits, targets)[0]


def _forward(logits, targets):
  """(the loss as jax.nn.logsumexp and optax compute it, what the backward
  reads: the logits and each row's max and sum)."""
  top, total = _shift_and_sum(logits)
  loss = jnp.log(jnp.abs(total)) + top - _picked(logits, targets)
  return loss, (logits, targets, top, total)


def _backward(saved, g):
  logits, targets, top, total = saved
  grad = jnp.exp(logits - top[..., None]) * (g / total)[..., None]
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  at_target = index == targets[..., None]
  return jnp.where(at_target, grad - g[..., None], grad), None


cross_entropy.defvjp(_forward, _backward)
