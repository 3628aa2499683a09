"""A ZebraLSTM layer's time loops as one streaming Pallas kernel per step.

Why. The fused window kernel (`pallas.py`) keeps a stripe's h, c and step
tiles in one program's registers; past G=256 in bf16 they no longer fit
(S=1 at G=1024 or 2048: the [16, 4G] float32 gate tile alone is 256 or 512
KiB) and that layer runs the scan. The scan of a classic LSTM on an H100
costs ~23 us per layer-timestep where reading its 8 MiB bf16 recurrent
matrix takes ~2.5 us: it is bound by launches and latency (a cuBLAS dot and
elementwise fusions per step inside XLA's while loop), not by the matrix.
This module keeps XLA's loop over time but makes each step ONE kernel whose
grid tiles the hidden units: program (s, u, b) owns units [u*k, (u+1)*k) of
stripe s for batch rows [b*R, (b+1)*R), streams the four gate columns of
those units ([G, 4k] of U_s, from L2) and writes their c_t and h_t. The
step's whole state lives in global memory, so any width runs.

  forward step   z = h_{t-1}[rows] @ U_s[:, cols] + x_proj[t, rows, cols],
                 gates, c_t, h_t for the tile; h_{t-1} is the previous
                 step's output window (h0 at t = 0), so the kernel writes
                 straight into ys (and the saved c_t, gates) in place
  backward step  dh_t[tile] = dz_{t+1}[rows] @ U_s^T[:, tile] (the incoming
                 d_h at t = T-1), then dc, the tile's four dz columns
                 (written into the dz window in place) and dc_{t-1}

The backward step is one kernel, not two: dz_{t+1} is complete when step t
starts (the previous launch wrote it), so step t's matmul consumes it, and
dh never leaves the kernel. Recomputing dz for all units in every program
instead would read R x 8G floats of gates and states per program, ~16x the
bytes of its U_s slice at the shapes below; reading dz_{t+1} rows is the
plain GEMM operand traffic. dh0 = dz_0 U_s^T is one matmul after the loop.

Same function, conventions and residuals as `scan.zebra_layer`, through
`scan.kernel_layer` (the input projection, remat's recomputed gates and the
window gradients are the scan's); every window is passed whole to each
step's call with the step's index t as a one-element input, and the windows
a step writes are aliased to its outputs, so a step is one launch with no
slicing or stacking fusions around it.

Sizing (`launch_plan`, on Triton). k = 16 units a program (tl.dot needs N
>= 16); the contraction runs in chunks of kc = 64 rows of U_s (G when
smaller); R batch rows a program: the largest power of two <= 128 dividing
the batch, halved while the grid has fewer than 128 programs (an H100 has
132 SMs) and R > 16. Live values of a forward program, the larger of the
two: four [R, k] float32 accumulators, an [R, kc] h chunk, four [kc, k]
U_s chunks, ~6 [R, k] float32 tiles of gate math; as 32-bit registers a
thread at 4 warps, else 8, against `pallas.register_budget` (191 a thread).

  shape, bf16             R    programs        U_s slice a     registers a
                               (S x G/k x B/R)  program, step   thread
  S=1 G=1024 B=128        64   128             128 KiB         112 (4 warps)
  S=1 G=2048 B=128        128  128             256 KiB         104 (8 warps)
  S=1 G=1024 B=64         32   128             128 KiB          64 (4 warps)
  S=8 G=256  B=128        128  128              32 KiB         104 (8 warps)

Each step reads U_s once per batch block (B/R times: 16 MiB a step at
G=1024 B=128, 32 MiB at G=2048; both stay in the H100's 50 MiB L2) and
h_{t-1} (or dz_{t+1}) once per unit tile, the GEMM's operand traffic.
Expected on an H100 (not measured yet: the rows await a GPU,
lab/notes/gpu-report.md): a step's kernel bounded by its launch and the
loop's per-iteration cost (a few us) plus ~16-32 MiB of L2 reads (~3-6 us)
where the scan runs a cuBLAS dot and elementwise fusions per step; the
target is under half the scan's 23 us per layer-timestep.

Off GPUs the kernels run in Pallas interpret mode (exact, slow: what the
CPU tests use) with any batch and width; on Triton a batch not a multiple
of 16, or a width not a power of two >= 16, runs the scan with one warning
line, as `pallas.py` does.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zebra_jax.model.recurrence import pallas, scan

UNITS = 16          # units a program on Triton: tl.dot needs N >= 16
K_CHUNK = 64        # rows of U_s (or U_s^T) per dot
MAX_ROWS = 128      # batch rows a program at most
MIN_PROGRAMS = 128  # halve the rows until the grid has this many (132 SMs)


class StreamPlan(NamedTuple):
  """How a step runs: rows is None when the scan runs instead."""
  rows: int | None = None      # batch rows a program
  units: int | None = None     # hidden units a program
  k_chunk: int | None = None   # contraction rows per dot
  num_warps: int | None = None
  why: str = ""                # why the scan runs; "" when the kernel does


def _largest_divisor(n: int, at_most: int, pow2: bool = False) -> int:
  return max(d for d in range(1, min(n, at_most) + 1)
             if n % d == 0 and (not pow2 or d & (d - 1) == 0))


def live_bytes(rows: int, units: int, k_chunk: int, itemsize: int) -> int:
  """A forward program's live values (module docstring); the backward
  program's are fewer."""
  f32 = 4
  return (4 * rows * units * f32 + rows * k_chunk * itemsize
          + 4 * k_chunk * units * itemsize + 6 * rows * units * f32)


