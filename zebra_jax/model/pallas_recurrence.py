"""A ZebraLSTM layer's window as one fused Pallas kernel per stripe.

Stripes never read each other's state inside a layer, so a stripe's whole
window can run as one GPU program: its recurrent block U_s [G, 4G] is loaded
once and stays on-chip, h and c stay in registers, and the time loop runs
inside the kernel with no grid-wide synchronisation per step (a dense fused
LSTM kernel must synchronise the whole grid every step). The grid is
stripes x batch blocks; every program is independent.

Same function, conventions and residuals as `recurrence.zebra_layer` (read
that module first): the input projection x_proj = inputs W_x + b is one large
matmul outside the kernel, time-major inside each stripe ([S, T, B, 4G],
gates [i | f | g | o]); the backward kernel is a reverse-time loop that only
carries (dh, dc) and writes dz_t; dW_h, dW_x, db and d inputs are then one
large matmul (or sum) each over the whole window, as in the scan's
hand-written backward pass.

  forward kernel   x_proj[s, :, b-block], U_s  ->  ys, final (h, c), and for
                   the backward pass c_t and (without remat) the gates
  backward kernel  d ys, gates, c_t, U_s^T     ->  dz [S, T, B, 4G], dh0, dc0

On GPUs the kernels lower through Pallas' Triton backend; elsewhere they run
in Pallas interpret mode (exact, slow: what the CPU tests use). A shape whose
U_s does not fit on-chip, or that Triton cannot tile, runs the scan instead,
with one warning line saying why.

jax 0.12 marks Pallas' Triton backend deprecated in favour of Mosaic GPU
(a DeprecationWarning when the kernel lowers for a GPU); it still lowers
there (tests/model/test_pallas.py checks both jax versions). No Mosaic GPU version
of the kernel exists yet.
"""

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zebra_jax.model import recurrence

# Shared memory one program may use, per GPU generation (bytes). U_s is held
# on-chip for the whole window: bf16 at G=128 is 128 KiB, fp32 at G=64 64 KiB.
_ON_CHIP_BYTES = {"H100": 227 << 10, "H200": 227 << 10, "GH200": 227 << 10,
                  "B200": 227 << 10, "A100": 163 << 10, "A10": 99 << 10,
                  "L4": 99 << 10, "L40": 99 << 10}
_DEFAULT_ON_CHIP_BYTES = 99 << 10  # consumer and older GPUs; interpret mode
_MAX_BATCH_BLOCK = 64   # rows of h per program: registers for h, c, gates
_MIN_TRITON_DIM = 16    # tl.dot needs every matmul dimension >= 16

_warned = set()


def _warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    logging.warning("%s", message)


