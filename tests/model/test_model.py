"""ZebraLSTM against independent references.

Every expected value comes from code written in the tests: a float64 NumPy
LSTM with per-step loops (dense gates i, f, g, o; tests/references.py),
PyTorch's nn.LSTM, and finite differences of that NumPy model. Striped
layers are checked against a dense LSTM whose recurrent matrix is the
block-diagonal assembly of the stripes.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from zebra_jax.config import base
from zebra_jax.model import lm
from tests import references as ref


def _cfg(**overrides) -> ml_collections.ConfigDict:
  c = base.get_config().model.to_dict()  # every field, then this test's
  c.update(vocab_size=11, embed_size=8, hidden_size=8, num_layers=2,
           num_stripes=1, dropout_embed=0.0, dropout_hidden=0.0,
           dropout_output=0.0, tie_embeddings=True, dtype="float32",
           unroll=1, remat=False)
  c.update(overrides)
  return ml_collections.ConfigDict(c)


# ---------------------------------------------------------------- references


def _dense_weights(layer):
  """Striped params -> dense (w_ih [4H, in], w_hh [4H, H], bias [4H]).

  Dense gate column k*H + s*G + j holds stripe s, gate k, unit j (striped
  column k*G + j); hidden unit s*G + r is stripe s, unit r. The recurrent
  matrix is block-diagonal: stripe s's h only feeds stripe s's gates.
  """
  w_x, w_h, b = layer["w_x"], layer["w_h"], layer["b"]
  n_in, s, four_g = w_x.shape
  g = four_g // 4
  hidden = s * g
  w_x_dense = w_x.reshape(n_in, s, 4, g).transpose(0, 2, 1, 3).reshape(
      n_in, 4 * hidden)
  b_dense = b.reshape(s, 4, g).transpose(1, 0, 2).reshape(4 * hidden)
  w_h_dense = np.zeros((hidden, 4, s, g))
  for k in range(s):
    w_h_dense[k * g:(k + 1) * g, :, k, :] = w_h[k].reshape(g, 4, g)
  w_h_dense = w_h_dense.reshape(hidden, 4 * hidden)
  return w_x_dense.T, w_h_dense.T, b_dense


def _numpy_lm(p, tokens, carry):
  """The whole LM in float64 NumPy: embed -> dense LSTMs -> head."""
  x = p["embed"][np.asarray(tokens)]
  new_carry = []
  for i in range(len(p["layers"])):
    h0, c0 = (np.asarray(a, np.float64) for a in carry[i])
    x, hc = ref.dense_lstm(x, h0, c0, *_dense_weights(p["layers"][i]))
    new_carry.append(hc)
  w = p["head_w"] if "head_w" in p else p["embed"].T
  return x @ w + p["head_b"], new_carry


def _numpy_loss(p, tokens, targets, carry):
  return ref.mean_cross_entropy(_numpy_lm(p, tokens, carry)[0], targets)


# ------------------------------------------------------------- equivalences


@pytest.mark.parametrize("tied", [True, False])
def test_one_stripe_is_classic_lstm(tied):
  cfg = _cfg(num_stripes=1, num_layers=2, embed_size=8 if tied else 6,
             hidden_size=8, tie_embeddings=tied)
  graphdef, params = ref.random_model(cfg, seed=1)
  assert ("head_w" in params) == (not tied)
  tokens = ref.random_tokens(cfg, 3, 7, seed=2)
  carry = ref.random_carry(cfg, 3, seed=3)

  logits, new_carry = ref.apply(graphdef, params, tokens, carry)
  want_logits, want_carry = _numpy_lm(ref.float64(params), tokens, carry)

  assert logits.shape == (3, 7, cfg.vocab_size) and logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
  ref.assert_carry_close(new_carry, want_carry, atol=1e-5)


def test_one_stripe_matches_torch_lstm():
  torch = pytest.importorskip(
      "torch", reason="the PyTorch reference needs torch: pip install torch")
  cfg = _cfg(num_stripes=1, num_layers=2, embed_size=6, hidden_size=8,
             tie_embeddings=False)
  graphdef, params = ref.random_model(cfg, seed=4)
  p = ref.float64(params)
  tokens = ref.random_tokens(cfg, 3, 7, seed=5)
  carry = ref.random_carry(cfg, 3, seed=6)

  lstm = torch.nn.LSTM(input_size=6, hidden_size=8, num_layers=2,
                       batch_first=True).double()
  with torch.no_grad():
    for k, layer in p["layers"].items():
      getattr(lstm, f"weight_ih_l{k}").copy_(
          torch.from_numpy(layer["w_x"][:, 0, :].T.copy()))
      getattr(lstm, f"weight_hh_l{k}").copy_(
          torch.from_numpy(layer["w_h"][0].T.copy()))
      getattr(lstm, f"bias_ih_l{k}").copy_(torch.from_numpy(layer["b"][0]))
      getattr(lstm, f"bias_hh_l{k}").zero_()
    x = torch.from_numpy(p["embed"][np.asarray(tokens)])
    h0 = torch.from_numpy(np.stack([np.asarray(h) for h, _ in carry]))
    c0 = torch.from_numpy(np.stack([np.asarray(c) for _, c in carry]))
    out, (h_n, c_n) = lstm(x.double(), (h0.double(), c0.double()))
  want_logits = out.numpy() @ p["head_w"] + p["head_b"]

  logits, new_carry = ref.apply(graphdef, params, tokens, carry)
  np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
  ref.assert_carry_close(new_carry, [(h_n[k].numpy(), c_n[k].numpy())
                                  for k in range(2)], atol=1e-5)


def test_stripes_are_block_diagonal_dense_lstm():
  cfg = _cfg(num_stripes=4, num_layers=2, embed_size=10, hidden_size=16,
             tie_embeddings=False)
  graphdef, params = ref.random_model(cfg, seed=7)
  assert params["layers"][1]["w_x"][...].shape == (16, 4, 16)
  assert params["layers"][1]["w_h"][...].shape == (4, 4, 16)
  tokens = ref.random_tokens(cfg, 2, 6, seed=8)
  carry = ref.random_carry(cfg, 2, seed=9)

  logits, new_carry = ref.apply(graphdef, params, tokens, carry)
  want_logits, want_carry = _numpy_lm(ref.float64(params), tokens, carry)

  np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
  ref.assert_carry_close(new_carry, want_carry, atol=1e-5)


def test_stripes_evolve_independently():
  """Stripe 0's initial state never reaches stripe 1 inside a layer."""
  s, g, n_in = 4, 4, 16
  layer_def, layer_state = nnx.split(
      lm.ZebraLSTMLayer(n_in, s * g, s, rngs=nnx.Rngs(0)))
  layer = jax.jit(lambda x, hc: nnx.merge(layer_def, layer_state)(x, hc))
  rng = np.random.default_rng(10)
  x = jnp.asarray(rng.normal(size=(2, 6, n_in)), jnp.float32)
  h0 = jnp.asarray(rng.uniform(-0.8, 0.8, (2, s * g)), jnp.float32)
  c0 = jnp.asarray(rng.uniform(-0.8, 0.8, (2, s * g)), jnp.float32)
  out, (h, c) = layer(x, (h0, c0))
  assert out.shape == (2, 6, s * g)
  bumps = {"h": (h0.at[:, :g].add(0.5), c0),  # stripe 0 only
           "c": (h0, c0.at[:, :g].add(0.5))}
  for name, bumped in bumps.items():
    out_b, (h_b, c_b) = layer(x, bumped)
    # Stripe 0 responds (at the first step and at the end) ...
    assert np.abs(out_b[:, 0, :g] - out[:, 0, :g]).max() > 1e-3, name
    assert np.abs(c_b[:, :g] - c[:, :g]).max() > 1e-4, name
    # ... stripes 1..S-1 do not, at any time step nor in the final carry.
    np.testing.assert_array_equal(out_b[:, :, g:], out[:, :, g:])
    np.testing.assert_array_equal(h_b[:, g:], h[:, g:])
    np.testing.assert_array_equal(c_b[:, g:], c[:, g:])
  # The input projection is dense: one input feature reaches every stripe.
  out_x, _ = layer(x.at[:, 0, 0].add(1.0), (h0, c0))
  for k in range(s):
    assert np.abs(out_x[:, 0, k * g:(k + 1) * g]
                  - out[:, 0, k * g:(k + 1) * g]).max() > 1e-5


