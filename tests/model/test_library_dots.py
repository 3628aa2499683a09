"""library_dots.contract_rows: aᵀb over the rows against NumPy in
float64, and, on a CPU, in the form XLA hands to its matmul library (no
dot whose left operand contracts its rows axis)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model import library_dots

# (a's shape, b's shape, batch axes): a the smaller operand, b the smaller,
# and both with a batch axis.
CASES = [((64, 24), (64, 40), 0), ((64, 40), (64, 24), 0),
         ((3, 64, 24), (3, 64, 40), 1), ((3, 64, 40), (3, 64, 24), 1)]


def _operands(a_shape, b_shape, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=a_shape).astype(np.float32),
          rng.normal(size=b_shape).astype(np.float32))


@pytest.mark.parametrize("a_shape,b_shape,batch", CASES)
def test_matches_numpy(a_shape, b_shape, batch):
  a, b = _operands(a_shape, b_shape)
  got = jax.jit(library_dots.contract_rows,
                static_argnums=2)(a, b, batch)
  want = np.einsum("...np,...nq->...pq", a.astype(np.float64),
                   b.astype(np.float64))
  assert got.shape == want.shape and got.dtype == jnp.float32
  # 64 float32 products a sum: rounding near 1e-6 of terms of size ~1.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _row_dots(fn, a, b, batch) -> list[str]:
  """The compiled program's dots whose left operand contracts its rows
  axis (the first after the batch axes): the form XLA runs as its own
  dot."""
  text = jax.jit(fn).lower(a, b).compile().as_text()
  return [line for line in text.splitlines() if " dot(" in line
          and f"lhs_contracting_dims={{{batch}}}" in line]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU's form")
@pytest.mark.parametrize("a_shape,b_shape,batch", CASES)
def test_on_a_cpu_no_dot_contracts_the_left_operands_rows(a_shape, b_shape,
                                                          batch):
  a, b = _operands(a_shape, b_shape)
  assert _row_dots(lambda a, b: library_dots.contract_rows(a, b, batch),
                   a, b, batch) == []
  # The plain dot does: the check sees the form it guards against.
  plain = lambda a, b: jax.lax.dot_general(
      a, b, (((batch,), (batch,)), (tuple(range(batch)),) * 2))
  assert _row_dots(plain, a, b, batch)


def test_other_shapes_are_refused():
  with pytest.raises(ValueError, match="batch axes"):
    library_dots.contract_rows(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 5)))
