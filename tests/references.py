"""Independent references for the model tests.

A float64 NumPy LSTM with per-step loops and PyTorch's dense gate layout
(rows [i | f | g | o], each H wide), its cross-entropy, the random models,
carries, tokens and logits the comparisons run on, NumPy's nucleus, and
greedy decoding outside the serving engine. Nothing here calls the code under
test except `lm.abstract` (shapes only) and `lm.apply` (the side being
checked); the greedy reference runs the model (`lm.last_logits`,
`lm.decode_step`) but none of the engine it is held against.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zebra_jax.model import lm


def random_model(cfg, seed, scale=0.5):
  """(graphdef, params) with every parameter, biases too, uniform in
  +-scale (zero-initialised biases or cluster logits would hide bugs).

  Built from `lm.abstract`, so no initializer runs (eager init compiles
  every op per shape, which would dominate the run time); the initializers
  have their own tests.
  """
  graphdef, shapes = lm.abstract(cfg)
  leaves, treedef = jax.tree.flatten(shapes)
  rng = np.random.default_rng(seed)
  return graphdef, jax.tree.unflatten(treedef, [
      jnp.asarray(rng.uniform(-scale, scale, x.shape), jnp.float32)
      for x in leaves])


def randomize(module, seed=1):
  """An NNX module with every parameter drawn N(0, 0.5^2): zero-initialised
  cluster logits and biases hide bugs."""
  graphdef, state = nnx.split(module)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [jax.random.normal(k, x.shape, x.dtype) * 0.5
            for k, x in zip(keys, leaves)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def random_carry(cfg, batch, seed, scale=0.8):
  rng = np.random.default_rng(seed)
  draw = lambda: jnp.asarray(
      rng.uniform(-scale, scale, (batch, cfg.hidden_size)), jnp.float32)
  return tuple((draw(), draw()) for _ in range(cfg.num_layers))


def random_tokens(cfg, batch, time, seed):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, time)), jnp.int32)


def float64(params) -> dict:
  """The parameters as a nested dict of float64 NumPy arrays."""
  return jax.tree.map(lambda x: np.asarray(x, np.float64),
                      nnx.to_pure_dict(params))


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def dense_lstm(x, h, c, w_ih, w_hh, bias):
  """Classic LSTM, one step at a time. x [B, T, in]; w_ih [4H, in]; w_hh [4H, H].

  Gate rows are [i | f | g | o], each H wide (PyTorch's layout).
  """
  outputs = []
  for t in range(x.shape[1]):
    z = x[:, t] @ w_ih.T + h @ w_hh.T + bias
    i, f, g, o = np.split(z, 4, axis=-1)
    c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    h = sigmoid(o) * np.tanh(c)
    outputs.append(h)
  return np.stack(outputs, axis=1), (h, c)


def mean_cross_entropy(logits, targets):
  """The mean negative log-likelihood of `targets`, in float64."""
  logits = logits - logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1)
  return -picked.mean()


def jax_loss(graphdef, params, tokens, targets, carry):
  logits, _ = lm.apply(graphdef, params, tokens, carry)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


# Jitted once per shape: eager op-by-op dispatch would dominate the run time.
apply = jax.jit(lm.apply, static_argnums=0)
loss_and_grad = jax.jit(jax.value_and_grad(jax_loss, argnums=1),
                        static_argnums=0)


def assert_carry_close(got, want, atol):
  for (h, c), (h_ref, c_ref) in zip(got, want, strict=True):
    assert h.dtype == c.dtype == jnp.float32
    np.testing.assert_allclose(h, h_ref, atol=atol, rtol=0)
    np.testing.assert_allclose(c, c_ref, atol=atol, rtol=0)


def random_logits(seed, shape, scale=2.0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=shape).astype(np.float32) * scale


def numpy_nucleus(logits, top_p):
  """bool [rows, vocab]: smallest most-likely set with mass >= top_p."""
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  keep = np.zeros(logits.shape, bool)
  for row, p in enumerate(probs):
    order = np.argsort(-p)
    num_kept = int(np.argmax(np.cumsum(p[order]) >= top_p)) + 1
    keep[row, order[:num_kept]] = True
  return keep


# Jitted once per model: graphdef is static.
_prompt = jax.jit(lm.last_logits, static_argnums=0)
_step = jax.jit(lambda graphdef, params, carry, tokens: lm.decode_step(
    params, carry, tokens, graphdef=graphdef), static_argnums=0)


def greedy_ids(graphdef, params, model_cfg, ids, n) -> list[int]:
  """`n` greedy tokens after the prompt `ids`, by another path than the
  engine's: the whole prompt as one window, then one step per token in a
  host loop, NumPy's argmax (the first of ties) choosing each token. The
  engine consumes prompts in masked chunks and decodes in blocks, its
  filters and draw on the device."""
  tokens = jnp.asarray(np.asarray(ids, np.int32)[None])
  logits, carry = _prompt(graphdef, params, tokens,
                          lm.init_carry(model_cfg, 1))
  out = []
  for _ in range(n):
    out.append(int(np.argmax(np.asarray(logits[0]))))
    logits, carry = _step(graphdef, params, carry,
                          jnp.asarray([out[-1]], jnp.int32))
  return out


def greedy_text(generator, prompt: str, n: int) -> str:
  """greedy_ids for a zebra_jax.inference.sample.Generator's model (its
  weights as placed for inference), decoded."""
  ids = greedy_ids(generator.loaded.graphdef, generator.params,
                   generator.loaded.cfg.model, generator.encode(prompt), n)
  return generator.tokenizer.decode(ids)