def test_two_half_windows_equal_one_window():
  cfg = _cfg(num_stripes=4, num_layers=2, embed_size=16, hidden_size=16)
  graphdef, params = ref.random_model(cfg, seed=11)
  tokens = ref.random_tokens(cfg, 3, 10, seed=12)
  carry = ref.random_carry(cfg, 3, seed=13)

  full, full_carry = ref.apply(graphdef, params, tokens, carry)
  first, mid = ref.apply(graphdef, params, tokens[:, :5], carry)
  second, end = ref.apply(graphdef, params, tokens[:, 5:], mid)

  np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), full,
                             atol=1e-5, rtol=0)
  ref.assert_carry_close(end, full_carry, atol=1e-5)


def test_unroll_and_remat_do_not_change_results():
  cfg = _cfg(num_stripes=2, embed_size=8, hidden_size=8)
  graphdef, params = ref.random_model(cfg, seed=14)
  tokens = ref.random_tokens(cfg, 2, 7, seed=15)
  carry = ref.random_carry(cfg, 2, seed=16)
  targets = jnp.roll(tokens, -1, axis=1)
  want = ref.loss_and_grad(graphdef, params, tokens, targets, carry)
  other_graphdef, _ = lm.abstract(_cfg(num_stripes=2, unroll=3,
                                          remat=True))
  got = ref.loss_and_grad(other_graphdef, params, tokens, targets, carry)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               got, want)


