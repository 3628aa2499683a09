"""The ZebraLSTM layer: an LSTM whose hidden state is cut into stripes.

A layer of hidden size H has S stripes of width G = H / S. The input projection
is computed for the whole window outside the time loop; only the
block-diagonal recurrence h_s -> 4G gates of stripe s runs inside the loop.
A stripe reads the layer input whole ("dense") or only its own 1/S slice
("grouped", so every matmul of the layer shrinks by S; `stripe_shuffle`
between layers lets stripes meet). S = 1 is exactly the classic LSTM
(PyTorch `nn.LSTM`, gate order i, f, g, o, with its two biases summed), under
either.

The time loops and their hand-written backward pass live in `recurrence/`
(`scan.py`, and the same math as fused GPU kernels or compiled C++);
`stripe_parallel.py` runs a layer's stripes split over devices.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from zebra_jax.model.recurrence import (native, pallas, pallas_mosaic,
                                         pallas_stream, scan)


def _orthogonal_stripes(key, num_stripes, width):
  """Each stripe's recurrent block [G, 4G] starts with orthonormal rows."""
  keys = jax.random.split(key, num_stripes)
  init = jax.nn.initializers.orthogonal()
  return jax.vmap(lambda k: init(k, (width, 4 * width), jnp.float32))(keys)


class ZebraLSTMLayer(nnx.Module):
  """One striped LSTM layer: a dense or grouped input projection, and a
  block-diagonal recurrence."""

  def __init__(self, in_features: int, hidden_size: int, num_stripes: int, *,
               rngs: nnx.Rngs, dtype=jnp.float32, unroll: int = 1,
               remat: bool = False, custom_vjp: bool = True,
               grouped: bool = False, kernel: str = "scan",
               bf16_projections: bool = False,
               bf16_recurrence: bool = False):
    s, width = num_stripes, hidden_size // num_stripes
    if grouped and in_features % s:
      raise ValueError(f"a grouped layer needs in_features={in_features} "
                       f"divisible by num_stripes={s}")
    self.num_stripes, self.width, self.grouped = s, width, grouped
    self.dtype, self.unroll, self.remat = dtype, unroll, remat
    # remat: the backward pass keeps only (h, c) and recomputes the gates.
    # custom_vjp=False: JAX's autodiff of the scan (a reference for tests and
    # the benchmark; it ignores remat).
    self.custom_vjp = custom_vjp
    # auto | scan | pallas | pallas_stream | native (recurrence/: the same
    # math); auto:
    # native where its loops run (CPUs, float32), else the scan;
    # pallas_mosaic: the GPU report's candidate, not a config choice
    self.kernel = kernel
    # The window's products outside the time loops in bf16 with float32
    # sums, where the native kernel runs them (model.cpu_bf16_projections,
    # resolved by the caller); float32 under every other kernel.
    self.bf16_projections = bf16_projections
    # The time loops' recurrent products in bf16 with float32 sums, likewise
    # (model.cpu_bf16_recurrence).
    self.bf16_recurrence = bf16_recurrence
    # PyTorch nn.LSTM's uniform init range, 1/sqrt(H). A grouped unit reads
    # S times fewer inputs and recurrent units, so 1/sqrt(H/S) keeps its
    # pre-activation's variance (and S = 1 grouped draws the dense weights).
    bound = 1.0 / (width if grouped else hidden_size) ** 0.5
    # Gate-major inside each stripe: [i | f | g | o].
    # dense w_x [in, S, 4G]: every stripe reads the whole input;
    # grouped w_x [S, in/S, 4G]: stripe s reads inputs s*in/S .. (s+1)*in/S.
    shape = ((s, in_features // s, 4 * width) if grouped
             else (in_features, s, 4 * width))
    # stripe_axis: the axis that counts stripes, split over the mesh's
    # "stripe" axis under stripe parallelism (model/mesh_axes.py).
    self.w_x = nnx.Param(jax.random.uniform(
        rngs.params(), shape, jnp.float32, -bound, bound),
                         stripe_axis=0 if grouped else 1)
    self.w_h = nnx.Param(_orthogonal_stripes(rngs.params(), s, width),
                         stripe_axis=0)  # [S, G, 4G]
    bias = jnp.zeros((s, 4, width), jnp.float32).at[:, 1].set(1.0)  # forget bias 1
    self.b = nnx.Param(bias.reshape(s, 4 * width), stripe_axis=0)

  def __call__(self, inputs: jax.Array, carry: tuple[jax.Array, jax.Array]):
    """Runs the layer over a window.

    Args:
      inputs: [batch, time, in_features], any float dtype.
      carry: (h, c), each [batch, hidden] float32.
    Returns:
      outputs [batch, time, hidden] in the compute dtype, and the new (h, c).
    """
    return self.window(inputs, self.w_x[...], self.b[...], carry[0],
                       carry[1], self.w_h[...])

  def window(self, inputs, w_x, bias, h0, c0, w_h):
    """`__call__` on the stripes that w_h holds (all, or a device's share):
    inputs [B, T, in] (for a grouped layer: those stripes' inputs), h0 and c0
    [B, their units] -> (outputs [B, T, their units], (h, c))."""
    s, width, dt = w_h.shape[0], self.width, self.dtype
    b, t, n_in = inputs.shape
    if self.grouped:  # stripe-major [S, T, B, in/S]: stripe s's own slice
      inputs = inputs.reshape(b, t, s, n_in // s).transpose(2, 1, 0, 3)
    else:  # time-major [T, B, in]
      inputs = inputs.transpose(1, 0, 2)
    to_stripes = lambda a: a.reshape(b, s, width).transpose(1, 0, 2)  # [S, B, G]
    args = (inputs.astype(dt), w_x.astype(dt), bias,
            to_stripes(h0), to_stripes(c0), w_h.astype(dt))
    if self.custom_vjp:
      kernel = self.kernel
      if kernel == "auto":
        kernel = native.chosen(dt, inputs.shape)
      if kernel == "native":
        ys, h, c = native.zebra_layer(*args, self.unroll, self.remat,
                                      self.bf16_projections,
                                      self.bf16_recurrence)
      else:
        layer_fn = {"pallas": pallas.zebra_layer,
                    "pallas_stream": pallas_stream.zebra_layer,
                    "pallas_mosaic": pallas_mosaic.zebra_layer
                    }.get(kernel, scan.zebra_layer)
        ys, h, c = layer_fn(*args, self.unroll, self.remat)
    else:
      ys, h, c = scan.zebra_layer_autodiff(*args, self.unroll)
    outputs = ys.transpose(2, 1, 0, 3).reshape(b, t, s * width)  # [B, T, H]
    from_stripes = lambda a: a.transpose(1, 0, 2).reshape(b, s * width)
    return outputs, (from_stripes(h), from_stripes(c))


def stripe_shuffle(x: jax.Array, num_stripes: int) -> jax.Array:
  """A fixed channel permutation, [..., H] -> [..., H], free of FLOPs.

  ShuffleNet's channel shuffle: units viewed as [S, G] are read out as
  [G, S], so unit g of stripe s lands at position g*S + s. Stripe s' of the
  next grouped layer then reads G/S units from every stripe (when S divides
  G): stripes that never meet inside a layer meet across layers.
  """
  *lead, h = x.shape
  s = num_stripes
  return x.reshape(*lead, s, h // s).swapaxes(-1, -2).reshape(*lead, h)
