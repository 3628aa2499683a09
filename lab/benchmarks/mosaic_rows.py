"""The kernel stage's row for the stripe kernel's Mosaic GPU forward
(zebra_jax/model/recurrence/pallas_mosaic.py), beside the Triton kernel's.

The row is the same core train step as zebra_pallas's, its forward window
on Mosaic GPU and its backward the Triton kernel's: against the Triton row
it times the difference of the two forwards. It runs in the bf16 groups of
S > 1 where `pallas_mosaic.plan` takes the stripe width (the GPU shape's
S=8, G=128). The CPU tests run the kernel only in Mosaic GPU interpret
mode, which simulates TMA, barriers and wgmma one at a time: before the row
is timed, its forward runs on the device against the scan's at the row's
shape, and a row whose outputs or residuals differ beyond TOLERANCE is an
error row (failed, not timed). Off GPUs there is no row: one line says it
is skipped.
"""

import jax
import jax.numpy as jnp
import numpy as np

from lab.benchmarks.steps import core_runner
from zebra_jax.model.recurrence import pallas_mosaic, scan

IMPL = "zebra_mosaic"
# max |kernel - scan| / max(1, max |scan|) per array, outputs and
# residuals. Both run bf16 products into float32 sums, the sums in another
# order and tanh of another library: a float32 h on a bf16 rounding
# boundary rounds the other way in one and the later steps carry that
# step (2**-7 relative at most; float32 arrays within 7e-6 after 3 steps
# in interpret mode, 2.2e-7 after 64 steps without a flip). A kernel that
# reads a stale slot, the wrong stripe or an unfinished copy is off by the
# values' own scale.
TOLERANCE = 2e-2


def candidates(shape, stripes: int, grouped: bool) -> list[tuple]:
  """[(impl, build or why the row cannot run, row's stripes)]: the row in
  the bf16 groups of S > 1 on a GPU, none elsewhere (off GPUs one line says
  it is skipped; an error row would lengthen the report's summary)."""
  if shape["dtype"] != "bfloat16" or stripes == 1:
    return []
  if jax.devices()[0].platform != "gpu":
    print(f"| {IMPL}_S{stripes} (bfloat16): skipped: Mosaic GPU kernels run "
          "on GPUs only (the CPU tests run it in interpret mode)", flush=True)
    return []
  rows, why = pallas_mosaic.plan(shape["batch"], shape["hidden"] // stripes,
                                 jnp.bfloat16)
  if rows is None:
    return [(IMPL, f"the Mosaic forward does not fit this shape: {why}",
             stripes)]
  return [(IMPL, lambda: checked_runner(shape, stripes, grouped), stripes)]


def forward_errors(shape, stripes: int, seed: int = 0,
                   interpret: bool = False) -> dict:
  """{array: max |kernel - scan| / max(1, max |scan|)} of the forward window
  at the row's shape on this device (ys, h, c and the residuals);
  interpret: the kernel in Mosaic GPU interpret mode (CPU tests)."""
  b, t, g = shape["batch"], shape["seq_len"], shape["hidden"] // stripes
  rng = np.random.default_rng(seed)
  normal = lambda shp, scale: jnp.asarray(scale * rng.standard_normal(shp),
                                          jnp.float32)
  window = (normal((stripes, t, b, 4 * g), 1.0),
            normal((stripes, b, g), 0.5), normal((stripes, b, g), 0.5),
            normal((stripes, g, 4 * g), 0.8 / np.sqrt(g)).astype(
                jnp.bfloat16))
  got = jax.jit(lambda *a: pallas_mosaic.forward(
      *a, "gates", interpret=interpret))(*window)
  want = jax.jit(lambda *a: scan._forward(*a, 1, "gates"))(*window)  # pylint: disable=protected-access
  ys, h, c, (cs, _, gates) = want
  errors = {}
  for name, g_arr, w_arr in zip(("ys", "h", "c", "cs", "gates"),
                                jax.tree.leaves(got), (ys, h, c, cs, gates)):
    g_arr = np.asarray(g_arr, np.float32)
    w_arr = np.asarray(w_arr, np.float32)
    errors[name] = float(np.abs(g_arr - w_arr).max()
                         / max(1.0, float(np.abs(w_arr).max())))
  return errors


def checked_runner(shape, stripes: int, grouped: bool):
  """The row's step, once its forward matches the scan's on the device
  (else RuntimeError: the row fails, with the largest error)."""
  errors = forward_errors(shape, stripes)
  beyond = [k for k, e in errors.items() if not e <= TOLERANCE]  # NaN too
  worst = beyond[0] if beyond else max(errors, key=errors.get)
  print(f"| {IMPL}_S{stripes}: forward against the scan, largest error "
        f"{worst} {errors[worst]:.1e} (tolerance {TOLERANCE:.0e})",
        flush=True)
  if beyond:
    raise RuntimeError(f"failed: outputs differ from the scan's: {worst} "
                       f"{errors[worst]:.2e} > {TOLERANCE:.0e}")
  return core_runner(shape, stripes, grouped=grouped, kernel="pallas_mosaic")