# ---------------------------------------------------------------- gradients


def test_gradients_match_float64_finite_differences():
  """JAX's float32 gradient of the mean cross-entropy, every coordinate,
  against central differences of the float64 NumPy model."""
  cfg = _cfg(num_stripes=2, num_layers=2, vocab_size=7, embed_size=6,
             hidden_size=8, tie_embeddings=False)
  graphdef, params = ref.random_model(cfg, seed=17, scale=0.6)
  tokens = ref.random_tokens(cfg, 2, 5, seed=18)
  carry = ref.random_carry(cfg, 2, seed=19)
  targets = ref.random_tokens(cfg, 2, 5, seed=20)

  loss, grads = ref.loss_and_grad(
      graphdef, params, tokens, targets, carry)
  p = ref.float64(params)
  np.testing.assert_allclose(loss, _numpy_loss(p, tokens, targets, carry),
                             rtol=1e-6)

  got_leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(grads))
  p_leaves = jax.tree.leaves(p)
  eps, checked = 1e-5, 0
  for index, (leaf, got) in enumerate(zip(p_leaves, got_leaves)):
    want = np.zeros(leaf.shape)
    for flat in range(leaf.size):
      def loss_at(delta):
        leaves = [x.copy() for x in p_leaves]
        leaves[index].reshape(-1)[flat] += delta
        moved = jax.tree.unflatten(treedef, leaves)
        return _numpy_loss(moved, tokens, targets, carry)
      want.reshape(-1)[flat] = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
      checked += 1
    assert np.abs(want).max() > 1e-3  # every parameter group matters
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-3)
  assert checked == lm.num_params(params)


def test_overfits_a_fixed_batch():
  cfg = _cfg(num_stripes=2, num_layers=1, vocab_size=11, embed_size=16,
             hidden_size=16)
  graphdef, params = lm.create(cfg, seed=0)
  tokens = ref.random_tokens(cfg, 4, 13, seed=21)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  carry = lm.init_carry(cfg, 4)
  tx = optax.adam(3e-2)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(ref.jax_loss, argnums=1)(
        graphdef, params, inputs, targets, carry)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  losses = []
  for _ in range(150):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[0] == pytest.approx(np.log(11), rel=0.1)
  assert losses[-1] < losses[0] / 10, losses[::10]  # ~60x here


# ------------------------------------------------------- init and options
# These use `lm.create` (the real initializers). They share one shape set,
# S=4, H=E=16, so eager init compiles once for all of them.

_INIT = dict(num_stripes=4, embed_size=16, hidden_size=16)


def _expected_num_params(cfg):
  """Dense input projections, block-diagonal recurrences [S, G, 4G], head."""
  v, e, h = cfg.vocab_size, cfg.embed_size, cfg.hidden_size
  g = h // cfg.num_stripes
  sizes = [e] + [h] * (cfg.num_layers - 1)
  layers = sum(n * 4 * h + h * 4 * g + 4 * h for n in sizes)
  tied = cfg.tie_embeddings and e == h
  return v * e + layers + v + (0 if tied else h * v)


def test_init_biases_and_orthogonal_stripes():
  cfg = _cfg(**_INIT)
  _, params = lm.create(cfg, seed=0)
  g = 4
  for i in range(cfg.num_layers):
    b = np.asarray(params["layers"][i]["b"][...]).reshape(4, 4, g)  # [S,gate,G]
    np.testing.assert_array_equal(b[:, 1], 1.0)  # forget gate
    np.testing.assert_array_equal(b[:, [0, 2, 3]], 0.0)
    blocks = lm.stripe_blocks(params, i)
    assert len(blocks) == 4
    for w in blocks:
      assert w.shape == (g, 4 * g)
      np.testing.assert_allclose(w @ w.T, np.eye(g), atol=1e-5)
    # Stripes are drawn independently, not copies of one block.
    assert np.abs(blocks[0] - blocks[1]).max() > 1e-2
  # Same seed, same params; another seed, other params.
  _, again = lm.create(cfg, seed=0)
  _, other = lm.create(cfg, seed=1)
  jax.tree.map(np.testing.assert_array_equal, params, again)
  for name in ("w_x", "w_h"):
    assert np.abs(params["layers"][1][name][...]
                  - other["layers"][1][name][...]).max() > 1e-2
  assert np.abs(params["embed"][...] - other["embed"][...]).max() > 1e-2


