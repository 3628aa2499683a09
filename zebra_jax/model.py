"""ZebraLSTM: an LSTM whose hidden state is cut into independent stripes.

A layer of hidden size H has S stripes of width G = H / S. The input projection
is dense (every stripe reads the whole input) and is computed for the whole
window as one matmul outside the time loop; only the block-diagonal recurrence
h_s -> 4G gates of stripe s runs inside `lax.scan`. S = 1 is exactly the classic
LSTM (PyTorch `nn.LSTM`, gate order i, f, g, o, with its two biases summed).
The layer's arithmetic and its hand-written backward pass live in
`recurrence.py`.

Parameters are float32; matmuls run in `dtype` with float32 accumulation, and the
cell state `c`, the carry and the logits stay float32.

The model is an NNX module used functionally: `create` splits it into a graph
definition and a parameter `nnx.State`, and `apply` merges them inside pure,
jittable functions.
"""

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from zebra_jax import recurrence

# One (h, c) pair per layer, each [batch, hidden] float32.
Carry = tuple[tuple[jax.Array, jax.Array], ...]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
           "float16": jnp.float16}


def compute_dtype(name: str) -> jnp.dtype:
  return _DTYPES[name]


def _orthogonal_stripes(key, num_stripes, width):
  """Each stripe's recurrent block [G, 4G] starts with orthonormal rows."""
  keys = jax.random.split(key, num_stripes)
  init = jax.nn.initializers.orthogonal()
  return jax.vmap(lambda k: init(k, (width, 4 * width), jnp.float32))(keys)


def dropout(x, rate: float, rng):
  """Inverted dropout; a no-op when rng is None (evaluation) or rate is 0."""
  if rng is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class ZebraLSTMLayer(nnx.Module):
  """One striped LSTM layer: dense input projection, block-diagonal recurrence."""

  def __init__(self, in_features: int, hidden_size: int, num_stripes: int, *,
               rngs: nnx.Rngs, dtype=jnp.float32, unroll: int = 1,
               remat: bool = False, custom_vjp: bool = True):
    s, g = num_stripes, hidden_size // num_stripes
    self.num_stripes, self.width = s, g
    self.dtype, self.unroll, self.remat = dtype, unroll, remat
    # remat: the backward pass keeps only (h, c) and recomputes the gates.
    # custom_vjp=False: JAX's autodiff of the scan (a reference for tests and
    # the benchmark; it ignores remat).
    self.custom_vjp = custom_vjp
    bound = 1.0 / hidden_size ** 0.5  # PyTorch nn.LSTM's uniform init range
    # w_x: [in, stripe, 4G]; gate-major inside each stripe: [i | f | g | o].
    self.w_x = nnx.Param(jax.random.uniform(
        rngs.params(), (in_features, s, 4 * g), jnp.float32, -bound, bound))
    self.w_h = nnx.Param(_orthogonal_stripes(rngs.params(), s, g))  # [S, G, 4G]
    bias = jnp.zeros((s, 4, g), jnp.float32).at[:, 1].set(1.0)  # forget bias 1
    self.b = nnx.Param(bias.reshape(s, 4 * g))

  def __call__(self, inputs: jax.Array, carry: tuple[jax.Array, jax.Array]):
    """Runs the layer over a window.

    Args:
      inputs: [batch, time, in_features], any float dtype.
      carry: (h, c), each [batch, hidden] float32.
    Returns:
      outputs [batch, time, hidden] in the compute dtype, and the new (h, c).
    """
    s, g, dt = self.num_stripes, self.width, self.dtype
    b, t, _ = inputs.shape
    to_stripes = lambda a: a.reshape(b, s, g).transpose(1, 0, 2)  # [S, B, G]
    args = (inputs.astype(dt).transpose(1, 0, 2),  # time-major [T, B, I]
            self.w_x[...].astype(dt), self.b[...],
            to_stripes(carry[0]), to_stripes(carry[1]), self.w_h[...].astype(dt))
    if self.custom_vjp:
      ys, h, c = recurrence.zebra_layer(*args, self.unroll, self.remat)
    else:
      ys, h, c = recurrence.zebra_layer_autodiff(*args, self.unroll)
    outputs = ys.transpose(2, 0, 1, 3).reshape(b, t, s * g)  # [B, T, H]
    from_stripes = lambda a: a.transpose(1, 0, 2).reshape(b, s * g)
    return outputs, (from_stripes(h), from_stripes(c))


