"""The adaptive head's loss switches (model.head_logits_dtype,
head_fused_xent, adaptive_tile) against the default path: the same loss and
gradients to float32 rounding where the math is the same, bitwise where the
switch changes nothing, within bf16's stated rounding bound where the
logits are rounded."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from zebra_jax.config import base
from zebra_jax.model import adaptive_softmax as asm
from zebra_jax.model import lm
from tests import references as ref

V, D = 50, 16
CUTOFFS = (10, 20, 35)  # a shortlist of 10 words, tails of 10, 15 and 15

# (rows, chunk_rows): whole 8-row chunks; a 128-row chunk, then pieces of
# 64 and 32 rows on a CPU (PLATFORM_PIECE_ROWS) with 29 rows padded.
ROWS = [(37, 8), (221, 128)]
# Each switch alone and all of them together; tile 8 pads the head's 10
# words + 3 clusters to 16 logits and the 15-word tails to 16.
SWITCHES = [dict(fused_xent=True), dict(tile=8),
            dict(fused_xent=True, tile=8),
            dict(fused_xent=True, tile=8, logits_dtype="compute")]


def _loss_and_grads(n, chunk_rows, dtype=jnp.float32, **switches):
  """(mean nll, per-row nll, gradients of the parameters and the hidden
  states) of a randomised head, rows weighted unequally."""
  head = ref.randomize(asm.AdaptiveSoftmax(V, D, CUTOFFS, 2, rngs=nnx.Rngs(0),
                                       chunk_rows=chunk_rows, dtype=dtype,
                                       **switches))
  graphdef, params = nnx.split(head)
  hidden = 2 * jax.random.normal(jax.random.key(2), (n, D), jnp.float32)
  targets = jnp.arange(n) * 7 % V  # every cluster, shortlist and tails
  weights = jnp.linspace(0.5, 2.0, n)

  def loss(p, h):
    nll = nnx.merge(graphdef, p).nll(h, targets)
    return (weights * nll).sum() / weights.sum(), nll
  (mean, nll), grads = jax.jit(jax.value_and_grad(loss, (0, 1),
                                                  has_aux=True))(params,
                                                                 hidden)
  return mean, nll, jax.tree.leaves(grads), head, hidden


def _largest_product(head, hidden) -> float:
  """max |z . w| over every cluster's logits before its bias: what a
  logit's bf16 rounding is relative to."""
  largest = 0.0
  for i in range(len(head.bounds)):
    z = hidden if head.weights.proj(i) is None else (
        hidden @ head.weights.proj(i))
    largest = max(largest, float(jnp.abs(z @ head.weights.tables[i][...].T)
                                 .max()))
  z = hidden  # the head's cluster logits
  return max(largest, float(jnp.abs(z @ head.cluster_w[...].T).max()))


@pytest.mark.parametrize("n, chunk_rows", ROWS)
@pytest.mark.parametrize("switches", SWITCHES,
                         ids=lambda s: ",".join(f"{k}={v}"
                                                for k, v in s.items()))
