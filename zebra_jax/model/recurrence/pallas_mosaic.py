"""The stripe kernel's forward window on Pallas' Mosaic GPU backend.

The same forward as `pallas.py` (read its docstring first): one program per
(stripe, batch block) runs the stripe's whole window, h and c never leave
the chip between steps. jax 0.11 deprecated the Triton backend that
`pallas.py` lowers through; this is the Mosaic GPU version
(`plgpu.kernel`, jax.experimental.pallas.mosaic_gpu), one warpgroup (128
CUDA threads) per program:

  U_s^T in shared memory  copied once per window by TMA, [4G, G] in the
                          compute dtype (128 KiB at G=128 bf16)
  the step's matmul       on the tensor cores, wgmma from shared memory,
                          transposed so that the wide side is M:
                          z^T [4G, Bb] = U_s^T [4G, G] @ h^T [G, Bb]
                          (wgmma's M is 64 per warpgroup; N = Bb = 16
                          batch rows), accumulating in float32
  x_proj^T                one [4G, Bb] float32 tile a step by TMA, the
                          next step's fetched while this one computes (two
                          slots, one barrier each)
  gate math and carry     in registers, in the accumulator's layout; c^T
                          and h^T float32 are the loop's carry
  h^T                     written to shared memory every step in the
                          compute dtype: the next step's wgmma operand and,
                          by TMA, the step's output
  residuals               c_t and the gates by TMA from shared memory (the
                          gates through the x_proj slot they came from)

wgmma wants its two operands' swizzles equal, and h^T's rows are Bb = 16
bf16 (32 bytes): both take the 32-byte swizzle (U_s^T too; h^T cannot be
held as h [Bb, G] with a wider swizzle, as a register store into a
transposed swizzled view does not lower). Everything window-sized is
batch-minor inside the kernel ([S, T, 4G, B], [S, T, G, B]) so that a
step's tiles are the accumulator's [4G, Bb]; the wrapper transposes x_proj
and U_s in and ys, c_t and the gates out (XLA transposes, one pass over each
window). Its inputs, outputs and residuals are then exactly
`pallas._forward`'s, so the layer pairs it with the Triton backward kernel,
or with the scan's reverse loop where Triton is gone: there is no Mosaic
backward yet.

Shared memory at G=128 bf16, Bb=16: U_s 128 KiB + two x_proj slots 64 KiB +
c_t 8 KiB + h^T 4 KiB = 204 KiB of the H100's 227 KiB; G=64 takes 86 KiB.

Supported (`plan`): bf16 (wgmma reads h^T N-major, which float32's TF32
wgmma does not take), G in {64, 128} (G=256's U_s, 512 KiB, does not fit
shared memory: it would stream U_s or split it over a cluster), batch a
multiple of 16. Anything else: `plan` returns None with the reason.

Checked without a GPU, on jax 0.10.2 and 0.11.2: it exports for CUDA (the
Mosaic GPU lowering runs on a CPU machine), and Pallas' Mosaic GPU
interpret mode runs it on the CPU, where its outputs, residuals and (with
either backward) gradients equal the scan's
(tests/model/test_pallas_mosaic.py). The interpreter runs each TMA copy and
wgmma to completion when issued and ignores swizzles and registers: it
cannot show a missing wait or barrier, a layout the hardware reads
otherwise, or a program that spills. Its first run on a GPU compares it with
the scan before it is timed (lab/benchmarks/mosaic_rows.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zebra_jax.model.recurrence import pallas as pallas_recurrence
from zebra_jax.model.recurrence import scan

ROWS = 16           # batch rows per program: wgmma's N, the accumulator's
WIDTHS = (64, 128)  # G whose U_s fits shared memory with the step's tiles
SMEM_BYTES = 227 * 1024  # shared memory one block may take on an H100


def _plgpu():
  """jax.experimental.pallas.mosaic_gpu, imported where a kernel is built:
  the import takes 0.2 s that every importer of the model would pay."""
  from jax.experimental.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top
  return mosaic_gpu


def mosaic_missing() -> str:
  """"" if this jax has Pallas' Mosaic GPU kernel API, else why not."""
  try:
    plgpu = _plgpu()
  except ImportError:
    return f"jax {jax.__version__} has no Pallas Mosaic GPU backend"
  if not hasattr(plgpu, "kernel"):
    return f"jax {jax.__version__} has no plgpu.kernel"
  return ""


def smem_bytes(width: int, dtype, rows: int = ROWS) -> int:
  """Shared memory of one program: U_s, two x_proj slots, c_t and h^T."""
  itemsize = jnp.dtype(dtype).itemsize
  return (width * 4 * width * itemsize + 2 * 4 * width * rows * 4
          + width * rows * 4 + width * rows * itemsize)


