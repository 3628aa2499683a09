"""A matmul in the compute dtype with float32 accumulation and a float32
result, whose gradient dots run in the compute dtype too.

Why not plain `einsum(..., preferred_element_type=float32)`: its float32
result gets a float32 cotangent, and JAX's transpose of that dot promotes
the other (bfloat16) operand to float32, so both gradient dots run in
float32. On the WikiText-103 recipe's step (bf16, on a GPU) the
shortlist's two gradient dots ran as TF32 cuBLAS kernels, a large share of
the step's time.
Here the cotangent is cast to the compute dtype first, as mixed-precision
training does elsewhere (PyTorch's autocast): the gradient dots read bf16
(or fp16) operands, accumulate in float32 and return float32, cast once to
each operand's own dtype (float32 for a parameter). In float32 it is the
plain einsum and its gradient, except that on a CPU a weight gradient
(its own, or a product of that form a caller asks for, as the adaptive
tails' backward does) runs in the form XLA hands to its matmul library
(`library_dots`: the same product, summed in another order).
"""

import functools

import jax
import jax.numpy as jnp

from zebra_jax.model import library_dots


def matmul(spec: str, x: jax.Array, w: jax.Array, dtype,
           low_result: bool = False) -> jax.Array:
  """einsum(spec, x, w) on operands cast to `dtype`, float32 result; its
  gradient dots take the cotangent in `dtype`.

  spec: "ab,cb->ac"-style, two operands, each index of an operand found in
  the other or in the result; x may lead with "..." (e.g. "...k,dk->...d").
  low_result: the result in `dtype`, rounded once from its float32
  accumulation: half the bytes written and read again where the result is
  large (the adaptive head's logits), at one rounding of each value.
  """
  if jnp.dtype(dtype) == jnp.float32 and jax.default_backend() != "cpu":
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                      preferred_element_type=jnp.float32)
  result = jnp.dtype(dtype) if low_result else jnp.dtype(jnp.float32)
  if not spec.startswith("..."):
    return _matmul(spec, jnp.dtype(dtype), result, x, w)
  # "...": its leading axes flattened into one row axis.
  flat = spec.replace("...", "z")  # z: a letter no spec here uses
  lead = x.shape[:-1]
  out = _matmul(flat, jnp.dtype(dtype), result, x.reshape(-1, x.shape[-1]),
                w)
  return out.reshape(lead + out.shape[1:])


def _transposed(spec: str) -> tuple[str, str]:
  """"A,B->C" -> (the spec of dx "C,B->A", of dw "A,C->B")."""
  inputs, result = spec.split("->")
  a, b = inputs.split(",")
  return f"{result},{b}->{a}", f"{a},{result}->{b}"


def _einsum(spec: str, x, w):
  """einsum(spec, x, w) into float32, through `library_dots.contract_rows`
  where x and w are [rows, a] and [rows, b] and the result (a weight's
  gradient) [a, b] or [b, a]."""
  inputs, out = spec.split("->")
  xs, ws = inputs.split(",")
  if len(xs) == len(ws) == len(out) == 2:
    if xs[0] == ws[0] and out == xs[1] + ws[1]:
      return library_dots.contract_rows(x, w)
    if xs[0] == ws[0] and out == ws[1] + xs[1]:
      return library_dots.contract_rows(w, x)
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _product(spec: str, x, w, result):
  """einsum(spec, x, w) accumulated in float32, returned in `result`: off a
  CPU as the dot's own output type (cuBLAS and XLA's Triton GEMMs round
  their float32 accumulators once, on writing), on a CPU rounded after."""
  if result != jnp.float32 and jax.default_backend() != "cpu":
    return jnp.einsum(spec, x, w, preferred_element_type=result)
  return _einsum(spec, x, w).astype(result)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul(spec, dtype, result, x, w):
  return _product(spec, x.astype(dtype), w.astype(dtype), result)


def _forward(spec, dtype, result, x, w):
  low_x, low_w = x.astype(dtype), w.astype(dtype)
  # Zero-size arrays carry the operands' own dtypes to the backward pass.
  kinds = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
  return _product(spec, low_x, low_w, result), (low_x, low_w, kinds)


def _backward(spec, dtype, result, residuals, g):
  del result  # the cotangent is cast to `dtype` whatever the result's
  low_x, low_w, (x_kind, w_kind) = residuals
  g = g.astype(dtype)
  dx_spec, dw_spec = _transposed(spec)
  dx = _einsum(dx_spec, g, low_w)
  dw = _einsum(dw_spec, low_x, g)
  return dx.astype(x_kind.dtype), dw.astype(w_kind.dtype)


_matmul.defvjp(_forward, _backward)
