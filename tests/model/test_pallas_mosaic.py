"""The Mosaic GPU forward of the stripe kernel against the scan.

Pallas' Mosaic GPU interpret mode runs the kernel on the CPU, shared memory,
TMA copies, barriers and wgmma simulated: its outputs and residuals must
equal the scan's forward, and paired with the Triton backward kernel (or the
scan's reverse loop) every gradient the scan's. Lowering for the GPU is
checked by exporting for CUDA at the GPU report's shape.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model.recurrence import pallas_mosaic
from zebra_jax.model.recurrence import scan
from tests.helpers import SCALED_ATOL, check_against_scan, stripe_layer_args

BF16 = jnp.bfloat16
needs_interpreter = pytest.mark.skipif(
    not pallas_mosaic.has_interpreter(),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpreter")


def _window(stripes, steps, batch, width, seed=0):
  """x_proj [S, T, B, 4G] f32, h0, c0 [S, B, G] f32, U_s [S, G, 4G] bf16
  scaled 1/sqrt(G) (gates off saturation)."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, scale=1.0: jnp.asarray(
      scale * rng.standard_normal(shape), jnp.float32)
  return (normal((stripes, steps, batch, 4 * width)),
          normal((stripes, batch, width), 0.5),
          normal((stripes, batch, width), 0.5),
          normal((stripes, width, 4 * width), 0.8 / np.sqrt(width)).astype(
              BF16))


def test_plan():
  """bf16, G in {64, 128}, batch in 16-row blocks; else why not."""
  assert pallas_mosaic.plan(64, 128, BF16) == (16, "")
  assert pallas_mosaic.plan(16, 64, BF16) == (16, "")
  for batch, width, dtype, says in [
      (64, 128, jnp.float32, "bf16 only"), (64, 256, BF16, "G=256"),
      (64, 32, BF16, "G=32"), (24, 128, BF16, "multiple of 16")]:
    rows, why = pallas_mosaic.plan(batch, width, dtype)
    assert rows is None and says in why and "\n" not in why, why
  # U_s, two x_proj slots, c_t and h^T fit an H100's shared memory at G=128
  assert pallas_mosaic.smem_bytes(128, BF16) == 204 * 1024


# Kernel against scan, max |error| / max(1, max |reference|): the bf16
# products are exact in float32 and only the order of their sums differs,
# so the float32 arrays (h, c, c_t, gates) agree to 1.8e-7 until a float32
# h on a bf16 rounding boundary rounds the other way in the outputs (one
# element in some cases, one bf16 step: 2**-7 relative at most, 8
# significant bits); the next steps' sums carry that step: up to 6.9e-6.
# Tolerances: one bf16 step on the outputs, and the Triton kernel's bf16
# bound against the scan (SCALED_ATOL, 2.5e-4) on the float32 arrays.
@pytest.mark.parametrize("keep,width,batch", [
    ("gates", 64, 32),    # two batch blocks, every residual
    ("states", 128, 16),  # the GPU report's stripe width
    (None, 64, 16),
])
@needs_interpreter
def test_forward_matches_scan_in_interpret_mode(keep, width, batch):
  window = _window(2, 3, batch, width, seed=width)
  got = jax.jit(lambda *a: pallas_mosaic.forward(*a, keep, interpret=True))(
      *window)
  ys, h, c, saved = scan._forward(*window, 1, keep)  # pylint: disable=protected-access
  # the scan also keeps h_{t-1} (saved[1]); the kernels' layer reads it
  # from the outputs
  want = [ys, h, c, *saved[:1], *saved[2:]]
  got = jax.tree.leaves(got)
  assert len(got) == len(want)
  for name, g, w in zip(["ys", "h", "c", "cs", "gates"], got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    rtol = 2.0**-7 if name == "ys" else 0.0
    np.testing.assert_allclose(g, w, rtol=rtol,
                               atol=SCALED_ATOL[jnp.dtype(BF16)]
                               * max(1.0, np.abs(w).max()),
                               err_msg=name)


@needs_interpreter
@pytest.mark.parametrize("backward,remat", [("triton", False),
                                            ("scan", True)])
def test_layer_gradients_match_scan(backward, remat):
  """The forward's residuals are the Triton forward's: paired with the
  Triton backward kernel (or the scan's reverse loop, recomputing the gates
  under remat), outputs and every gradient equal the scan's."""
  args = stripe_layer_args(2, "grouped", BF16, seed=3, batch=16, width=64)
  check_against_scan(lambda *a: pallas_mosaic.zebra_layer(
      *a, 1, remat, interpret=True, backward=backward), args, remat)


@pytest.mark.parametrize("keep", [None, "gates"])
def test_exports_for_cuda(keep):
  """The Mosaic GPU lowering runs without a GPU: the GPU report's shape
  (S=8, G=128, bf16, batch 64) exports for CUDA as one Mosaic GPU kernel."""
  window = _window(8, 4, 64, 128)
  fn = jax.jit(lambda *a: pallas_mosaic.forward(*a, keep))
  exported = jax.export.export(fn, platforms=["cuda"])(*window)
  module = exported.mlir_module()
  assert "mosaic_gpu" in module
  assert re.findall(r"custom_call @(\w+)", module) == ["mosaic_gpu_v2"]
  assert "zebra_stripe_forward_mosaic" in module
