"""A ZebraLSTM layer's window as one fused Pallas kernel per stripe.

Stripes never read each other's state inside a layer, so a stripe's whole
window can run as one GPU program per batch block: h and c stay in
registers and the time loop runs inside the kernel with no grid-wide
synchronisation per step (a dense fused LSTM kernel must synchronise the
whole grid every step). The grid is stripes x batch blocks; every program is
independent.

Same function, conventions and residuals as `scan.zebra_layer` (read
that module first): the input projection x_proj = inputs W_x + b is one large
matmul outside the kernel, time-major inside each stripe ([S, T, B, 4G],
gates [i | f | g | o]); the backward kernel is a reverse-time loop that only
carries (dh, dc) and writes dz_t; dW_h, dW_x, db and d inputs are then one
large matmul (or sum) each over the whole window, as in the scan's
hand-written backward pass.

  forward kernel   x_proj[s, :, b-block], U_s  ->  ys, final (h, c), and for
                   the backward pass c_t and (without remat) the gates
  backward kernel  d ys, gates, c_t, U_s^T     ->  dz [S, T, B, 4G], dh0, dc0

Sizing (`launch_plan`). A program is 16 batch rows (tl.dot needs M >= 16; the
smallest block gives the most programs) and 4 or 8 warps. Its live values
are estimated in 32-bit registers per thread, bytes / (4 B x 32 x warps),
against 3/4 of the per-thread cap min(255, 65536 / threads), i.e. 191
registers at 4 or 8 warps; the rest is for addresses, loop state and
temporaries. What a program keeps live:
  one step's tiles  the [16, 4G] float32 gate block plus h, c [16, G]:
                    16 x 6G x 4 B = 48 KiB at G=128, 96 KiB at G=256
  held              U_s [G, 4G] loaded once per window and kept in registers
                    (at M=16 Triton's dot is mma.sync, operands in registers;
                    wgmma needs M >= 64): G x 4G x itemsize + the tiles
  streamed          U_s re-read from global memory every step, one [k, G]
                    block per dot (k_chunk rows, ~32 registers a thread),
                    + the tiles. All stripes' U_s stay in L2 (S x G x 4G x 2 B
                    = 4 MiB for S=8, G=256 bf16; H100: 50 MiB); each program
                    reads G x 4G x itemsize of L2 per step (512 KiB at G=256
                    bf16: 32 MiB a step over 64 programs, bandwidth-bound).

  shape, batch per GPU   U_s      held: U_s + tiles,     plan: rows, warps,
                                  registers a thread     strategy, k_chunk;
                                  4 warps   8 warps      programs (S x B/16)
  S=8 G=128 bf16 B=64    128 KiB  352       176          16 8 held 128;     32
  S=8 G=256 bf16 B=128   512 KiB  1216      608          16 8 streamed 64;  64
    (the WikiText-103 recipe: tiles 96 + U_s block 32 = 128 registers)
  S=8 G=64  fp32 B=64     64 KiB  176       88           16 4 held 64;      32
  S=8 G=128 fp32 B=64    256 KiB  608       304          16 8 streamed 64;  32
  G=512 bf16             tiles alone: 192 registers at 8 warps -> the scan

An H100 has 132 SMs: 32-64 programs is one per SM with SMs to spare (a held
G=128 bf16 program fills 176 x 256 of an SM's 64K registers anyway). The
dots take jax's default matmul precision, as the scan's XLA matmuls do: in
float32 that is TF32 on GPUs with tensor cores (Triton's inputPrecision =
tf32), and IEEE float32 under jax_default_matmul_precision=highest. IEEE
products run on the FMA units, an order of magnitude slower than TF32 and
far behind the scan (python -m lab.pallas_plans). num_stages=1:
the streamed loads have nothing to overlap with but the step that needs
them, and pipelining them would take shared memory for whole U_s copies.

Backend. On GPUs the kernels lower through Pallas' Triton backend
(`pallas.triton.CompilerParams(num_warps=..., num_stages=1)`); elsewhere
they run in Pallas interpret mode (exact, slow: what the CPU tests use).
jax 0.11.0 deprecated that backend ("The Pallas Triton backend is
deprecated and will be removed in a future JAX version. To keep using Pallas
on GPU, please migrate to the Mosaic GPU backend. ...": a DeprecationWarning
at every lowering, deprecation id "jax-pallas-triton"); jax 0.10 has no such
warning, and jax 0.11.2 still lowers it (tests/model/test_pallas.py exports for
CUDA). Triton stays because it is what can be checked without a GPU, in
interpret mode and by exporting. On a jax without
`jax.experimental.pallas.triton`, or with that deprecation accelerated into
an error, `plan()` returns None with the reason and the layer runs the scan,
with one warning line.

The Mosaic GPU port (`plgpu` = jax.experimental.pallas.mosaic_gpu; one
Pallas thread is a warpgroup of 128 CUDA threads); `pallas_mosaic.py` is
its forward window at G <= 128 bf16, paired with this module's backward
kernel. It needs:
  - U_s in shared memory, copied once per window by TMA
    (plgpu.copy_gmem_to_smem, then plgpu.barrier_wait): 128 KiB fits at G=128
    bf16 (227 KiB per block); G=256's 512 KiB does not, so it streams U_s
    blocks through two or three TMA buffers per step (plgpu.emit_pipeline)
    or splits U_s over a 4-block cluster.
  - the step's matmul as plgpu.wgmma from shared memory, transposed so that
    the wide side is M: z^T [4G, Bb] = U_s^T [4G, G] @ h^T [G, Bb] (wgmma's M
    is 64 per warpgroup, N any multiple of 8 up to 256, so 16 batch rows stay
    one block), accumulating in a plgpu.WGMMAAccumulatorRef; h_t is written
    to shared memory every step as the next step's B operand.
  - one warpgroup per program at G <= 128 (the [4G, 16] float32 accumulator
    is 64 registers a thread at G=128), two at G=256; the gate math in the
    accumulator's layout, plgpu.wgmma_wait and a barrier per step.
"""