def launch_plan(batch: int, width: int, dtype, *, triton: bool,
                stripes: int = 1) -> StreamPlan:
  """Rows, units, chunk and warps of one program (module docstring).

  Off Triton (interpret mode): any batch and width, the largest divisors
  <= 16 rows, 16 units and 64 chunk rows."""
  itemsize = jnp.dtype(dtype).itemsize
  if not triton:
    return StreamPlan(_largest_divisor(batch, 16),
                      _largest_divisor(width, UNITS),
                      _largest_divisor(width, K_CHUNK), None)
  missing = pallas.triton_missing()
  if missing:
    return StreamPlan(why=missing)
  if not (width >= UNITS and width & (width - 1) == 0):
    return StreamPlan(why=f"stripe width G={width} is not a power of two >= "
                      f"{UNITS}")
  if batch % 16:
    return StreamPlan(why=f"batch {batch} is not a multiple of 16 rows")
  rows = _largest_divisor(batch, MAX_ROWS, pow2=True)
  while rows > 16 and stripes * (width // UNITS) * (batch // rows) < (
      MIN_PROGRAMS):
    rows //= 2
  k_chunk = min(width, K_CHUNK)
  live = live_bytes(rows, UNITS, k_chunk, itemsize)
  for warps in (4, 8):
    if live <= pallas.register_budget(warps):
      return StreamPlan(rows, UNITS, k_chunk, warps)
  return StreamPlan(why=f"{rows}-row tiles exceed the register budget")


def describe(p: StreamPlan) -> str:
  """One short label: 'stream: 64 rows, 16 units, 4 warps' or 'scan: why'."""
  if p.rows is None:
    return f"scan: {p.why}"
  warps = f", {p.num_warps} warps" if p.num_warps else ""
  return f"stream: {p.rows} rows, {p.units} units{warps}"


# ---------------------------------------------------------------- kernels


def _gate_columns(width, units, gate, tile):
  """Gate `gate`'s columns of unit tile `tile` in a [.., 4G] row."""
  return pl.ds(pl.multiple_of(gate * width + tile * units, units), units)


def _unit_columns(units, tile):
  """Unit tile `tile`'s columns in a [.., G] row."""
  return pl.ds(pl.multiple_of(tile * units, units), units)


def _chunked_dots(load_a, load_w, num_chunks, shape, num_out):
  """sum_j load_a(j) @ load_w(j, n) for n < num_out, each [rows, units]
  (shape) in float32: one [rows, kc] A chunk shared by a chunk's dots."""
  def body(j, accs):
    a = load_a(j)
    return tuple(acc + jnp.dot(a, load_w(j, n),
                               preferred_element_type=jnp.float32)
                 for n, acc in enumerate(accs))

  zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in range(num_out))
  return jax.lax.fori_loop(0, num_chunks, body, zeros)