def plan(batch: int, width: int, dtype) -> tuple[int | None, str]:
  """(batch rows per program, "") or (None, why this kernel cannot run)."""
  missing = mosaic_missing()
  if missing:
    return None, missing
  if jnp.dtype(dtype) != jnp.bfloat16:
    return None, (f"{jnp.dtype(dtype).name}: the Mosaic forward runs bf16 "
                  "only (wgmma reads h^T N-major; TF32 takes K-major only)")
  if width not in WIDTHS:
    return None, (f"stripe width G={width} is not one of {WIDTHS} (U_s must "
                  "fit shared memory)")
  if batch % ROWS:
    return None, f"batch {batch} is not a multiple of {ROWS} rows"
  if smem_bytes(width, dtype) > SMEM_BYTES:
    return None, f"G={width}: {smem_bytes(width, dtype) >> 10} KiB of SMEM"
  return ROWS, ""


def _swizzled(rows_bytes: int, itemsize: int):
  """The tiling and swizzle transforms of a shared-memory tile whose minor
  dimension is rows_bytes long (wgmma and TMA read these layouts)."""
  plgpu = _plgpu()
  swizzle = min(128, rows_bytes)
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _forward_kernel(x_hbm, h0_hbm, c0_hbm, w_hbm, ys_hbm, h_hbm, c_hbm,
                    *rest, width, num_steps, keep):
  """One stripe, one batch block, the whole window (batch-minor).

  x_hbm [S, T, 4G, B] f32, h0/c0 [S, G, B] f32, w_hbm U_s^T [S, 4G, G] -> ys
  [S, T, G, B] (w's dtype), h/c [S, G, B] f32; then cs [S, T, G, B] (keep
  "states" or "gates") and gates [S, T, 4G, B] (keep "gates"), f32; then
  the shared-memory scratch.
  """
  plgpu = _plgpu()
  saved = rest[:{None: 0, "states": 1, "gates": 2}[keep]]
  u_smem, x_smem, f32_smem, h_smem, barriers = rest[len(saved):]
  stripe = jax.lax.axis_index("stripe")
  slice_rows = pl.ds(jax.lax.axis_index("block") * ROWS, ROWS)

  def fetch_x(t, slot):
    plgpu.copy_gmem_to_smem(x_hbm.at[stripe, t, :, slice_rows],
                            x_smem.at[slot], barriers.at[slot])

  def read_state(state_hbm):
    """[G, Bb] float32 of a state input, through shared memory."""
    plgpu.copy_gmem_to_smem(state_hbm.at[stripe, :, slice_rows], f32_smem,
                            barriers.at[2])
    plgpu.barrier_wait(barriers.at[2])
    value = f32_smem[...]
    plgpu.commit_smem()  # every thread has read it before TMA writes again
    return value

  def write_state(value, out_hbm):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    f32_smem[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(f32_smem, out_hbm)

  plgpu.copy_gmem_to_smem(w_hbm.at[stripe], u_smem, barriers.at[3])
  fetch_x(0, 0)
  h0 = read_state(h0_hbm)
  c0 = read_state(c0_hbm)
  h_smem[...] = h0.astype(h_smem.dtype)
  plgpu.commit_smem()
  plgpu.barrier_wait(barriers.at[3])

  def step(t, hc):
    _, c = hc
    slot = t % 2
    # The last step's stores have read h^T, c_t and the other slot.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(t + 1 < num_steps)
    def _():
      fetch_x(t + 1, 1 - slot)

    def matmul(acc):
      plgpu.wgmma(acc, u_smem, h_smem)
      return acc[...]

    z = pl.run_scoped(matmul, plgpu.ACC((4 * width, ROWS), jnp.float32))
    plgpu.barrier_wait(barriers.at[slot])
    x_slot = x_smem.at[slot]
    z = z + x_slot[...]
    # sigmoid(x) = (1 + tanh(x / 2)) / 2: one tanh per gate, as the scan
    i, f, g, o = (z[k * width:(k + 1) * width] for k in range(4))
    i, f, o = (0.5 * jnp.tanh(0.5 * v) + 0.5 for v in (i, f, o))
    g = jnp.tanh(g)
    c = f * c + i * g
    h = o * jnp.tanh(c)
    # Each warp waited for its own share of the wgmma, which reads all of
    # h^T: every warp is past its wait before any overwrites it.
    plgpu.commit_smem()
    h_smem[...] = h.astype(h_smem.dtype)
    if keep is not None:
      f32_smem[...] = c
    if keep == "gates":
      for k, gate in enumerate((i, f, g, o)):
        x_slot[k * width:(k + 1) * width] = gate
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem, ys_hbm.at[stripe, t, :, slice_rows])
    if keep is not None:
      plgpu.copy_smem_to_gmem(f32_smem,
                              saved[0].at[stripe, t, :, slice_rows])
    if keep == "gates":
      plgpu.copy_smem_to_gmem(x_slot, saved[1].at[stripe, t, :, slice_rows])
    return h, c

  h, c = jax.lax.fori_loop(0, num_steps, step, (h0, c0))
  write_state(h, h_hbm.at[stripe, :, slice_rows])
  write_state(c, c_hbm.at[stripe, :, slice_rows])
  plgpu.wait_smem_to_gmem(0)


def _batch_minor(a):
  """[..., B, K] <-> [..., K, B]."""
  return jnp.swapaxes(a, -1, -2)


