"""The tied full head's softmax cross-entropy on a CPU in one native call.

Why: XLA runs the tied head's loss as three matmuls (logits = h Eᵀ + b,
d_h = d_logits E, d_E = d_logitsᵀ h) around passes over the [rows, vocab]
float32 logits and their gradient, each written to memory and read back.
`recurrence/native_cc/fused_xent.h` computes the loss and all three
gradients by chunks of rows whose logits stay in a core's cache: the
matmuls' float32 products, the log-sum-exp, softmax - onehot and d_b, with
no [rows, vocab] array anywhere.

With `bf16`, the three products run on the CPU's bf16 units as
`cpu_bf16_head`'s do (operands rounded to bf16, float32 sums; the
softmax in float32): what model.cpu_bf16_head=auto asks for where both are
on and that head would run.

The loss it gives is a sum over rows, so its gradients are computed in the
forward call and the backward only scales them by the sum's cotangent (a
training step's 1 / tokens). Called without a gradient, the kernel computes
the losses alone (one matmul).

`model.cpu_fused_head`: "off" (default) keeps XLA's head
(`softmax_xent.cross_entropy` on the logits); "on" runs this call for the
training loss where the head is tied (embedding as the output matrix),
computes in float32, runs on a CPU and the native library loads; "auto"
only where its products run in bf16 as well (model.cpu_bf16_head=auto on a
CPU that has the units): with float32 products the call measured no faster
than XLA's head at the word_language_model shape (lab/results-log.md,
2026-11-28), with bf16 ones 1.86x. XLA's head elsewhere, and for every pass
that needs the logits themselves (accuracy, log-probabilities, sampling).
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.model.recurrence import native

SETTINGS = ("off", "auto", "on")
# Rows a chunk, a multiple of every build's register panel (32): float32's
# transposed logits [vocab, rows] (2.5 MB at 10,000 words) near a core's
# L2; bf16's products are quicker, so their passes over a chunk weigh more,
# and half as many rows (1.3 MB) keep those in cache (fused_head_bench,
# interleaved: 2.52x XLA's float32 head against 2.22x at 64 rows).
CHUNK_ROWS = 64
CHUNK_ROWS_BF16 = 32


def unavailable(dtype=jnp.float32) -> str:
  """Why the fused call cannot run a head computing in `dtype` here (""
  when it can)."""
  return native.unavailable(dtype)


def chosen(setting: str, dtype=jnp.float32, bf16: bool = False) -> bool:
  """Whether model.cpu_fused_head=setting runs the fused call here for a
  tied head whose products run in bf16 (`bf16`: cpu_bf16_head's choice for
  these rows) or float32."""
  if setting not in SETTINGS:
    raise ValueError(f"cpu_fused_head: {setting!r} is not one of {SETTINGS}")
  if setting == "off" or (setting == "auto" and not bf16):
    return False
  why = unavailable(dtype)
  if why and setting == "on":
    _say_unavailable(why)
  return not why


@functools.lru_cache(maxsize=None)
def _say_unavailable(why: str) -> None:
  """One line a reason: model.cpu_fused_head=on asked for what cannot run."""
  logging.warning("model.cpu_fused_head=on: XLA's head runs instead: %s", why)


def _call(hidden, embed, bias, targets, with_grads: bool, bf16=False,
          grad_scale=1.0):
  """The library's call: (losses [N], and d_h, d_embed, d_bias of their sum
  times grad_scale with_grads, else three empty arrays); bf16: the products
  in bf16."""
  n, h = hidden.shape
  v = embed.shape[0]
  f32 = jnp.float32
  if with_grads:
    grads = (jax.ShapeDtypeStruct((n, h), f32),
             jax.ShapeDtypeStruct((v, h), f32), jax.ShapeDtypeStruct((v,), f32))
  else:
    grads = (jax.ShapeDtypeStruct((0,), f32),) * 3
  products = 3 if with_grads else 1
  return jax.ffi.ffi_call(
      native.FUSED_XENT + native.target_suffix(),
      (jax.ShapeDtypeStruct((n,), f32),) + grads,
      vmap_method="sequential")(
          hidden.astype(f32), embed.astype(f32), bias.astype(f32),
          targets.astype(jnp.int32), with_grads=np.bool_(with_grads),
          bf16=np.bool_(bf16),
          chunk_rows=np.int64(CHUNK_ROWS_BF16 if bf16 else CHUNK_ROWS),
          threads=np.int64(native.threads(2 * n * v * h * products)),
          grad_scale=np.float32(grad_scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def loss_sum(hidden, embed, bias, targets, bf16=False, expected_cotangent=1.0):
  """Σ over rows of -log softmax(hidden embedᵀ + bias)[target]: hidden
  [N, H], embed [V, H], bias [V], targets [N] int -> a float32 scalar (a
  target outside [0, V) gives NaN). bf16: the products on the bf16 units
  (`cpu_bf16_head.chosen` first).

  expected_cotangent: the sum's cotangent the caller expects (a mean's
  1/N): the call computes the gradients times it, and the backward pass
  multiplies them by cotangent / expected_cotangent, which XLA folds to 1
  and drops when the two are the same constant: no pass over the [V, H]
  embedding gradient to scale it. Any other cotangent stays exact."""
  del expected_cotangent
  return _call(hidden, embed, bias, targets, False, bf16)[0].sum()


def _forward(hidden, embed, bias, targets, bf16, expected_cotangent):
  losses, d_h, d_e, d_b = _call(hidden, embed, bias, targets, True, bf16,
                                expected_cotangent)
  return losses.sum(), (d_h, d_e, d_b)


def _backward(bf16, expected_cotangent, grads, g):
  """The forward call's gradients (times expected_cotangent) times the
  sum's cotangent over it (float32: the call's inputs, as `chosen`
  requires)."""
  del bf16
  ratio = g / np.float32(expected_cotangent)
  return tuple(ratio * d for d in grads) + (None,)


loss_sum.defvjp(_forward, _backward)
