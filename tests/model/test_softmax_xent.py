"""The full head's cross-entropy (softmax_xent.cross_entropy) against
optax's, the path it replaces: the same loss and gradients bit for bit, on
its own and through the tied full-head model's train loss; and the train
step counts no accuracy while evaluation does."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from zebra_jax.config import base
from zebra_jax.model import lm, metrics, softmax_xent
from tests import references as ref


def _value_and_grad(loss, logits, targets, weights):
  f = lambda l: (weights * loss(l, targets)).sum()
  return jax.jit(jax.value_and_grad(f))(logits)


@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (3, 5, 1000),
                                   (700, 10_000)])
def test_loss_and_gradient_equal_optaxs_bitwise(shape):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 4)
  targets = jnp.asarray(rng.integers(0, shape[-1], shape[:-1]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.5, 2.0, shape[:-1]), jnp.float32)
  want = _value_and_grad(optax.softmax_cross_entropy_with_integer_labels,
                         logits, targets, weights)
  got = _value_and_grad(softmax_xent.cross_entropy, logits, targets, weights)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  np.testing.assert_array_equal(
      softmax_xent.cross_entropy(logits, targets),
      optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def test_extreme_rows_as_optax():
  """Large logits, -inf entries (a masked word) and a row all -inf but its
  target's: the same values, infinities and NaNs included."""
  logits = jnp.asarray([[1e4, -1e4, 0.0, 3.0],
                        [-np.inf, 2.0, -np.inf, 1.0],
                        [-np.inf, -np.inf, 5.0, -np.inf],
                        [80.0, 80.0, 80.0, 80.0]], jnp.float32)
  targets = jnp.asarray([1, 3, 2, 0], jnp.int32)
  weights = jnp.ones((4,), jnp.float32)
  want = _value_and_grad(optax.softmax_cross_entropy_with_integer_labels,
                         logits, targets, weights)
  got = _value_and_grad(softmax_xent.cross_entropy, logits, targets, weights)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _cfg() -> ml_collections.ConfigDict:
  c = base.get_config().model.to_dict()
  c.update(vocab_size=301, embed_size=16, hidden_size=16, num_layers=2,
           num_stripes=1, tie_embeddings=True, head="full", dtype="float32",
           recurrence="scan")
  return ml_collections.ConfigDict(c)


def test_tied_full_head_train_loss_and_gradients_equal_the_optax_path():
  """lm.token_sums as the train step calls it (dropout on, no accuracy)
  against the head's logits scored by optax: bitwise."""
  cfg = _cfg()
  graphdef, params = lm.create(cfg, seed=0)
  tokens = ref.random_tokens(cfg, 4, 13, 5)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  carry = lm.init_carry(cfg, 4)
  key = jax.random.key(7)

  def new(p):
    sums, _ = lm.token_sums(graphdef, p, inputs, targets, carry, key,
                            with_accuracy=False)
    assert "correct" not in sums
    return sums["loss_sum"]

  def old(p):
    logits, _ = lm.apply(graphdef, p, inputs, carry, key)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets).sum()

  want, want_grads = jax.jit(jax.value_and_grad(old))(params)
  got, got_grads = jax.jit(jax.value_and_grad(new))(params)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for w, g in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_accuracy_only_when_asked():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((3, 4, 9)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 9, (3, 4)), jnp.int32)
  with_acc = metrics.token_sums(logits, targets)
  without = metrics.token_sums(logits, targets, with_accuracy=False)
  assert set(with_acc) == {"loss_sum", "correct", "count"}
  assert set(without) == {"loss_sum", "count"}
  assert without["loss_sum"] == with_acc["loss_sum"]