def test_tied_and_untied_heads():
  tied_cfg = _cfg(**_INIT, tie_embeddings=True)
  _, tied = lm.create(tied_cfg, seed=0)
  assert "head_w" not in tied
  assert lm.num_params(tied) == _expected_num_params(tied_cfg)

  untied_cfg = _cfg(**{**_INIT, "embed_size": 12}, tie_embeddings=True)
  graphdef, untied = lm.create(untied_cfg, seed=0)  # E != H: cannot tie
  assert untied["head_w"][...].shape == (16, 11)
  assert untied["embed"][...].shape == (11, 12)
  assert untied["layers"][0]["w_x"][...].shape == (12, 4, 16)
  assert untied["layers"][1]["w_x"][...].shape == (16, 4, 16)
  assert lm.num_params(untied) == _expected_num_params(untied_cfg)
  logits, carry = ref.apply(graphdef, untied,
                            ref.random_tokens(untied_cfg, 2, 4, 22),
                            lm.init_carry(untied_cfg, 2))
  assert logits.shape == (2, 4, 11) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  assert [x.shape for hc in carry for x in hc] == [(2, 16)] * 4


def test_dropout_only_with_rng():
  rates = dict(dropout_embed=0.3, dropout_hidden=0.3, dropout_output=0.3)
  graphdef, params = lm.create(_cfg(**_INIT, **rates), seed=0)
  plain_graphdef, plain = lm.create(_cfg(**_INIT), seed=0)
  cfg = _cfg(**_INIT)
  tokens = ref.random_tokens(cfg, 2, 6, 23)
  carry = ref.random_carry(cfg, 2, 24)

  plain_out, _ = ref.apply(plain_graphdef, plain, tokens, carry)
  eval_out, _ = ref.apply(graphdef, params, tokens, carry)
  np.testing.assert_array_equal(eval_out, plain_out)

  key = jax.random.key(0)
  train_out, train_carry = ref.apply(graphdef, params, tokens, carry, key)
  again, _ = ref.apply(graphdef, params, tokens, carry, key)
  other, _ = ref.apply(graphdef, params, tokens, carry, jax.random.key(1))
  assert np.abs(train_out - eval_out).max() > 1e-3
  assert np.abs(train_out - other).max() > 1e-3
  np.testing.assert_array_equal(train_out, again)
  assert train_carry[0][0].shape == (2, 16)
  # A dropout rng on a model with zero rates changes nothing.
  no_op, _ = ref.apply(plain_graphdef, plain, tokens, carry, key)
  np.testing.assert_array_equal(no_op, plain_out)


def test_dropout_is_inverted():
  x = jnp.ones((4000,), jnp.float32)
  y = np.asarray(lm.dropout(x, 0.25, jax.random.key(3)))
  assert set(np.unique(y)) <= {0.0, np.float32(1 / 0.75)}
  assert abs((y > 0).mean() - 0.75) < 0.03  # keeps 1 - rate ...
  assert abs(y.mean() - 1.0) < 0.04  # ... and rescales: same expectation
  np.testing.assert_array_equal(lm.dropout(x, 0.25, None), x)
  np.testing.assert_array_equal(lm.dropout(x, 0.0, jax.random.key(3)), x)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  cfg = _cfg(**_INIT)
  f32_graphdef, f32 = lm.create(cfg, seed=0)
  bf16_graphdef, bf16 = lm.create(_cfg(**_INIT, dtype="bfloat16"), seed=0)
  for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16)):
    assert b.dtype == jnp.float32
    np.testing.assert_array_equal(a, b)
  tokens = ref.random_tokens(cfg, 2, 6, 25)
  carry = ref.random_carry(cfg, 2, 26)
  want, _ = ref.apply(f32_graphdef, f32, tokens, carry)
  got, got_carry = ref.apply(bf16_graphdef, bf16, tokens, carry)
  assert got.dtype == jnp.float32
  assert all(h.dtype == c.dtype == jnp.float32 for h, c in got_carry)
  # bfloat16 keeps 8 significant bits: the logits stay within 2^-7 of the
  # largest one (measured: ~2.7e-3 of it), not merely near zero.
  np.testing.assert_allclose(got, want, atol=2**-7 * np.abs(want).max(), rtol=0)
  assert np.abs(got - want).max() > 0  # really computed in bfloat16
