"""Adaptive softmax: exact, normalised, equal to a full softmax without
cutoffs, finite gradients, a tiny model learns, tying shares parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zebra_jax.errors import UserError
from zebra_jax.model import adaptive_softmax as asm

V, D = 50, 16
CUTOFFS = (10, 20, 35)  # clusters: 10 shortlist + 3 tails of 10, 15, 15


def make(cutoffs=CUTOFFS, div_val=2, seed=0, **kw):
  return asm.AdaptiveSoftmax(V, D, cutoffs, div_val, rngs=nnx.Rngs(seed), **kw)


def randomize(module, seed=1):
  """Zero-initialised cluster logits and biases hide bugs: randomise all."""
  graphdef, state = nnx.split(module)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [jax.random.normal(k, x.shape, x.dtype) * 0.5
            for k, x in zip(keys, leaves)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def hidden(n=37, seed=2):
  return jax.random.normal(jax.random.key(seed), (n, D), jnp.float32)


def test_bounds_and_widths():
  assert asm.cluster_bounds(V, CUTOFFS) == ((0, 10), (10, 20), (20, 35),
                                            (35, 50))
  assert asm.cluster_bounds(V, (20000, 40000)) == ((0, V),)  # tiny vocab
  assert asm.cluster_widths(1024, 4, 4) == (1024, 256, 64, 16)
  with pytest.raises(UserError, match="strictly increasing"):
    asm.cluster_bounds(V, (20, 10))


@pytest.mark.parametrize("div_val", [1, 2])
def test_probabilities_sum_to_one_and_match_nll(div_val):
  head = randomize(make(div_val=div_val, chunk_rows=8))
  h = hidden()
  log_probs = head.log_probs(h)
  assert log_probs.shape == (37, V) and log_probs.dtype == jnp.float32
  np.testing.assert_allclose(jnp.exp(log_probs).sum(-1), 1.0, rtol=1e-5)
  # Every target, shortlist and tails, in chunks that are partly skipped.
  targets = jnp.arange(37) * 7 % V
  nll = head.nll(h, targets)
  expected = -jnp.take_along_axis(log_probs, targets[:, None], -1)[:, 0]
  np.testing.assert_allclose(nll, expected, rtol=1e-5, atol=1e-5)
  assert head.predict(h).tolist() == jnp.argmax(log_probs, -1).tolist()


def test_no_cutoffs_is_the_full_softmax():
  head = randomize(make(cutoffs=()))
  h = hidden()
  table, bias = head.weights.tables[0][...], head.biases[0][...]
  full = jax.nn.log_softmax(h @ table.T + bias, -1)
  np.testing.assert_allclose(head.log_probs(h), full, rtol=1e-5, atol=1e-6)
  targets = jnp.arange(37) % V
  np.testing.assert_allclose(
      head.nll(h, targets),
      optax.softmax_cross_entropy_with_integer_labels(h @ table.T + bias,
                                                      targets),
      rtol=1e-5, atol=1e-6)


def test_gradients_finite_and_match_dense_reference():
  head = randomize(make(chunk_rows=4))
  graphdef, params = nnx.split(head)
  h, targets = hidden(), jnp.arange(37) * 5 % V

  def loss(p, dense):
    m = nnx.merge(graphdef, p)
    if dense:
      lp = m.log_probs(h)
      return -jnp.take_along_axis(lp, targets[:, None], -1).sum()
    return m.nll(h, targets).sum()

  grads = jax.jit(jax.grad(loss), static_argnums=1)(params, False)
  reference = jax.grad(loss)(params, True)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_bfloat16_compute_keeps_float32_outputs():
  head = randomize(make(dtype=jnp.bfloat16))
  lp = head.log_probs(hidden())
  assert lp.dtype == jnp.float32
  np.testing.assert_allclose(jnp.exp(lp).sum(-1), 1.0, rtol=1e-4)
  assert all(x.dtype == jnp.float32
             for x in jax.tree.leaves(nnx.state(head, nnx.Param)))


def test_tied_input_shares_tables_and_projections():
  embed = asm.AdaptiveInput(V, D, CUTOFFS, 2, rngs=nnx.Rngs(0))
  head = asm.AdaptiveSoftmax(V, D, CUTOFFS, 2, rngs=nnx.Rngs(1),
                             tied_input=embed)

  class Pair(nnx.Module):
    def __init__(self):
      self.embed, self.head = embed, head

  _, state = nnx.split(Pair())
  untied = nnx.split(make())[1]
  count = lambda s: sum(x.size for x in jax.tree.leaves(s))
  assert count(state) == count(untied)  # the tables are stored once
  ids = jnp.array([[0, 9, 10, 25, 49]])
  e = embed(ids)
  assert e.shape == (1, 5, D) and e.dtype == jnp.float32
  # id 25 is in cluster 2 (width 4): its row, projected up to D.
  row = embed.tables[2][...][25 - 20] @ embed.proj(2).T
  np.testing.assert_allclose(e[0, 3], row, rtol=1e-5)
  with pytest.raises(UserError, match="same vocab_size and cutoffs"):
    asm.AdaptiveSoftmax(V, D, (10,), 2, rngs=nnx.Rngs(1), tied_input=embed)


def test_tiny_model_loss_falls():
  """Adaptive input -> tanh layer -> adaptive softmax learns a bigram map."""

  class Tiny(nnx.Module):
    def __init__(self):
      self.embed = asm.AdaptiveInput(V, D, CUTOFFS, 2, rngs=nnx.Rngs(0))
      self.head = asm.AdaptiveSoftmax(V, D, CUTOFFS, 2, rngs=nnx.Rngs(1),
                                      tied_input=self.embed, chunk_rows=16)
      self.w = nnx.Param(jnp.eye(D))

    def __call__(self, ids, targets):
      return self.head.nll(jnp.tanh(self.embed(ids) @ self.w[...]) * 3,
                           targets).mean()

  graphdef, params = nnx.split(Tiny())
  ids = jnp.arange(64) % V
  targets = (ids * 3 + 1) % V  # a fixed next word for every word
  tx = optax.adam(0.05)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt):
    loss, grads = jax.value_and_grad(
        lambda p: nnx.merge(graphdef, p)(ids, targets))(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  losses = []
  for _ in range(60):
    params, opt, loss = step(params, opt)
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0], losses[::10]