def has_interpreter() -> bool:
  """Whether this jax carries Mosaic GPU's interpreter (jax 0.10.2 and
  0.11.2 do; it is not public API, so a later jax may move it)."""
  try:
    interpret_params()
    return True
  except (ImportError, AttributeError):
    return False


def interpret_params():
  """Pallas' Mosaic GPU interpret mode (it simulates shared memory, TMA,
  barriers and wgmma on the CPU): the argument `plgpu.kernel` takes for it.
  `interpret=True` would run Pallas' generic interpreter instead, which has
  no rule for TMA copies."""
  plgpu = _plgpu()
  params = getattr(plgpu, "InterpretParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret  # pylint: disable=g-import-not-at-top
    params = interpret.InterpretGPUParams
  return params()


def forward(x_proj, h0, c0, w_h, keep, interpret=False):
  """`pallas._forward`'s function on Mosaic GPU: x_proj [S, T, B, 4G] f32 ->
  ys [S, T, B, G] (w_h's dtype), h, c [S, B, G] f32, and () / (cs,) /
  (cs, gates) for keep None / "states" / "gates". interpret: run in
  Mosaic GPU interpret mode (CPU)."""
  plgpu = _plgpu()
  s, t, b, g4 = x_proj.shape
  g = g4 // 4
  f32 = jnp.float32
  dtype = w_h.dtype
  itemsize = jnp.dtype(dtype).itemsize
  sds = jax.ShapeDtypeStruct
  # wgmma wants both operands' swizzles equal: h^T's rows are Bb elements
  operand_bytes = ROWS * itemsize
  out_type = [sds((s, t, g, b), dtype), sds((s, g, b), f32),
              sds((s, g, b), f32)]
  if keep is not None:
    out_type.append(sds((s, t, g, b), f32))
  if keep == "gates":
    out_type.append(sds((s, t, g4, b), f32))
  scratch = [
      plgpu.SMEM((g4, g), dtype,
                 transforms=_swizzled(operand_bytes, itemsize)),
      plgpu.SMEM((2, g4, ROWS), f32, transforms=_swizzled(4 * ROWS, 4)),
      plgpu.SMEM((g, ROWS), f32, transforms=_swizzled(4 * ROWS, 4)),
      plgpu.SMEM((g, ROWS), dtype,
                 transforms=_swizzled(operand_bytes, itemsize)),
      plgpu.Barrier(num_barriers=4),
  ]
  outs = plgpu.kernel(
      functools.partial(_forward_kernel, width=g, num_steps=t, keep=keep),
      out_type=out_type, scratch_types=scratch,
      grid=(s, b // ROWS), grid_names=("stripe", "block"),
      interpret=interpret_params() if interpret else None,
      kernel_name="zebra_stripe_forward_mosaic",
  )(_batch_minor(x_proj), _batch_minor(h0.astype(f32)),
    _batch_minor(c0.astype(f32)), _batch_minor(w_h))
  ys, h, c = (_batch_minor(a) for a in outs[:3])
  return ys, h, c, tuple(_batch_minor(a) for a in outs[3:])


# ------------------------------------------------------- the layer function


@functools.cache
def _mosaic_layer(interpret: bool, backward_launch):
  """scan.kernel_layer with this forward and, where backward_launch is a
  `pallas.Plan`, the Triton backward kernel; else the scan's reverse loop
  (one per mode and plan: custom_vjp functions are traced by identity)."""
  if backward_launch is None:
    backward = scan.reverse_window
  else:
    backward = lambda *args: pallas_recurrence._backward(  # pylint: disable=protected-access
        *args, backward_launch, interpret)
  return scan.kernel_layer(
      lambda x_proj, h0, c0, w_h, keep: forward(x_proj, h0, c0, w_h, keep,
                                                interpret),
      backward)


def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False, *,
                interpret=None, backward="triton"):
  """`scan.zebra_layer` with this module's forward kernel.

  Same arguments and results. interpret: None = compiled on GPUs, Mosaic GPU
  interpret mode elsewhere. backward: "triton" pairs it with `pallas.py`'s
  backward kernel (in Triton's interpret mode off GPUs; where this jax has
  no Triton backend, or the shape does not fit it, the scan's reverse loop
  runs instead), "scan" with the scan's reverse loop. Shapes `plan`
  refuses run the scan, with one warning line.
  """
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  s, b, g = h0.shape
  rows, why = plan(b, g, w_h.dtype)
  if rows is None:
    scan.warn_once(
        f"the Mosaic forward: {why}; running the scan instead (S={s}, B={b}, "
        f"G={g}, {jnp.dtype(w_h.dtype).name})")
    return scan.zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll, remat)
  launch = None
  if backward == "triton":
    launch = pallas_recurrence.launch_plan(b, g, w_h.dtype,
                                           triton=not interpret)
    launch = launch if launch.rows else None
  return _mosaic_layer(bool(interpret), launch)(inputs, w_x, bias, h0, c0,
                                                w_h, remat)