def test_each_switch_in_float32_is_the_default_loss(n, chunk_rows, switches):
  """The same sums in another order (one log-sum-exp over the head's words
  and clusters, chunk by chunk): float32 rounding, measured 2e-6 on
  nll ~ 10 and 2e-7 of the largest gradient; logits_dtype=compute in
  float32 changes nothing."""
  mean, nll, grads, _, _ = _loss_and_grads(n, chunk_rows)
  got_mean, got_nll, got_grads, _, _ = _loss_and_grads(n, chunk_rows,
                                                       **switches)
  np.testing.assert_allclose(got_nll, nll, rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(got_mean, mean, rtol=1e-6)
  for got, want in zip(got_grads, grads):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("n, chunk_rows", ROWS)
def test_compute_logits_in_float32_change_nothing(n, chunk_rows):
  mean, nll, grads, _, _ = _loss_and_grads(n, chunk_rows)
  got_mean, got_nll, got_grads, _, _ = _loss_and_grads(
      n, chunk_rows, logits_dtype="compute")
  assert float(got_mean) == float(mean)
  np.testing.assert_array_equal(got_nll, nll)
  for got, want in zip(got_grads, grads):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n, chunk_rows", ROWS)
@pytest.mark.parametrize("fused_xent", [False, True])
def test_bfloat16_logits_stay_within_their_rounding(n, chunk_rows,
                                                    fused_xent):
  """bf16 compute, logits out of the matmul in bf16 against float32 ones.

  A logit's rounding moves it by at most 2**-9 of its product |z . w|, so a
  row's nll (log-sum-exp minus the target's logit) by at most 2**-8 of the
  largest product: the bound per row (measured: 0.065 against a bound of
  0.13). The mean of rounding errors of either sign moves far less: within
  2e-3 (measured 9e-4; bf16 compute itself moved this model's mean loss
  by 5e-3 from float32's). Gradients within 1% of each one's largest
  entry (measured 0.6%; bf16 compute itself: 0.9%).
  """
  mean, nll, grads, head, hidden = _loss_and_grads(n, chunk_rows,
                                                   jnp.bfloat16)
  got_mean, got_nll, got_grads, _, _ = _loss_and_grads(
      n, chunk_rows, jnp.bfloat16, logits_dtype="compute",
      fused_xent=fused_xent)
  bound = 2.0 ** -8 * _largest_product(head, hidden)
  assert float(jnp.abs(got_nll - nll).max()) <= bound
  assert abs(float(got_mean - mean)) <= 2e-3
  for got, want in zip(got_grads, grads):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max())
  assert float(jnp.abs(got_nll - nll).max()) > 0  # the rounding happened


def test_tile_pads_with_columns_no_softmax_reaches():
  table, bias = jnp.ones((13, 4)), jnp.zeros((13,))
  padded, padded_bias = asm.tiled(table, bias, 8)
  assert padded.shape == (16, 4) and padded_bias.shape == (16,)
  assert np.all(np.asarray(padded[13:]) == 0)
  assert np.all(np.isneginf(np.asarray(padded_bias[13:])))
  assert asm.tiled(table, bias, 0)[0] is table  # 0: as they are
  assert asm.tiled(table[:8], bias[:8], 8)[0].shape == (8, 4)  # a multiple


def _cfg(**switches) -> ml_collections.ConfigDict:
  c = base.get_config().model.to_dict()
  c.update(vocab_size=60, embed_size=16, hidden_size=16, num_layers=2,
           num_stripes=2, head="adaptive", adaptive_cutoffs=(10, 20, 40),
           adaptive_div_val=2, adaptive_tie=True, adaptive_chunk_rows=8,
           recurrence="scan", **switches)
  return ml_collections.ConfigDict(c)


def test_the_model_fields_reach_the_head():
  """Through lm.token_sums (tied input, dropout): the config's switches
  build the head they name, and its loss and gradients are the default's
  to float32 rounding."""
  switches = dict(head_fused_xent=True, adaptive_tile=8,
                  head_logits_dtype="compute")
  rng = np.random.default_rng(1)
  ids = jnp.asarray(rng.integers(0, 60, (4, 11)), jnp.int32)
  results = []
  for cfg in (_cfg(), _cfg(**switches)):
    graphdef, params = ref.random_model(cfg, seed=0)
    carry = lm.init_carry(cfg, 4)

    def loss(p, graphdef=graphdef, carry=carry):
      return lm.token_sums(graphdef, p, ids[:, :-1], ids[:, 1:], carry,
                           jax.random.key(0), with_accuracy=False)[0][
                               "loss_sum"]
    results.append(jax.jit(jax.value_and_grad(loss))(params))
  head = nnx.merge(graphdef, params).adaptive_softmax
  assert (head.fused_xent, head.tile, head.low_logits) == (True, 8, True)
  (loss, grads), (got_loss, got_grads) = results
  np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