class ZebraLM(nnx.Module):
  """Embedding -> num_layers x ZebraLSTM -> (tied) full softmax head."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    dt = compute_dtype(cfg.dtype)
    self.dtype = dt
    self.dropout_embed = float(cfg.dropout_embed)
    self.dropout_hidden = float(cfg.dropout_hidden)
    self.dropout_output = float(cfg.dropout_output)
    self.embed = nnx.Param(jax.random.uniform(
        rngs.params(), (cfg.vocab_size, cfg.embed_size), jnp.float32, -0.1, 0.1))
    sizes = [cfg.embed_size] + [cfg.hidden_size] * cfg.num_layers
    self.layers = nnx.List([
        ZebraLSTMLayer(sizes[i], cfg.hidden_size, cfg.num_stripes, rngs=rngs,
                       dtype=dt, unroll=cfg.unroll, remat=cfg.remat)
        for i in range(cfg.num_layers)])
    self.tied = bool(cfg.tie_embeddings and cfg.embed_size == cfg.hidden_size)
    if not self.tied:
      bound = 1.0 / cfg.hidden_size ** 0.5
      self.head_w = nnx.Param(jax.random.uniform(
          rngs.params(), (cfg.hidden_size, cfg.vocab_size), jnp.float32,
          -bound, bound))
    self.head_b = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32))

  def __call__(self, tokens: jax.Array, carry: Carry, dropout_rng=None):
    """Next-token logits for a window.

    Args:
      tokens: [batch, time] int32.
      carry: one (h, c) pair per layer, each [batch, hidden] float32.
      dropout_rng: a PRNG key for training; None disables dropout.
    Returns:
      logits [batch, time, vocab] float32, and the new carry.
    """
    rngs = (list(jax.random.split(dropout_rng, len(self.layers) + 1))
            if dropout_rng is not None else [None] * (len(self.layers) + 1))
    with jax.named_scope("embedding"):
      x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, E]
      x = dropout(x, self.dropout_embed, rngs[0])
    new_carry = []
    for i, layer in enumerate(self.layers):
      with jax.named_scope(f"zebra_lstm_{i}"):
        x, layer_carry = layer(x, carry[i])
        new_carry.append(layer_carry)
        last = i == len(self.layers) - 1
        rate = self.dropout_output if last else self.dropout_hidden
        x = dropout(x, rate, rngs[i + 1])
    with jax.named_scope("head"):
      w = self.embed[...].T if self.tied else self.head_w[...]
      logits = jnp.einsum("bth,hv->btv", x.astype(self.dtype),
                          w.astype(self.dtype),
                          preferred_element_type=jnp.float32)
      logits = logits + self.head_b[...]
    return logits, tuple(new_carry)


def init_carry(cfg: ml_collections.ConfigDict, batch_size: int) -> Carry:
  """Zero (h, c) for every layer: the state at the start of a stream."""
  zeros = lambda: jnp.zeros((batch_size, cfg.hidden_size), jnp.float32)
  return tuple((zeros(), zeros()) for _ in range(cfg.num_layers))


def create(cfg: ml_collections.ConfigDict, seed: int):
  """Builds the model and returns (graphdef, params): params is an nnx.State."""
  return nnx.split(ZebraLM(cfg, rngs=nnx.Rngs(seed)))


def abstract(cfg: ml_collections.ConfigDict):
  """(graphdef, params as ShapeDtypeStructs), without allocating: for restores."""
  return nnx.split(nnx.eval_shape(lambda: ZebraLM(cfg, rngs=nnx.Rngs(0))))


def apply(graphdef, params, tokens, carry, dropout_rng=None):
  """Pure forward pass: (logits [B, T, V] float32, new carry)."""
  return nnx.merge(graphdef, params)(tokens, carry, dropout_rng)


def num_params(params: Any) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def stripe_blocks(params, layer: int) -> Sequence[jax.Array]:
  """The recurrent blocks of one layer, [G, 4G] each (for inspection and tests)."""
  return list(params["layers"][layer]["w_h"][...])