import functools
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zebra_jax.model.recurrence import scan

ROWS = 16               # batch rows per program on Triton: tl.dot needs M >= 16
_MIN_TRITON_DIM = 16    # and every matmul dimension >= 16, powers of two
_SM_REGISTERS = 65536   # 32-bit registers per SM (sm_80 to sm_100)
_THREAD_REGISTERS = 255
_REGISTER_SHARE = 0.75  # of the cap that live values may take
_BLOCK_REGISTERS = 32   # a streamed U_s block's registers per thread

class Plan(NamedTuple):
  """How a layer's window runs: rows is None when the scan runs instead."""
  rows: int | None = None      # batch rows per program
  num_warps: int | None = None
  u_strategy: str | None = None  # "held" | "streamed"
  k_chunk: int | None = None   # rows of U_s per dot (G when held)
  why: str = ""                # why the scan runs; "" when the kernel does


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def triton_missing() -> str:
  """"" if this jax lowers Pallas kernels through Triton, else why not."""
  try:
    triton = importlib.import_module("jax.experimental.pallas.triton")
  except ImportError:
    triton = None
  if not hasattr(triton, "CompilerParams"):
    return (f"jax {jax.__version__} has no Pallas Triton backend (the kernel "
            "has a Mosaic GPU forward only)")
  try:
    from jax._src import deprecations  # pylint: disable=g-import-not-at-top
    if deprecations.is_accelerated("jax-pallas-triton"):
      return "the Pallas Triton backend's deprecation is an error in this jax"
  except (ImportError, AttributeError, ValueError):
    pass  # jax <= 0.10: not deprecated
  return ""


def _size(nbytes: int) -> str:
  return f"{nbytes >> 10} KiB" if nbytes >= 1024 else f"{nbytes} B"


