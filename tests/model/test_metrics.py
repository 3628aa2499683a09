"""Loss math against NumPy: the argmax (first largest, NaN first), the
correct predictions, the summed cross-entropy, the correct count and the
loss's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model import metrics


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (3, 4, 1000)])
def test_argmax_equals_numpys_on_random_rows(shape):
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  got = metrics.argmax(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_argmax_ties_nans_and_infinities_as_numpy():
  x = np.array([[1, 3, 3, 0],           # tie: the first
                [2, 2, 2, 2],
                [np.nan, 1, np.nan, 5],  # NaN counts as largest
                [0, 1, np.nan, 9],
                [-np.inf] * 4,
                [-np.inf, -1, np.inf, np.inf]], np.float32)
  np.testing.assert_array_equal(metrics.argmax(x), np.argmax(x, axis=-1))
  np.testing.assert_array_equal(metrics.argmax(x.astype(jnp.bfloat16)),
                                np.argmax(x, axis=-1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_correct_is_numpys_argmax_equal_to_the_target(dtype):
  """Every target of every row: ties, NaNs, infinities and random rows."""
  special = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [np.nan, 1, np.nan, 5],
                      [0, 1, np.nan, 9], [-np.inf] * 4,
                      [-np.inf, -1, np.inf, np.inf]], np.float32)
  rng = np.random.default_rng(2)
  rows = np.concatenate([special, rng.integers(0, 3, (20, 4)).astype(
      np.float32), rng.standard_normal((20, 4)).astype(np.float32)])
  want = np.argmax(rows, axis=-1)
  for target in range(4):
    targets = np.full(len(rows), target, np.int32)
    got = metrics.correct(jnp.asarray(rows, dtype), jnp.asarray(targets))
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, want == target)


def test_token_sums_against_numpy():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((4, 6, 37)).astype(np.float32) * 3
  targets = rng.integers(0, 37, (4, 6)).astype(np.int32)
  targets[::2] = logits[::2].argmax(-1)  # some rows right, some wrong
  got = metrics.token_sums(jnp.asarray(logits), jnp.asarray(targets))

  z = logits.astype(np.float64)
  log_p = z - z.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  want_loss = -np.take_along_axis(log_p, targets[..., None], -1).sum()
  want_correct = (logits.argmax(-1) == targets).sum()
  assert 12 <= want_correct < 24
  np.testing.assert_allclose(float(got["loss_sum"]), want_loss, rtol=2e-6)
  assert float(got["correct"]) == want_correct
  assert float(got["count"]) == targets.size

  grad = jax.grad(lambda l: metrics.token_sums(l, targets)["loss_sum"])(
      jnp.asarray(logits))
  want_grad = np.exp(log_p) - np.eye(37)[targets]
  np.testing.assert_allclose(np.asarray(grad), want_grad, atol=1e-6)