def _chunk(j, k_chunk):
  return pl.ds(pl.multiple_of(j * k_chunk, k_chunk), k_chunk)


def _forward_step_kernel(t_ref, x_ref, w_ref, h0_ref, c_ref, *refs, width,
                         units, k_chunk, num_windows, first):
  """Step t of one stripe's unit tile and batch block.

  t_ref [1] int32; x_ref [T, R, 4G] f32; w_ref U_s [G, 4G]; h0_ref [R, G]
  f32 (read at t = 0 only); c_ref [R, k] f32, c_{t-1}. refs: the windows
  as inputs (ys [T, R, G], read at t - 1 as h_{t-1}; then cs [T, R, G] and
  gates [T, R, 4G] f32 as kept), the same windows aliased as outputs
  (written at t), then h_t and c_t [R, k] f32.
  """
  ys_in_ref = refs[0]
  out_refs = refs[num_windows:]
  ys_ref, saved_refs = out_refs[0], out_refs[1:num_windows]
  h_ref, c_out_ref = out_refs[num_windows:]
  t, tile = t_ref[0], pl.program_id(1)  # outside the loops: interpret mode
  dt = w_ref.dtype
  gate_columns = functools.partial(_gate_columns, width, units, tile=tile)

  def load_h(j):
    if first:
      return h0_ref[:, _chunk(j, k_chunk)].astype(dt)
    return ys_in_ref[t - 1, :, _chunk(j, k_chunk)].astype(dt)

  def load_w(j, gate):
    return w_ref[_chunk(j, k_chunk), gate_columns(gate)]

  z = _chunked_dots(load_h, load_w, width // k_chunk, c_ref.shape, 4)
  z = [zk + x_ref[t, :, gate_columns(k)]
       for k, zk in enumerate(z)]
  i, f, o = jax.nn.sigmoid(z[0]), jax.nn.sigmoid(z[1]), jax.nn.sigmoid(z[3])
  g = jnp.tanh(z[2])
  c = f * c_ref[...] + i * g
  h = o * jnp.tanh(c)
  units_of_tile = _unit_columns(units, tile)
  ys_ref[t, :, units_of_tile] = h.astype(ys_ref.dtype)
  if saved_refs:
    saved_refs[0][t, :, units_of_tile] = c
  if len(saved_refs) > 1:
    for k, gate in enumerate((i, f, g, o)):
      saved_refs[1][t, :, gate_columns(k)] = gate
  h_ref[...] = h
  c_out_ref[...] = c


def _backward_step_kernel(t_ref, dy_ref, gates_ref, cs_ref, c0_ref, wt_ref,
                          dh_last_ref, dc_ref, dz_in_ref, dz_ref, dc_out_ref,
                          *, width, units, k_chunk, last):
  """Reverse step t of one stripe's unit tile and batch block.

  dy_ref [T, R, G]; gates_ref [T, R, 4G] f32; cs_ref [T, R, G] f32; c0_ref
  [R, k] f32; wt_ref U_s^T [4G, G]; dh_last_ref [R, k] f32, the final h's
  cotangent (read at t = T-1 only); dc_ref [R, k] f32, dc_t from the later
  steps; dz_in_ref / dz_ref the dz window [T, R, 4G] f32, read at t + 1 and
  written at t (aliased) -> dc_out_ref [R, k], dc_{t-1}.
  """
  t, tile = t_ref[0], pl.program_id(1)  # outside the loops: interpret mode
  dt = wt_ref.dtype
  gate_columns = functools.partial(_gate_columns, width, units, tile=tile)
  units_of_tile = _unit_columns(units, tile)
  if last:
    dh = dh_last_ref[...]
  else:  # dh_t = dz_{t+1} U_s^T, this tile's columns
    (dh,) = _chunked_dots(
        lambda j: dz_in_ref[t + 1, :, _chunk(j, k_chunk)].astype(dt),
        lambda j, _: wt_ref[_chunk(j, k_chunk), units_of_tile],
        4 * width // k_chunk, dc_ref.shape, 1)
  i, f, g, o = (gates_ref[t, :, gate_columns(k)]
                for k in range(4))
  c_t = cs_ref[t, :, units_of_tile]
  c_prev = jnp.where(t > 0, cs_ref[jnp.maximum(t - 1, 0), :, units_of_tile],
                     c0_ref[...])
  tanh_c = jnp.tanh(c_t)
  dh = dh + dy_ref[t, :, units_of_tile].astype(jnp.float32)
  dc = dc_ref[...] + dh * (o * (1.0 - tanh_c * tanh_c))
  dz = (dc * (g * i * (1.0 - i)), dc * (c_prev * f * (1.0 - f)),
        dc * (i * (1.0 - g * g)), dh * (tanh_c * o * (1.0 - o)))
  for k, dz_k in enumerate(dz):
    dz_ref[t, :, gate_columns(k)] = dz_k
  dc_out_ref[...] = dc * f


# ------------------------------------------------------------ the loops


def _specs(num_steps, rows, units):
  """BlockSpecs over the grid (stripe s, unit tile u, batch block b)."""
  sq = pl.squeezed
  return dict(
      step=pl.BlockSpec((1,), lambda s, u, b: (0,)),
      window=lambda cols: pl.BlockSpec((sq, num_steps, rows, cols),
                                       lambda s, u, b: (s, 0, b, 0)),
      rows=lambda cols: pl.BlockSpec((sq, rows, cols),
                                     lambda s, u, b: (s, b, 0)),
      tile=pl.BlockSpec((sq, rows, units), lambda s, u, b: (s, b, u)),
      weight=lambda shape: pl.BlockSpec((sq, *shape),
                                        lambda s, u, b: (s, 0, 0)))


def _step_call(kernel, launch, interpret, grid, name, in_specs, windows,
               window_specs, num_states, state_spec, state_shape):
  """One step's pallas_call: inputs (in_specs, then the windows), outputs
  the windows (aliased: written in place) and num_states [S, B, k]-tiled
  float32 states."""
  num_in = len(in_specs)
  return pl.pallas_call(
      kernel, grid=grid, interpret=interpret, name=name,
      out_shape=[jax.ShapeDtypeStruct(w.shape, w.dtype) for w in windows]
      + [jax.ShapeDtypeStruct(state_shape, jnp.float32)] * num_states,
      in_specs=in_specs + window_specs,
      out_specs=window_specs + [state_spec] * num_states,
      input_output_aliases={num_in + j: j for j in range(len(windows))},
      compiler_params=pallas.compiler_params(launch, interpret))


def _step_index(t):
  return jnp.reshape(t, (1,)).astype(jnp.int32)


def _forward(x_proj, h0, c0, w_h, launch, keep, interpret, unroll):
  """x_proj [S, T, B, 4G] f32 -> ys [S, T, B, G] (w_h's dtype), h, c [S, B,
  G] f32 and () / (cs,) / (cs, gates) for keep None / "states" / "gates":
  step 0 reads h0, then a loop over t = 1 .. T-1, one kernel a step."""
  s, t_len, b, g4 = x_proj.shape
  g = g4 // 4
  f32 = jnp.float32
  h0, c0 = h0.astype(f32), c0.astype(f32)
  widths = [(g, w_h.dtype)] + {None: [], "states": [(g, f32)],
                               "gates": [(g, f32), (g4, f32)]}[keep]
  windows = [jnp.zeros((s, t_len, b, n), d) for n, d in widths]
  if t_len == 0:
    return windows[0], h0, c0, tuple(windows[1:])
  rows, units = launch.rows, launch.units
  sp = _specs(t_len, rows, units)
  window_specs = [sp["window"](n) for n, _ in widths]

  def step(t, windows, c_prev, first):
    kernel = functools.partial(
        _forward_step_kernel, width=g, units=units, k_chunk=launch.k_chunk,
        num_windows=len(widths), first=first)
    out = _step_call(
        kernel, launch, interpret, (s, g // units, b // rows),
        "zebra_stream_forward",
        [sp["step"], sp["window"](g4), sp["weight"]((g, g4)), sp["rows"](g),
         sp["tile"]], windows, window_specs, 2, sp["tile"], (s, b, g),
    )(_step_index(t), x_proj, w_h, h0, c_prev, *windows)
    return list(out[:-2]), out[-2], out[-1]

  windows, h, c = step(jnp.int32(0), windows, c0, first=True)
  windows, h, c = jax.lax.fori_loop(
      1, t_len, lambda t, carry: step(t, carry[0], carry[2], first=False),
      (windows, h, c), unroll=unroll)
  return windows[0], h, c, tuple(windows[1:])


def _backward(d_ys, gates, cs, c0, w_h, d_h, d_c, launch, interpret, unroll):
  """-> dz [S, T, B, 4G] f32, dh0, dc0 [S, B, G] f32: step T-1 starts from
  d_h, then a loop down to t = 0, one kernel a step; dh0 = dz_0 U_s^T."""
  s, t_len, b, g4 = gates.shape
  g = g4 // 4
  f32 = jnp.float32
  if t_len == 0:
    return jnp.zeros((s, 0, b, g4), f32), d_h, d_c
  rows, units = launch.rows, launch.units
  sp = _specs(t_len, rows, units)
  w_t = jnp.swapaxes(w_h, 1, 2)  # [S, 4G, G]: a unit tile's columns

  def step(t, dz, dc, last):
    kernel = functools.partial(
        _backward_step_kernel, width=g, units=units, k_chunk=launch.k_chunk,
        last=last)
    dz, dc = _step_call(
        kernel, launch, interpret, (s, g // units, b // rows),
        "zebra_stream_backward",
        [sp["step"], sp["window"](g), sp["window"](g4), sp["window"](g),
         sp["tile"], sp["weight"]((g4, g)), sp["tile"], sp["tile"]],
        [dz], [sp["window"](g4)], 1, sp["tile"], (s, b, g),
    )(_step_index(t), d_ys, gates, cs, c0.astype(f32), w_t, d_h, dc, dz)
    return dz, dc

  dz = jnp.zeros((s, t_len, b, g4), f32)
  dz, dc = step(jnp.int32(t_len - 1), dz, d_c, last=True)
  dz, dc = jax.lax.fori_loop(
      0, t_len - 1,
      lambda j, carry: step(t_len - 2 - j, *carry, last=False), (dz, dc),
      unroll=unroll)
  dh0 = jnp.einsum("sbk,skg->sbg", dz[:, 0].astype(w_h.dtype), w_t,
                   preferred_element_type=f32)
  return dz, dh0, dc


# ------------------------------------------------------- the layer function


@functools.cache
def _stream_layer(launch, interpret, unroll):
  """scan.kernel_layer with this launch's step kernels (one per plan, mode
  and unroll: jax.custom_vjp functions are traced by identity)."""
  return scan.kernel_layer(
      lambda x_proj, h0, c0, w_h, keep: _forward(
          x_proj, h0, c0, w_h, launch, keep, interpret, unroll),
      lambda *args: _backward(*args, launch, interpret, unroll))


def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False, *,
                interpret=None, launch=None):
  """`scan.zebra_layer` with each time step one streaming Pallas kernel.

  Same arguments and results: (outputs [S, T, B, G] in w_h's dtype, final
  h, final c). unroll: the time loops' unroll factor, as the scan's.
  interpret: None = compiled on GPUs, interpret mode elsewhere (a one-time
  warning says it is slow). launch: a `StreamPlan` to run instead of
  `launch_plan`'s (tests). Shapes the plan refuses run the scan, with one
  warning line.
  """
  interpret = pallas.interpret_mode(interpret, "pallas_stream")
  s, b, g = h0.shape
  if launch is None:
    launch = launch_plan(b, g, w_h.dtype, triton=not interpret, stripes=s)
  if pallas.refused(launch, "pallas_stream", h0, w_h):
    return scan.zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll, remat)
  return _stream_layer(launch, interpret, unroll)(
      inputs, w_x, bias, h0, c0, w_h, remat)