def on_chip_bytes(device=None) -> int:
  """Shared memory per program on this device (a table by GPU name)."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return _DEFAULT_ON_CHIP_BYTES
  kind = device.device_kind.upper()
  for name in sorted(_ON_CHIP_BYTES, key=len, reverse=True):
    if name in kind:
      return _ON_CHIP_BYTES[name]
  return _DEFAULT_ON_CHIP_BYTES


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def plan(batch: int, width: int, dtype, *, triton: bool,
         budget: int | None = None) -> tuple[int | None, str]:
  """(batch rows per program, "") or (None, why the shape does not fit).

  One program holds U_s (G x 4G in the compute dtype) plus one step's tiles:
  x_t [Bb, 4G] and h, c [Bb, G] in float32. Triton also needs power-of-two
  tiles of at least 16 in every matmul dimension.
  """
  budget = budget or on_chip_bytes()
  itemsize = jnp.dtype(dtype).itemsize
  u_bytes = width * 4 * width * itemsize
  if triton and not (_is_pow2(width) and width >= _MIN_TRITON_DIM):
    return None, (f"stripe width G={width} is not a power of two >= "
                  f"{_MIN_TRITON_DIM}")
  for rows in range(min(batch, _MAX_BATCH_BLOCK), 0, -1):
    if batch % rows or (triton and not (_is_pow2(rows)
                                        and rows >= _MIN_TRITON_DIM)):
      continue
    if u_bytes + rows * 6 * width * 4 <= budget:
      return rows, ""
  if u_bytes > budget:
    return None, (f"U_s of G={width} in {jnp.dtype(dtype).name} is "
                  f"{u_bytes >> 10} KiB, over the {budget >> 10} KiB on-chip "
                  f"budget (use more stripes or bfloat16)")
  return None, (f"batch {batch} has no batch block"
                + (f" that is a power of two >= {_MIN_TRITON_DIM}"
                   if triton else "") + " that fits on-chip with U_s")


# ---------------------------------------------------------------- kernels


def _gate_slices(width: int):
  return [pl.ds(k * width, width) for k in range(4)]


def _forward_kernel(x_ref, w_ref, h0_ref, c0_ref, ys_ref, h_ref, c_ref,
                    *saved_refs, width, num_steps, keep):
  """One stripe, one batch block, the whole window.

  x_ref [T, Bb, 4G] f32, w_ref [G, 4G], h0/c0 [Bb, G] f32 -> ys_ref
  [T, Bb, G], h_ref/c_ref [Bb, G]; saved_refs: cs [T, Bb, G] (keep >= 1) and
  gates [T, Bb, 4G] (keep == 2), f32.
  """
  gs = _gate_slices(width)
  u = [w_ref[:, sl] for sl in gs]  # 4 x [G, G], resident for the window

  def step(t, hc):
    h, c = hc
    hd = h.astype(u[0].dtype)
    z = [x_ref[t, :, sl] + jnp.dot(hd, uk, preferred_element_type=jnp.float32)
         for sl, uk in zip(gs, u)]
    i, f, o = (jax.nn.sigmoid(z[0]), jax.nn.sigmoid(z[1]),
               jax.nn.sigmoid(z[3]))
    g = jnp.tanh(z[2])
    c = f * c + i * g
    h = o * jnp.tanh(c)
    ys_ref[t] = h.astype(ys_ref.dtype)
    if keep >= 1:
      saved_refs[0][t] = c
    if keep == 2:
      for sl, gate in zip(gs, (i, f, g, o)):
        saved_refs[1][t, :, sl] = gate
    return h, c

  h, c = jax.lax.fori_loop(0, num_steps, step, (h0_ref[...], c0_ref[...]))
  h_ref[...] = h
  c_ref[...] = c


def _backward_kernel(dy_ref, gates_ref, cs_ref, c0_ref, wt_ref, dh_ref,
                     dc_ref, dz_ref, dh0_ref, dc0_ref, *, width, num_steps):
  """The reverse-time loop of one stripe and batch block.

  dy_ref [T, Bb, G], gates_ref [T, Bb, 4G] f32, cs_ref [T, Bb, G] f32,
  c0_ref [Bb, G], wt_ref U_s^T [4G, G], dh/dc_ref [Bb, G] (the cotangents of
  the final carry) -> dz_ref [T, Bb, 4G] f32, dh0/dc0_ref [Bb, G].
  """
  gs = _gate_slices(width)
  ut = [wt_ref[sl, :] for sl in gs]  # 4 x [G, G]: dh_{t-1} = sum_k dz_k U_k^T

  def step(j, carry):
    dh, dc = carry
    t = num_steps - 1 - j
    i, f, g, o = (gates_ref[t, :, sl] for sl in gs)
    c_t = cs_ref[t]
    c_prev = jnp.where(t > 0, cs_ref[jnp.maximum(t - 1, 0)], c0_ref[...])
    tanh_c = jnp.tanh(c_t)
    dh = dh + dy_ref[t].astype(jnp.float32)
    dc = dc + dh * (o * (1.0 - tanh_c * tanh_c))
    dz = (dc * (g * i * (1.0 - i)), dc * (c_prev * f * (1.0 - f)),
          dc * (i * (1.0 - g * g)), dh * (tanh_c * o * (1.0 - o)))
    dh = jnp.zeros_like(dh)
    for sl, dz_k, ut_k in zip(gs, dz, ut):
      dz_ref[t, :, sl] = dz_k
      dh = dh + jnp.dot(dz_k.astype(ut_k.dtype), ut_k,
                        preferred_element_type=jnp.float32)
    return dh, dc * f

  dh, dc = jax.lax.fori_loop(0, num_steps, step,
                             (dh_ref[...].astype(jnp.float32),
                              dc_ref[...].astype(jnp.float32)))
  dh0_ref[...] = dh
  dc0_ref[...] = dc


def _window_spec(num_steps, rows, cols):
  """[S, T, B, cols] -> the [T, rows, cols] window of (stripe, batch block)."""
  return pl.BlockSpec((pl.squeezed, num_steps, rows, cols),
                      lambda s, b: (s, 0, b, 0))


def _state_spec(rows, cols):
  """[S, B, cols] -> the [rows, cols] block of (stripe, batch block)."""
  return pl.BlockSpec((pl.squeezed, rows, cols), lambda s, b: (s, b, 0))


def _weight_spec(shape):
  """[S, a, b] -> stripe s's whole [a, b] block, the same for every batch
  block."""
  return pl.BlockSpec((pl.squeezed, *shape), lambda s, b: (s, 0, 0))


def _compiler_params(interpret):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _forward(x_proj, h0, c0, w_h, rows, keep, interpret):
  """x_proj [S, T, B, 4G] f32 -> ys [S, T, B, G] (w_h's dtype), h, c [S, B, G]
  f32, and (cs,) or (cs, gates) for keep = 1, 2."""
  s, t, b, g4 = x_proj.shape
  g = g4 // 4
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((s, t, b, g), w_h.dtype),
               jax.ShapeDtypeStruct((s, b, g), f32),
               jax.ShapeDtypeStruct((s, b, g), f32)]
  out_specs = [_window_spec(t, rows, g), _state_spec(rows, g),
               _state_spec(rows, g)]
  if keep >= 1:
    out_shape.append(jax.ShapeDtypeStruct((s, t, b, g), f32))
    out_specs.append(_window_spec(t, rows, g))
  if keep == 2:
    out_shape.append(jax.ShapeDtypeStruct((s, t, b, g4), f32))
    out_specs.append(_window_spec(t, rows, g4))
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, width=g, num_steps=t, keep=keep),
      out_shape=out_shape, grid=(s, b // rows),
      in_specs=[_window_spec(t, rows, g4), _weight_spec((g, g4)),
                _state_spec(rows, g), _state_spec(rows, g)],
      out_specs=out_specs, interpret=interpret,
      compiler_params=_compiler_params(interpret),
      name="zebra_stripe_forward",
  )(x_proj, w_h, h0.astype(f32), c0.astype(f32))
  return outs[0], outs[1], outs[2], tuple(outs[3:])


def _backward(d_ys, gates, cs, c0, w_h, d_h, d_c, rows, interpret):
  """-> dz [S, T, B, 4G] f32, dh0, dc0 [S, B, G] f32."""
  s, t, b, g4 = gates.shape
  g = g4 // 4
  f32 = jnp.float32
  return pl.pallas_call(
      functools.partial(_backward_kernel, width=g, num_steps=t),
      out_shape=[jax.ShapeDtypeStruct((s, t, b, g4), f32),
                 jax.ShapeDtypeStruct((s, b, g), f32),
                 jax.ShapeDtypeStruct((s, b, g), f32)],
      grid=(s, b // rows),
      in_specs=[_window_spec(t, rows, g), _window_spec(t, rows, g4),
                _window_spec(t, rows, g), _state_spec(rows, g),
                _weight_spec((g4, g)), _state_spec(rows, g),
                _state_spec(rows, g)],
      out_specs=[_window_spec(t, rows, g4), _state_spec(rows, g),
                 _state_spec(rows, g)],
      interpret=interpret, compiler_params=_compiler_params(interpret),
      name="zebra_stripe_backward",
  )(d_ys, gates, cs, c0.astype(f32), jnp.swapaxes(w_h, 1, 2), d_h, d_c)


# ------------------------------------------------------- the layer function


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _fused_layer(inputs, w_x, bias, h0, c0, w_h, unroll, remat, rows,
                 interpret):
  del unroll, remat
  x_proj = recurrence._project(inputs, w_x, bias)  # pylint: disable=protected-access
  ys, h, c, _ = _forward(x_proj, h0, c0, w_h, rows, 0, interpret)
  return ys, h, c


def _fused_fwd(inputs, w_x, bias, h0, c0, w_h, unroll, remat, rows,
               interpret):
  del unroll
  x_proj = recurrence._project(inputs, w_x, bias)  # pylint: disable=protected-access
  ys, h, c, saved = _forward(x_proj, h0, c0, w_h, rows, 1 if remat else 2,
                             interpret)
  return (ys, h, c), (inputs, w_x, bias, h0, c0, w_h, ys, saved)


def _fused_bwd(unroll, remat, rows, interpret, residuals, cotangents):
  del unroll
  inputs, w_x, bias, h0, c0, w_h, ys, saved = residuals
  d_ys, d_h_last, d_c_last = cotangents
  dt = w_h.dtype
  # h_{t-1} in the compute dtype is exactly the previous output: the scan
  # casts its float32 h_{t-1} to that dtype before every use in the backward
  # pass, so nothing else needs saving.
  h_prev = jnp.concatenate([h0.astype(dt)[:, None], ys[:, :-1]], axis=1)
  matmul = lambda spec, a, b: jnp.einsum(spec, a, b,
                                         preferred_element_type=jnp.float32)
  if remat:  # recompute the gates with two large matmuls, as the scan does
    (cs,) = saved
    gates = recurrence._activate(  # pylint: disable=protected-access
        recurrence._project(inputs, w_x, bias)  # pylint: disable=protected-access
        + matmul("stbg,sgk->stbk", h_prev, w_h))
  else:
    cs, gates = saved
  dz, dh0, dc0 = _backward(d_ys, gates, cs, c0, w_h,
                           d_h_last.astype(jnp.float32),
                           d_c_last.astype(jnp.float32), rows, interpret)
  return recurrence.window_gradients(dz, inputs, h_prev, w_x, bias, w_h, dh0,
                                    dc0)


_fused_layer.defvjp(_fused_fwd, _fused_bwd)


def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False, *,
                interpret=None, budget=None):
  """`recurrence.zebra_layer` with the time loop in a fused Pallas kernel.

  Same arguments and results: (outputs [S, T, B, G] in w_h's dtype, final
  h, final c). interpret: None = compiled on GPUs, interpret mode elsewhere
  (a one-time warning says it is slow). budget: on-chip bytes per program
  (None = the table for this GPU). Shapes that do not fit run the scan, with
  one warning line.
  """
  platform = jax.devices()[0].platform
  if interpret is None:
    interpret = platform != "gpu"
    if interpret:
      _warn_once(f"model.recurrence=pallas on {platform}: the kernel runs in "
                 "Pallas interpret mode (exact but slow); use "
                 "model.recurrence=scan off GPUs")
  s, b, g = h0.shape
  rows, why = plan(b, g, w_h.dtype, triton=not interpret, budget=budget)
  if rows is None:
    _warn_once(f"model.recurrence=pallas: {why}; running the scan instead "
               f"(S={s}, B={b}, G={g})")
    return recurrence.zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll,
                                  remat)
  return _fused_layer(inputs, w_x, bias, h0, c0, w_h, unroll, remat, rows,
                      bool(interpret))
