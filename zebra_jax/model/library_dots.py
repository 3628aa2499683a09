"""The heads' weight gradients in the form XLA's CPU backend hands to its
matmul library.

Why: XLA's CPU backend gives a dot to its matmul library (YNNPACK) only
when the left operand contracts its last axis, and runs the rest as its
own (Eigen) dot. A weight gradient (xᵀ dy) contracts the rows, the first
axis of both operands: the tied 8,192-word head's embedding gradient
([2,048 x 8,192]ᵀ [2,048 x 512]) and the adaptive head's shortlist
gradient ([2,048 x 2,048]ᵀ [2,048 x 256]) both ran slower that way than
here, where they are on a par with torch's.

So on a CPU the smaller operand is transposed into a buffer of its own
first, behind an optimization barrier (XLA would fold the transpose back
into the dot), the dot runs in the library's form, and a result that
comes out transposed is transposed back (behind a barrier too).
Elsewhere (a GPU's cuBLAS takes either layout) it is the plain dot. The
layers' own weight gradients (lab.bench's core rows) were no faster this
way, and keep the plain dot.
"""

import jax
import jax.numpy as jnp


def _dot(a, b, contract, batch: int):
  axes = tuple(range(batch))
  return jax.lax.dot_general(a, b, (contract, (axes, axes)),
                             preferred_element_type=jnp.float32)


def _on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def contract_rows(a: jax.Array, b: jax.Array, batch: int = 0) -> jax.Array:
  """a [*B, n, p], b [*B, n, q] -> aᵀb [*B, p, q], float32.

  batch: how many leading axes (B) both operands share as a batch (0 or
  more); the rows axis n follows them. Operands keep their dtypes (cast
  them first for a mixed-precision product).
  """
  if a.ndim != batch + 2 or b.ndim != batch + 2:
    raise ValueError(f"contract_rows takes [*B, n, p] and [*B, n, q] with "
                     f"{batch} batch axes, not {a.shape} and {b.shape}")
  if not _on_cpu():
    return _dot(a, b, ((batch,), (batch,)), batch)
  barrier = jax.lax.optimization_barrier
  if a.size <= b.size:  # aᵀ [*B, p, n] @ b [*B, n, q]
    return _dot(barrier(jnp.swapaxes(a, -1, -2)), b,
                ((batch + 1,), (batch,)), batch)
  # (bᵀ [*B, q, n] @ a [*B, n, p])ᵀ
  out = _dot(barrier(jnp.swapaxes(b, -1, -2)), a, ((batch + 1,), (batch,)),
             batch)
  return jnp.swapaxes(barrier(out), -1, -2)
