"""The streaming per-step Pallas kernel against the scan it replaces.

In Pallas interpret mode (CPU): outputs, final carry and every gradient
equal `scan.zebra_layer`'s at the tiles a GPU would run (16 rows and 16
units a program, U_s streamed in chunks of its rows), at S=1 and at S>1
with a width the fused window kernel's plan refuses, remat on and off, in
float32 and bfloat16; a batch that is no multiple of 16 in interpret mode;
and lowering for the GPU (Triton) at the recipe's shapes, checked without a
GPU by exporting for CUDA.

Tolerance: helpers.SCALED_ATOL, the fused kernel's. The kernels'
arithmetic is the scan's; only float32 sums run in another order (a
program's dot sums U_s's rows in chunks of kc, then adds x_proj, where the
scan's XLA dot sums them at once and adds x_proj first), so a result
differs from the scan's in its last bits and those differences pass
through the later steps. Measured over the cases below, as a share of
max(1, max |reference|): <= 4.5e-7 in float32 (G=512; 2.3e-7 at G <= 32),
<= 1.8e-7 in bfloat16 at G <= 64, where no bfloat16 operand's rounding
flipped; the bounds (3e-6 in float32, 2.5e-4 plus one bfloat16 step,
2**-8 relative, in bfloat16) leave room for such a flip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model.recurrence import pallas as pallas_recurrence
from zebra_jax.model.recurrence import pallas_stream
from zebra_jax.model.recurrence import scan as recurrence
from tests.helpers import (check_against_scan, check_runs_scan,
                           pallas_layer_grad, stripe_layer_args as _args,
                           triton_target)

F32, BF16 = jnp.float32, jnp.bfloat16
Plan = pallas_stream.StreamPlan


def _stream(launch, remat=False, unroll=1):
  return lambda *a: pallas_stream.zebra_layer(
      *a, unroll, remat, interpret=True, launch=launch)


def _gpu_plan(batch, width, dtype, stripes, k_chunk=None):
  """The plan Triton would run, optionally with a smaller chunk (more
  chunks per dot at a small width)."""
  launch = pallas_stream.launch_plan(batch, width, dtype, triton=True,
                                     stripes=stripes)
  assert launch.rows == 16 and launch.units == 16, launch
  return launch._replace(k_chunk=k_chunk) if k_chunk else launch


CASES = [  # stripes, kind, width, batch, dtype, k_chunk, remat
    (1, "dense", 32, 32, F32, 16, False),     # 2 unit tiles x 2 batch blocks
    (1, "dense", 32, 32, F32, 16, True),
    (1, "grouped", 64, 16, BF16, 32, False),  # S=1 grouped: the dense LSTM
    (2, "grouped", 32, 16, BF16, None, True),
    (2, "dense", 16, 32, F32, None, False),
]


@pytest.mark.parametrize("stripes,kind,width,batch,dtype,k_chunk,remat",
                         CASES)
def test_matches_scan(stripes, kind, width, batch, dtype, k_chunk, remat):
  """Outputs, final carry and every gradient equal the scan's."""
  args = _args(stripes, kind, dtype, seed=width + stripes, batch=batch,
               width=width)
  launch = _gpu_plan(batch, width, dtype, stripes, k_chunk)
  check_against_scan(_stream(launch, remat), args, remat)


@pytest.mark.parametrize("remat", [False, True])
def test_a_width_the_window_kernel_refuses(remat):
  """S=2 at G=512: the fused window kernel's plan runs the scan (in float32
  and bfloat16 alike); the streaming kernel runs it (32 unit tiles of 16,
  U_s in chunks of 64). float32: over 512-unit sums a bfloat16 comparison
  drifts by a few roundings (two bfloat16 steps in d_w_x), the same
  kernel arithmetic that the small bfloat16 cases hold to one step."""
  batch, width = 16, 512
  for dtype in (F32, BF16):
    rows, why = pallas_recurrence.plan(batch, width, dtype, triton=True)
    assert rows is None and "register budget" in why
  args = _args(2, "grouped", F32, seed=5, batch=batch, width=width)
  launch = _gpu_plan(batch, width, F32, 2)
  assert launch.k_chunk == 64
  check_against_scan(_stream(launch, remat), args, remat)


@pytest.mark.parametrize("batch,launch", [
    (5, None),                    # interpret mode's own plan: 5 rows, 8 units
    (6, Plan(3, 4, 4, None)),     # two 3-row blocks, two 4-unit tiles
])
def test_a_batch_no_multiple_of_16(batch, launch):
  args = _args(1, "dense", F32, seed=batch, batch=batch, width=8)
  check_against_scan(_stream(launch, unroll=2), args)


def test_empty_window():
  args = _args(1, "dense", F32, batch=4, width=8)
  args = (args[0][:0],) + args[1:]
  got = jax.jit(_stream(None))(*args)
  want = recurrence.zebra_layer(*args, 1, False)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_launch_plan():
  """The module docstring's table."""
  plan = pallas_stream.launch_plan
  assert plan(128, 1024, BF16, triton=True) == Plan(64, 16, 64, 4)
  assert plan(128, 2048, BF16, triton=True) == Plan(128, 16, 64, 8)
  assert plan(64, 1024, BF16, triton=True) == Plan(32, 16, 64, 4)
  assert plan(128, 256, BF16, triton=True, stripes=8) == Plan(128, 16, 64, 8)
  # registers a thread of the table's programs
  for rows, warps, registers in ((64, 4, 112), (128, 8, 104), (32, 4, 64)):
    live = pallas_stream.live_bytes(rows, 16, 64, 2)
    assert live // (4 * 32 * warps) == registers
  # Triton's tiles: powers of two >= 16, batch in 16-row blocks
  assert "power of two" in plan(64, 48, BF16, triton=True).why
  assert "multiple of 16" in plan(8, 1024, BF16, triton=True).why
  # interpret mode: any batch and width
  assert plan(5, 24, F32, triton=False) == Plan(5, 12, 24, None)


def test_refused_plan_runs_the_scan_with_one_warning(caplog):
  check_runs_scan(lambda *a: pallas_stream.zebra_layer(
      *a, 1, False, interpret=True,
      launch=pallas_stream.launch_plan(8, 16, F32, triton=True)),
                  _args(1, "dense", F32, seed=4, batch=8, width=16), caplog,
                  "multiple of 16")


@pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("width,batch,remat,warps", [
    (1024, 128, False, 4),  # S=1 at the kernel stage's width
    (2048, 128, True, 8),   # S=1 at the WikiText-103 recipe's width
])
def test_lowers_for_gpu_triton(width, batch, remat, warps):
  """Both step kernels (the first and the looped one, forward and
  backward) lower through Pallas' Triton backend, exported for CUDA on this
  CPU machine; each step writes its windows in place (aliased)."""
  grad, specs = pallas_layer_grad(s=1, t=4, b=batch, g=width, n_in=64,
                                  dtype=BF16, remat=remat,
                                  kernel="pallas_stream")
  with triton_target():
    exported = jax.export.export(
        jax.jit(grad), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
            "__gpu$xla.gpu.triton")])(*specs)
  module = exported.mlir_module()
  assert module.count("__gpu$xla.gpu.triton") == 4
  assert module.count('name = "zebra_stream_forward"') == 2
  assert module.count('name = "zebra_stream_backward"') == 2
  assert f"num_warps = {warps} : i32" in module
  assert module.count("output_operand_alias<") >= 4
