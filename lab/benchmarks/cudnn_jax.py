"""`jax.experimental.rnn.lstm` (cuDNN through JAX) as a baseline of the
kernel rows: the LSTM a JAX user already has on a GPU.

S = 1 is one cuDNN LSTM of width H; S > 1 is what a JAX user would write
to get stripes from cuDNN: S independent LSTMs of width H/S, stripe s
reading its own H/S slice of the input (the grouped layer's input), each
with all its layers in one cuDNN call. cuDNN packs an LSTM's weights in one
flat vector (every layer's W_ih, W_hh, then every layer's b_ih, b_hh; gates
[i | f | g | o], as PyTorch orders them and as the scan does): `pack`
builds it from per-layer matrices and `stripe_matrices` takes a ZebraLSTM
stripe's matrices into that layout, so the same weights run both ways.

jax lowers the op for CUDA and ROCm only: on a CPU the step is traced (so
a refusal such as bf16's still shows) and the row is an error row that
says why. Precision: HIGHEST is IEEE float32, HIGH lets cuDNN use TF32;
DEFAULT is jax's spelling of bfloat16, which it refuses for this op.
"""

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lab.benchmarks.steps import Runner, adam_step

PRECISIONS = {"fp32": lax.Precision.HIGHEST, "tf32": lax.Precision.HIGH,
              "bf16": lax.Precision.DEFAULT}


def pack(w_ih, w_hh, b_ih, b_hh):
  """cuDNN's flat weight vector of a unidirectional LSTM from per-layer
  lists: W_ih [4H, in], W_hh [4H, H], b_ih and b_hh [4H]."""
  mats = [m for pair in zip(w_ih, w_hh) for m in pair]
  biases = [b for pair in zip(b_ih, b_hh) for b in pair]
  return jnp.concatenate([jnp.ravel(jnp.asarray(a)) for a in mats + biases])


def stripe_matrices(w_x, w_h, bias, s: int, grouped: bool):
  """A ZebraLSTM layer's stripe s as cuDNN's (W_ih, W_hh, b_ih, b_hh):
  w_x [S, I/S, 4G] grouped or [I, S, 4G] dense, w_h [S, G, 4G], bias
  [S, 4G] (one bias: cuDNN's second is zero)."""
  w_in = w_x[s] if grouped else w_x[:, s]
  b = jnp.asarray(bias[s])
  return jnp.asarray(w_in).T, jnp.asarray(w_h[s]).T, b, jnp.zeros_like(b)


def _lstm(rnn, x_btf, weights, width, layers, precision):
  """One cuDNN LSTM over x [B, T, F] from zero state: y [B, T, width]."""
  b = x_btf.shape[0]
  zeros = jnp.zeros((layers, b, width), x_btf.dtype)
  lengths = jnp.full((b,), x_btf.shape[1], jnp.int32)
  y, _, _ = rnn.lstm(x_btf, zeros, zeros, weights, lengths, x_btf.shape[2],
                     width, layers, 0.0, False, precision)
  return y


def train_step(shape, stripes: int, precision: str, dtype=jnp.float32):
  """(jitted Adam step, its arguments, feedback) of S independent cuDNN
  LSTMs of width H/S over random inputs: the kernel rows' core step (sum
  of squares of the outputs, Adam at 1e-3), for steps.Runner."""
  from jax.experimental import rnn  # pylint: disable=g-import-not-at-top
  b, t, h, layers = (shape["batch"], shape["seq_len"], shape["hidden"],
                     shape["layers"])
  g = h // stripes
  keys = jax.random.split(jax.random.key(0), stripes + 1)
  weights = [rnn.init_lstm_weight(k, g, g, layers, False).astype(dtype)
             for k in keys[:stripes]]
  x = jax.random.normal(keys[-1], (b, t, h), dtype)
  prec = PRECISIONS[precision]

  def loss_fn(weights, x):
    parts = jnp.split(x, stripes, axis=2)
    y = jnp.concatenate([_lstm(rnn, p, w, g, layers, prec)
                         for p, w in zip(parts, weights)], axis=2)
    return jnp.sum(jnp.square(y.astype(jnp.float32))) / y.size

  tx = optax.adam(1e-3)
  return adam_step(loss_fn, tx), (weights, tx.init(weights), x), {0: 0, 1: 1}


def runner(shape, stripes: int, precision: str, dtype=jnp.float32):
  """The step as a steps.Runner (compiled, ready to time). jax's refusal
  of a precision (NotImplementedError, raised while tracing) is the error
  on every platform; off CUDA and ROCm, where the op cannot even be traced
  (its shape rule asks cuDNN for its workspace), the one-line reason."""
  jitted, args, feedback = train_step(shape, stripes, precision, dtype)
  platform = jax.devices()[0].platform
  no_lowering = RuntimeError(f"jax.experimental.rnn.lstm lowers for CUDA "
                             f"and ROCm only: no {platform} lowering")
  try:
    jitted.trace(*args)
  except NotImplementedError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if platform == "gpu":
      raise
    raise no_lowering from e
  if platform != "gpu":
    raise no_lowering
  return Runner(jitted, args, feedback)
