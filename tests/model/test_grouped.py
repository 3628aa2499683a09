"""Grouped stripes (model.stripe_input="grouped") against independent references.

The reference is a float64 NumPy LSTM with per-step loops and PyTorch's
dense gate layout (tests/references.py), whose input and recurrent matrices are the block-diagonal
assembly of the stripes, with the stripe shuffle between layers written as
an explicit index permutation. Gradients are checked against central finite
differences of that model, the hand-written backward pass against JAX's
autodiff of the same scan, and the sharded train step against one device.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from zebra_jax.config import base
from zebra_jax.errors import UserError
from zebra_jax.model import lm
from zebra_jax.model.recurrence import scan as recurrence
from zebra_jax.runtime import config_checks
from tests import references as ref
from tests.helpers import (assert_trees_close, random_batches,
                           run_train_steps, tiny_sgd_config)


def _cfg(**overrides) -> ml_collections.ConfigDict:
  c = base.get_config().model.to_dict()  # every field, then this test's
  c.update(vocab_size=11, embed_size=8, hidden_size=8, num_layers=2,
           num_stripes=2, stripe_input="grouped", dropout_embed=0.0,
           dropout_hidden=0.0, dropout_output=0.0, tie_embeddings=False,
           dtype="float32", unroll=1, remat=False)
  c.update(overrides)
  return ml_collections.ConfigDict(c)


# ---------------------------------------------------------------- reference


def _block_diagonal_weights(layer, n_in):
  """A grouped model's layer -> dense (w_ih [4H, in], w_hh [4H, H], bias [4H]).

  Dense gate row k*H + s*G + j is stripe s, gate k, unit j. When in divides
  by S, w_x [S, in/S, 4G] fills only stripe s's rows in the input columns
  s*in/S .. (s+1)*in/S; otherwise w_x [in, S, 4G] fills every column.
  """
  w_x, w_h, b = layer["w_x"], layer["w_h"], layer["b"]
  s, g = w_h.shape[0], w_h.shape[1]
  hidden = s * g
  w_ih = np.zeros((4, s, g, n_in))
  w_hh = np.zeros((4, s, g, hidden))
  grouped = n_in % s == 0  # the rule: grouped whenever the input splits
  for stripe in range(s):
    for k in range(4):
      cols = slice(k * g, (k + 1) * g)
      if grouped:
        width = n_in // s
        w_ih[k, stripe, :, stripe * width:(stripe + 1) * width] = (
            w_x[stripe, :, cols].T)
      else:
        w_ih[k, stripe] = w_x[:, stripe, cols].T
      w_hh[k, stripe, :, stripe * g:(stripe + 1) * g] = w_h[stripe][:, cols].T
  bias = b.reshape(s, 4, g).transpose(1, 0, 2).reshape(4 * hidden)
  return w_ih.reshape(4 * hidden, n_in), w_hh.reshape(4 * hidden, hidden), bias


def _shuffle_index(hidden, stripes):
  """new[p] = old[index[p]]: unit g of stripe s moves to position g*S + s."""
  width = hidden // stripes
  index = np.zeros(hidden, np.int64)
  for s in range(stripes):
    for g in range(width):
      index[g * stripes + s] = s * width + g
  return index


def _numpy_lm(p, tokens, carry, stripes, shuffle=True):
  x = p["embed"][np.asarray(tokens)]
  new_carry = []
  for i in range(len(p["layers"])):
    if i > 0 and shuffle:
      x = x[..., _shuffle_index(x.shape[-1], stripes)]
    h0, c0 = (np.asarray(a, np.float64) for a in carry[i])
    x, hc = ref.dense_lstm(x, h0, c0, *_block_diagonal_weights(
        p["layers"][i], x.shape[-1]))
    new_carry.append(hc)
  return x @ p["head_w"] + p["head_b"], new_carry


def _numpy_loss(p, tokens, targets, carry, stripes):
  return ref.mean_cross_entropy(_numpy_lm(p, tokens, carry, stripes)[0],
                                targets)


# ------------------------------------------------------------- equivalences


def test_shuffle_is_the_permutation_and_mixes_every_stripe():
  x = jnp.arange(2 * 16, dtype=jnp.float32).reshape(2, 16)
  got = np.asarray(lm.stripe_shuffle(x, 4))
  np.testing.assert_array_equal(got, np.asarray(x)[:, _shuffle_index(16, 4)])
  # Each new stripe of 4 holds one unit of every old stripe.
  for s in range(4):
    assert sorted(got[0, s * 4:(s + 1) * 4] // 4) == [0, 1, 2, 3]
  np.testing.assert_array_equal(lm.stripe_shuffle(x, 1), x)


def test_grouped_layer_is_a_block_diagonal_dense_lstm():
  s, g, n_in, b, t = 4, 3, 8, 2, 5
  layer_def, state = nnx.split(lm.ZebraLSTMLayer(
      n_in, s * g, s, rngs=nnx.Rngs(0), grouped=True))
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.default_rng(1)
  state = jax.tree.unflatten(treedef, [
      jnp.asarray(rng.uniform(-0.6, 0.6, x.shape), jnp.float32)
      for x in leaves])
  p = ref.float64(state)
  assert p["w_x"].shape == (s, n_in // s, 4 * g)
  x = rng.normal(size=(b, t, n_in))
  h0, c0 = rng.uniform(-0.8, 0.8, (2, b, s * g))
  out, (h, c) = jax.jit(lambda st, x, hc: nnx.merge(layer_def, st)(x, hc))(
      state, jnp.asarray(x, jnp.float32),
      (jnp.asarray(h0, jnp.float32), jnp.asarray(c0, jnp.float32)))
  want, (h_ref, c_ref) = ref.dense_lstm(x, h0, c0,
                                     *_block_diagonal_weights(p, n_in))
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
  np.testing.assert_allclose(h, h_ref, atol=1e-5, rtol=0)
  np.testing.assert_allclose(c, c_ref, atol=1e-5, rtol=0)
  # Stripe 0 reads only inputs 0..1: input 2 never reaches its units.
  bumped, _ = jax.jit(lambda st, x, hc: nnx.merge(layer_def, st)(x, hc))(
      state, jnp.asarray(x, jnp.float32).at[:, :, 2].add(1.0),
      (jnp.asarray(h0, jnp.float32), jnp.asarray(c0, jnp.float32)))
  np.testing.assert_array_equal(bumped[..., :g], out[..., :g])
  assert np.abs(bumped[..., g:2 * g] - out[..., g:2 * g]).max() > 1e-3


@pytest.mark.parametrize("embed_size", [8, 6])  # grouped / dense first layer
def test_grouped_lm_is_block_diagonal_lstms_with_the_shuffle(embed_size):
  cfg = _cfg(num_stripes=4, embed_size=embed_size, hidden_size=16)
  graphdef, params = ref.random_model(cfg, seed=2)
  first = params["layers"][0]["w_x"][...].shape
  assert first == ((4, 2, 16) if embed_size == 8 else (6, 4, 16))
  assert params["layers"][1]["w_x"][...].shape == (4, 4, 16)
  tokens = ref.random_tokens(cfg, 3, 6, seed=3)
  carry = ref.random_carry(cfg, 3, seed=4)

  logits, new_carry = ref.apply(graphdef, params, tokens, carry)
  want, want_carry = _numpy_lm(ref.float64(params), tokens, carry, stripes=4)
  np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
  ref.assert_carry_close(new_carry, want_carry, atol=1e-5)
  # The shuffle is really there: without it the reference disagrees.
  unshuffled, _ = _numpy_lm(ref.float64(params), tokens, carry, 4,
                            shuffle=False)
  assert np.abs(unshuffled - want).max() > 1e-2


def test_one_grouped_stripe_is_the_dense_layer():
  """S = 1: the same init draws the same weights ([1, E, 4H] vs [E, 1, 4H])
  and the LM computes the same logits and gradients."""
  grouped_cfg = _cfg(num_stripes=1)
  dense_cfg = _cfg(num_stripes=1, stripe_input="dense")
  g_def, g_params = lm.create(grouped_cfg, seed=0)
  d_def, d_params = lm.create(dense_cfg, seed=0)
  for a, b in zip(jax.tree.leaves(g_params), jax.tree.leaves(d_params),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a).reshape(-1),
                                  np.asarray(b).reshape(-1))
  tokens = ref.random_tokens(grouped_cfg, 2, 5, 5)
  carry = ref.random_carry(grouped_cfg, 2, 6)
  targets = ref.random_tokens(grouped_cfg, 2, 5, 7)
  g_loss, g_grads = ref.loss_and_grad(g_def, g_params, tokens, targets, carry)
  d_loss, d_grads = ref.loss_and_grad(d_def, d_params, tokens, targets, carry)
  np.testing.assert_allclose(g_loss, d_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_grads), jax.tree.leaves(d_grads),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a).reshape(-1),
                               np.asarray(b).reshape(-1), atol=1e-6)


# ---------------------------------------------------------------- gradients


def test_grouped_gradients_match_float64_finite_differences():
  cfg = _cfg(num_stripes=2, vocab_size=7, embed_size=6, hidden_size=8)
  graphdef, params = ref.random_model(cfg, seed=8, scale=0.6)
  tokens = ref.random_tokens(cfg, 2, 5, seed=9)
  carry = ref.random_carry(cfg, 2, seed=10)
  targets = ref.random_tokens(cfg, 2, 5, seed=11)
  loss, grads = ref.loss_and_grad(graphdef, params, tokens, targets, carry)
  p = ref.float64(params)
  np.testing.assert_allclose(
      loss, _numpy_loss(p, tokens, targets, carry, 2), rtol=1e-6)

  got_leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(grads))
  p_leaves = jax.tree.leaves(p)
  eps, checked = 1e-5, 0
  for index, (leaf, got) in enumerate(zip(p_leaves, got_leaves, strict=True)):
    want = np.zeros(leaf.shape)
    for flat in range(leaf.size):
      def loss_at(delta):
        leaves = [x.copy() for x in p_leaves]
        leaves[index].reshape(-1)[flat] += delta
        return _numpy_loss(jax.tree.unflatten(treedef, leaves), tokens,
                           targets, carry, 2)
      want.reshape(-1)[flat] = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
      checked += 1
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-3)
  assert checked == lm.num_params(params)


def _layer_args(stripes, width, n_in, dtype=jnp.float32, batch=3, time=6):
  """(inputs [S, T, B, in/S], w_x [S, in/S, 4G], bias, h0, c0, w_h)."""
  k = jax.random.split(jax.random.key(12), 6)
  normal = lambda key, shape, scale: scale * jax.random.normal(key, shape)
  return (normal(k[0], (stripes, time, batch, n_in // stripes), 1.0
                 ).astype(dtype),
          normal(k[1], (stripes, n_in // stripes, 4 * width), 0.5
                 ).astype(dtype),
          normal(k[2], (stripes, 4 * width), 0.3),
          normal(k[3], (stripes, batch, width), 0.5),
          normal(k[4], (stripes, batch, width), 0.5),
          normal(k[5], (stripes, width, 4 * width), 0.4).astype(dtype))


def _vjp(fn, args, *static):
  """Outputs, and every input's gradient under random cotangents on every
  output; one compiled function."""
  @jax.jit
  def run(*args):
    out, pull = jax.vjp(lambda *a: fn(*a, *static), *args)
    keys = jax.random.split(jax.random.key(13), 3)
    return out, pull(tuple(jax.random.normal(k, o.shape).astype(o.dtype)
                           for k, o in zip(keys, out)))
  return run(*args)


@pytest.mark.parametrize("remat", [False, True])
def test_grouped_backward_matches_autodiff(remat):
  args = _layer_args(4, 3, 8)
  out, grads = _vjp(recurrence.zebra_layer, args, 1, remat)
  want_out, want_grads = _vjp(recurrence.zebra_layer_autodiff, args)
  for got, want in zip(out + grads, want_out + want_grads, strict=True):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  assert all(np.abs(np.asarray(g)).max() > 1e-2 for g in grads)


def test_grouped_backward_matches_autodiff_in_bfloat16():
  args = _layer_args(2, 8, 8, dtype=jnp.bfloat16)
  _, grads = _vjp(recurrence.zebra_layer, args)
  _, want = _vjp(recurrence.zebra_layer_autodiff, args)
  assert grads[0].dtype == grads[1].dtype == grads[5].dtype == jnp.bfloat16
  for got, ref in zip(grads, want, strict=True):
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(ref, np.float32),
                               atol=0.03 * scale, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_grouped_lm_in_low_precision_and_remat(dtype):
  """remat changes nothing in float32; bf16/f16 compute stays near it."""
  cfg = _cfg(num_stripes=4, embed_size=16, hidden_size=16)
  graphdef, params = ref.random_model(cfg, seed=14)
  tokens = ref.random_tokens(cfg, 2, 7, 15)
  carry = ref.random_carry(cfg, 2, 16)
  targets = jnp.roll(tokens, -1, axis=1)
  loss, grads = ref.loss_and_grad(graphdef, params, tokens, targets, carry)
  remat_def, _ = lm.abstract(_cfg(num_stripes=4, embed_size=16,
                                  hidden_size=16, remat=True))
  r_loss, r_grads = ref.loss_and_grad(remat_def, params, tokens, targets, carry)
  np.testing.assert_allclose(r_loss, loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               r_grads, grads)
  low_def, _ = lm.abstract(_cfg(num_stripes=4, embed_size=16, hidden_size=16,
                                dtype=dtype, remat=True))
  l_loss, l_grads = ref.loss_and_grad(low_def, params, tokens, targets, carry)
  np.testing.assert_allclose(l_loss, loss, rtol=2e-2)
  for a, b in zip(jax.tree.leaves(l_grads), jax.tree.leaves(grads),
                  strict=True):
    assert a.dtype == jnp.float32
    scale = float(np.abs(np.asarray(b)).max())
    np.testing.assert_allclose(a, b, atol=0.05 * scale, rtol=0)
  assert float(l_loss) != float(loss)  # really computed in low precision


# ---------------------------------------------------------- train step, config


def test_grouped_sharded_and_accumulated_steps_equal_single_device():
  cfg = tiny_sgd_config(head="full", stripe_input="grouped")
  batches = random_batches(cfg, 2)
  one, m1 = run_train_steps(cfg, 1, batches)
  many, m8 = run_train_steps(cfg, 8, batches)
  acc, m2 = run_train_steps(cfg, 2, batches, accum=4)
  assert one.params["layers"][1]["w_x"].shape == (4, 8, 32)  # grouped
  for other, metrics in ((many, m8), (acc, m2)):
    assert_trees_close(one.params, other.params, atol=1e-6)
    assert_trees_close(one.carry, other.carry, atol=1e-6)
    for a, b in zip(m1, metrics, strict=True):
      assert a["loss_sum"] == pytest.approx(b["loss_sum"], rel=1e-6)


def test_bad_stripe_input_is_one_config_error():
  from zebra_jax.configs import demo  # pylint: disable=g-import-not-at-top
  cfg = demo.get_config("tiny")
  assert cfg.model.stripe_input == "dense"
  cfg.model.stripe_input = "blocked"
  with pytest.raises(UserError, match="stripe_input='blocked' is not one of "
                     "dense, grouped"):
    config_checks.validate(cfg)
