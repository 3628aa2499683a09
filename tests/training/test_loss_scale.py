"""loss_scale.all_finite: the guard every train step reads before it
applies an update, against NumPy's isfinite over every leaf."""

import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.training import loss_scale


def _tree(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return {"embed": jnp.asarray(rng.standard_normal((300, 20)), dtype),
          "bias": jnp.asarray(rng.standard_normal(7), dtype),
          "steps": jnp.arange(3), "empty": jnp.zeros((0, 4), dtype)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("leaf", ["embed", "bias"])
def test_all_finite_is_numpys(dtype, bad, leaf):
  tree = _tree(dtype)
  if bad is not None:
    tree[leaf] = tree[leaf].at[-1].set(bad)
  want = all(np.isfinite(np.asarray(x, np.float32)).all()
             for x in tree.values())
  assert bool(loss_scale.all_finite(tree)) == want == (bad is None)


def test_a_huge_finite_gradient_is_finite():
  tree = {"g": jnp.full((4,), np.finfo(np.float32).max, jnp.float32)}
  assert bool(loss_scale.all_finite(tree))
  assert bool(loss_scale.all_finite({}))