def register_budget(num_warps: int) -> int:
  """Bytes of registers a program's live values may take."""
  threads = 32 * num_warps
  per_thread = min(_THREAD_REGISTERS, _SM_REGISTERS // threads)
  return int(_REGISTER_SHARE * per_thread) * 4 * threads


def _block_rows(width: int, itemsize: int, num_warps: int) -> int:
  """k for a streamed [k, G] block of U_s of ~32 registers a thread."""
  k = width
  while k > _MIN_TRITON_DIM and k * width * itemsize > (
      _BLOCK_REGISTERS * 4 * 32 * num_warps):
    k //= 2
  return k


def launch_plan(batch: int, width: int, dtype, *, triton: bool,
                budget: int | None = None,
                u_strategy: str | None = None) -> Plan:
  """Rows, warps and U_s strategy of one program (see the module docstring).

  budget: register bytes per program (None: `register_budget`). u_strategy:
  "held" or "streamed" to force one (tests); None picks held when it fits.
  Off Triton (interpret mode) rows is the largest divisor of batch <= 16.
  """
  name = jnp.dtype(dtype).name
  itemsize = jnp.dtype(dtype).itemsize
  if triton:
    missing = triton_missing()
    if missing:
      return Plan(why=missing)
    if not (_is_pow2(width) and width >= _MIN_TRITON_DIM):
      return Plan(why=f"stripe width G={width} is not a power of two >= "
                  f"{_MIN_TRITON_DIM}")
    if batch % ROWS:
      return Plan(why=f"batch {batch} is not a multiple of {ROWS} rows")
    rows = ROWS
  else:
    rows = max(r for r in range(1, min(batch, ROWS) + 1) if batch % r == 0)
  tiles = rows * 6 * width * 4
  for strategy in (u_strategy,) if u_strategy else ("held", "streamed"):
    for warps in (4, 8) if strategy == "held" else (8, 4):
      if strategy == "held":
        k = width
        live = width * 4 * width * itemsize + tiles
      else:
        k = _block_rows(width, itemsize, warps)
        live = k * width * itemsize + tiles
      if live <= (budget or register_budget(warps)):
        return Plan(rows, warps, strategy, k)
  u_bytes = width * 4 * width * itemsize
  return Plan(why=(
      f"G={width} {name}: {rows}-row step tiles ({_size(tiles)}) plus U_s "
      f"({_size(u_bytes)}) or a block of it exceed the "
      f"{_size(budget or register_budget(8))} register budget"))


def plan(batch: int, width: int, dtype, *, triton: bool,
         budget: int | None = None) -> tuple[int | None, str]:
  """(batch rows per program, "") or (None, why the scan runs instead)."""
  p = launch_plan(batch, width, dtype, triton=triton, budget=budget)
  return p.rows, p.why


def describe(p: Plan) -> str:
  """One short label: 'fused: 16 rows, 8 warps, U_s held' or 'scan: why'."""
  if p.rows is None:
    return f"scan: {p.why}"
  return (f"fused: {p.rows} rows, {p.num_warps} warps, U_s {p.u_strategy}"
          + (f" in {p.k_chunk}-row blocks" if p.u_strategy == "streamed"
             else ""))


# ---------------------------------------------------------------- kernels


def _gate_slices(width: int):
  return [pl.ds(k * width, width) for k in range(4)]


def _recurrent_weights(w_ref, width, k_chunk, held, transposed):
  """weight(k, j): block j of gate k's recurrent matrix, [k_chunk, G].

  w_ref is U_s [G, 4G] (block = rows j, columns of gate k) or U_s^T [4G, G]
  (rows of gate k's block j, all columns). held: loaded here, once, and
  kept; streamed: loaded where the step calls weight().
  """
  blocks = width // k_chunk

  def load(k, j):
    if transposed:
      return w_ref[pl.ds(k * width + j * k_chunk, k_chunk), :]
    return w_ref[pl.ds(j * k_chunk, k_chunk), pl.ds(k * width, width)]

  if not held:
    return load, blocks
  kept = [[load(k, j) for j in range(blocks)] for k in range(4)]
  return (lambda k, j: kept[k][j]), blocks


def _matmul(a, weight, k, blocks):
  """a [Bb, G] @ gate k's [G, G] matrix, one [k_chunk, G] block at a time,
  float32 accumulation, at jax's default matmul precision (module
  docstring)."""
  parts = jnp.split(a, blocks, axis=1) if blocks > 1 else [a]
  out = None
  for j, part in enumerate(parts):
    term = jnp.dot(part, weight(k, j), preferred_element_type=jnp.float32)
    out = term if out is None else out + term
  return out


def _forward_kernel(x_ref, w_ref, h0_ref, c0_ref, ys_ref, h_ref, c_ref,
                    *saved_refs, width, num_steps, keep, k_chunk, held):
  """One stripe, one batch block, the whole window.

  x_ref [T, Bb, 4G] f32, w_ref [G, 4G], h0/c0 [Bb, G] f32 -> ys_ref
  [T, Bb, G], h_ref/c_ref [Bb, G]; saved_refs: cs [T, Bb, G] (keep "states" or
  "gates") and gates [T, Bb, 4G] (keep "gates"), f32.
  """
  gs = _gate_slices(width)
  weight, blocks = _recurrent_weights(w_ref, width, k_chunk, held, False)

  def step(t, hc):
    h, c = hc
    hd = h.astype(w_ref.dtype)
    z = [x_ref[t, :, sl] + _matmul(hd, weight, k, blocks)
         for k, sl in enumerate(gs)]
    i, f, o = (jax.nn.sigmoid(z[0]), jax.nn.sigmoid(z[1]),
               jax.nn.sigmoid(z[3]))
    g = jnp.tanh(z[2])
    c = f * c + i * g
    h = o * jnp.tanh(c)
    ys_ref[t] = h.astype(ys_ref.dtype)
    if keep is not None:
      saved_refs[0][t] = c
    if keep == "gates":
      for sl, gate in zip(gs, (i, f, g, o)):
        saved_refs[1][t, :, sl] = gate
    return h, c

  h, c = jax.lax.fori_loop(0, num_steps, step, (h0_ref[...], c0_ref[...]))
  h_ref[...] = h
  c_ref[...] = c


def _backward_kernel(dy_ref, gates_ref, cs_ref, c0_ref, wt_ref, dh_ref,
                     dc_ref, dz_ref, dh0_ref, dc0_ref, *, width, num_steps,
                     k_chunk, held):
  """The reverse-time loop of one stripe and batch block.

  dy_ref [T, Bb, G], gates_ref [T, Bb, 4G] f32, cs_ref [T, Bb, G] f32,
  c0_ref [Bb, G], wt_ref U_s^T [4G, G], dh/dc_ref [Bb, G] (the cotangents of
  the final carry) -> dz_ref [T, Bb, 4G] f32, dh0/dc0_ref [Bb, G].
  """
  gs = _gate_slices(width)
  # dh_{t-1} = sum_k dz_k U_k^T
  weight, blocks = _recurrent_weights(wt_ref, width, k_chunk, held, True)

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
    for k, (sl, dz_k) in enumerate(zip(gs, dz)):
      dz_ref[t, :, sl] = dz_k
      dh = dh + _matmul(dz_k.astype(wt_ref.dtype), weight, k, blocks)
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


def compiler_params(launch, interpret):
  """Triton's warps and stages for a compiled launch; None in interpret
  mode."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=1)


def _kernel_args(launch):
  return dict(k_chunk=launch.k_chunk, held=launch.u_strategy == "held")


def _forward(x_proj, h0, c0, w_h, launch, keep, interpret):
  """x_proj [S, T, B, 4G] f32 -> ys [S, T, B, G] (w_h's dtype), h, c [S, B, G]
  f32, and () / (cs,) / (cs, gates) for keep None / "states" / "gates" (the
  names scan.py uses for what the backward pass keeps)."""
  s, t, b, g4 = x_proj.shape
  g = g4 // 4
  rows = launch.rows
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((s, t, b, g), w_h.dtype),
               jax.ShapeDtypeStruct((s, b, g), f32),
               jax.ShapeDtypeStruct((s, b, g), f32)]
  out_specs = [_window_spec(t, rows, g), _state_spec(rows, g),
               _state_spec(rows, g)]
  if keep is not None:
    out_shape.append(jax.ShapeDtypeStruct((s, t, b, g), f32))
    out_specs.append(_window_spec(t, rows, g))
  if keep == "gates":
    out_shape.append(jax.ShapeDtypeStruct((s, t, b, g4), f32))
    out_specs.append(_window_spec(t, rows, g4))
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, width=g, num_steps=t, keep=keep,
                        **_kernel_args(launch)),
      out_shape=out_shape, grid=(s, b // rows),
      in_specs=[_window_spec(t, rows, g4), _weight_spec((g, g4)),
                _state_spec(rows, g), _state_spec(rows, g)],
      out_specs=out_specs, interpret=interpret,
      compiler_params=compiler_params(launch, interpret),
      name="zebra_stripe_forward",
  )(x_proj, w_h, h0.astype(f32), c0.astype(f32))
  return outs[0], outs[1], outs[2], tuple(outs[3:])


def _backward(d_ys, gates, cs, c0, w_h, d_h, d_c, launch, interpret):
  """-> dz [S, T, B, 4G] f32, dh0, dc0 [S, B, G] f32."""
  s, t, b, g4 = gates.shape
  g = g4 // 4
  rows = launch.rows
  f32 = jnp.float32
  return pl.pallas_call(
      functools.partial(_backward_kernel, width=g, num_steps=t,
                        **_kernel_args(launch)),
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
      interpret=interpret,
      compiler_params=compiler_params(launch, interpret),
      name="zebra_stripe_backward",
  )(d_ys, gates, cs, c0.astype(f32), jnp.swapaxes(w_h, 1, 2), d_h, d_c)


# ------------------------------------------------------- the layer function


@functools.cache
def _fused_layer(launch, interpret):
  """scan.kernel_layer with this launch's forward and backward kernels
  (one per plan and mode: jax.custom_vjp functions are traced by identity)."""
  return scan.kernel_layer(
      lambda x_proj, h0, c0, w_h, keep: _forward(x_proj, h0, c0, w_h, launch,
                                                 keep, interpret),
      lambda *args: _backward(*args, launch, interpret))


def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False, *,
                interpret=None, budget=None, launch=None):
  """`scan.zebra_layer` with the time loop in a fused Pallas kernel.

  Same arguments and results: (outputs [S, T, B, G] in w_h's dtype, final
  h, final c). interpret: None = compiled on GPUs, interpret mode elsewhere
  (a one-time warning says it is slow). budget: register bytes per program
  (None = `register_budget`). launch: a `Plan` to run instead of
  `launch_plan`'s (tests). Shapes that do not fit run the scan, with one
  warning line.
  """
  interpret = interpret_mode(interpret, "pallas")
  s, b, g = h0.shape
  if launch is None:
    launch = launch_plan(b, g, w_h.dtype, triton=not interpret, budget=budget)
  if refused(launch, "pallas", h0, w_h):
    return scan.zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll, remat)
  return _fused_layer(launch, interpret)(inputs, w_x, bias, h0, c0, w_h,
                                         remat)


def interpret_mode(interpret, recurrence: str) -> bool:
  """interpret, or for None: compiled on GPUs, interpret mode elsewhere,
  where one warning line says it is slow (model.recurrence=`recurrence`)."""
  if interpret is not None:
    return bool(interpret)
  platform = jax.devices()[0].platform
  if platform == "gpu":
    return False
  scan.warn_once(
      f"model.recurrence={recurrence} on {platform}: the kernels run in "
      "Pallas interpret mode (exact but slow); use model.recurrence=scan off "
      "GPUs")
  return True


def refused(launch, recurrence: str, h0, w_h) -> bool:
  """Whether the plan refused this layer's shape (launch.rows is None):
  then one warning line says why and that the scan runs instead."""
  if launch.rows is not None:
    return False
  s, b, g = h0.shape
  scan.warn_once(
      f"model.recurrence={recurrence}: {launch.why}; running the scan "
      f"instead (S={s}, B={b}, G={g}, {jnp.dtype(w_h.dtype).name})")
  return True
