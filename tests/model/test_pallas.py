"""The fused Pallas stripe kernel against the scan it replaces.

The kernel runs in Pallas interpret mode here (CPU): outputs, final carry and
every gradient must equal `recurrence.zebra_layer` (the scan with its
hand-written backward pass, itself tested against autodiff), at the tiles a
GPU would run (16-row batch blocks, U_s held or streamed in blocks), in
float32 and bfloat16. Lowering for the GPU (Triton) backend, with the planned
number of warps, is checked without a GPU by exporting for CUDA.
"""

import logging
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.configs import base
from zebra_jax.model import lm
from zebra_jax.model.recurrence import pallas as pallas_recurrence
from zebra_jax.model.recurrence import scan as recurrence
from tests.helpers import (check_against_scan, check_runs_scan,
                           pallas_layer_grad, stripe_layer_args as _args,
                           triton_target)


def _pallas(launch, remat=False):
  return lambda *a: pallas_recurrence.zebra_layer(
      *a, 1, remat, interpret=True, launch=launch)


def _scan(remat=False):
  return lambda *a: recurrence.zebra_layer(*a, 1, remat)


def _check(args, launch, remat=False):
  """Kernel against scan (helpers.SCALED_ATOL); returns both results."""
  return check_against_scan(_pallas(launch, remat), args, remat)


def _launch(batch, width, dtype, strategy, k_chunk=None):
  """The plan a GPU would run (16 rows, Triton tiles), forced to one U_s
  strategy and optionally a smaller streamed block."""
  launch = pallas_recurrence.launch_plan(batch, width, dtype, triton=True,
                                         u_strategy=strategy)
  assert launch.rows == 16 and launch.u_strategy == strategy, launch
  return launch._replace(k_chunk=k_chunk) if k_chunk else launch


F32, BF16 = jnp.float32, jnp.bfloat16
CASES = [  # width, dtype, U_s strategy, k_chunk, batch, stripes, kind
    (16, F32, "held", None, 32, 2, "dense"),        # two batch blocks
    (32, F32, "streamed", 16, 16, 2, "grouped"),    # two U_s blocks per dot
    (32, BF16, "streamed", 16, 32, 2, "dense"),
    (64, F32, "held", None, 16, 2, "dense"),        # its own plan
    (64, BF16, "streamed", 16, 16, 2, "grouped"),   # four U_s blocks
    (128, BF16, "held", None, 16, 2, "grouped"),    # its own plan
    (128, F32, "streamed", None, 16, 1, "dense"),   # its own plan: k=64
]


@pytest.mark.parametrize("width,dtype,strategy,k_chunk,batch,stripes,kind",
                         CASES)
def test_matches_scan(width, dtype, strategy, k_chunk, batch, stripes, kind):
  """Outputs, final carry and every gradient equal the scan's."""
  args = _args(stripes, kind, dtype, seed=width, batch=batch, width=width)
  _check(args, _launch(batch, width, dtype, strategy, k_chunk))


def test_remat_matches_scan():
  """remat: the backward pass recomputes the gates from (c_t, outputs)."""
  args = _args(2, "dense", F32, seed=2, batch=32, width=32)
  _check(args, _launch(32, 32, F32, "streamed", 16), remat=True)


def test_bfloat16_is_not_float32():
  """The bf16 comparison is not vacuous: bf16 outputs are far from exact
  float32, the kernel's as much as the scan's."""
  args = _args(2, "grouped", BF16, seed=1, batch=16, width=16)
  got, _ = _check(args, _launch(16, 16, BF16, "held"))
  exact = jax.jit(_scan())(*[a.astype(F32) for a in args])
  err = np.abs(np.asarray(got[0][0], np.float32) - np.asarray(exact[0])).max()
  assert 1e-4 < err < 5e-2


def test_launch_plan():
  """The module docstring's table."""
  plan = pallas_recurrence.launch_plan
  P = pallas_recurrence.Plan  # pylint: disable=invalid-name
  assert plan(64, 128, BF16, triton=True) == P(16, 8, "held", 128)
  assert plan(128, 256, BF16, triton=True) == P(16, 8, "streamed", 64)
  assert plan(64, 64, F32, triton=True) == P(16, 4, "held", 64)
  assert plan(64, 128, F32, triton=True) == P(16, 8, "streamed", 64)
  assert pallas_recurrence.plan(128, 256, BF16, triton=True) == (16, "")
  # U_s held in registers: 128 KiB + 48 KiB of tiles = 176 registers a
  # thread at 8 warps, under 3/4 of 255; 352 at 4 warps is not.
  assert pallas_recurrence.register_budget(8) == 191 * 4 * 256
  # Nothing fits: the reason is short, one line, and says registers.
  rows, why = pallas_recurrence.plan(64, 512, BF16, triton=True)
  assert rows is None and "register budget" in why and len(why) < 120
  # Triton tiles: powers of two >= 16, batch in 16-row blocks.
  assert "power of two" in pallas_recurrence.plan(64, 48, BF16,
                                                  triton=True)[1]
  assert "multiple of 16" in pallas_recurrence.plan(8, 64, BF16,
                                                    triton=True)[1]
  # Interpret mode: any width, the largest batch block <= 16 dividing it.
  assert pallas_recurrence.plan(8, 4, F32, triton=False) == (8, "")
  assert pallas_recurrence.plan(48, 64, BF16, triton=False) == (16, "")


def test_plan_without_triton_backend(monkeypatch):
  """A jax without Pallas' Triton backend: the scan runs, and says why."""
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
  rows, why = pallas_recurrence.plan(64, 128, BF16, triton=True)
  assert rows is None and "no Pallas Triton backend" in why
  assert pallas_recurrence.plan(64, 128, BF16, triton=False)[0] == 16


def test_too_wide_falls_back_to_scan_with_one_warning(caplog):
  check_runs_scan(lambda *a: pallas_recurrence.zebra_layer(
      *a, 1, False, interpret=True, budget=64), _args(2, "dense", F32, seed=4),
                  caplog, "register budget")


@pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("width,batch,remat,strategy,warps", [
    (16, 16, False, "held", 4),
    (16, 16, True, "held", 4),
    (128, 32, False, "held", 8),      # the S=8 G=128 bf16 shapes' program
    (256, 32, False, "streamed", 8),  # the WikiText-103 recipe's program
])
def test_lowers_for_gpu_triton(width, batch, remat, strategy, warps):
  """Both kernels lower through Pallas' Triton backend (bf16, 16-row batch
  blocks, the planned warps), exported for CUDA on this CPU machine. jax >=
  0.11 warns that the backend is deprecated at every lowering."""
  launch = pallas_recurrence.launch_plan(batch, width, BF16, triton=True)
  assert (launch.u_strategy, launch.num_warps) == (strategy, warps)
  grad, specs = pallas_layer_grad(s=2, t=4, b=batch, g=width, n_in=32,
                                  dtype=BF16, remat=remat)
  fn = jax.jit(grad)
  with triton_target():
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
            "__gpu$xla.gpu.triton")])(*specs)
  module = exported.mlir_module()
  assert module.count("__gpu$xla.gpu.triton") == 2
  assert "zebra_stripe_forward" in module
  assert "zebra_stripe_backward" in module
  assert re.findall(r"num_warps = (\d+) : i32", module) == [str(warps)] * 2
  assert re.findall(r"num_stages = (\d+) : i32", module) == ["1"] * 2


@pytest.mark.parametrize("stripe_input,kernel", [
    ("dense", "pallas"), ("grouped", "pallas"), ("dense", "pallas_stream")])
def test_model_recurrence_pallas_trains_like_scan(stripe_input, kernel,
                                                  caplog):
  """model.recurrence=pallas (pallas_stream) reaches every layer of the LM:
  the loss and every parameter gradient equal model.recurrence=scan's, and
  off GPUs one warning line says the kernel runs in interpret mode."""
  def model_config(recurrence_kind):
    cfg = base.get_config().model
    cfg.update(vocab_size=16, embed_size=8, hidden_size=8, num_layers=2,
               num_stripes=2, dropout_hidden=0.0, dropout_output=0.0,
               stripe_input=stripe_input, recurrence=recurrence_kind)
    return cfg

  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 4)))
  carry = lm.init_carry(model_config("scan"), 2)

  def loss_and_grads(recurrence_kind):
    graphdef, params = lm.create(model_config(recurrence_kind), seed=0)

    def loss(params):
      sums, _ = lm.token_sums(graphdef, params, tokens[:, :-1], tokens[:, 1:],
                              carry, with_accuracy=False)
      return sums["loss_sum"] / sums["count"]
    return jax.jit(jax.value_and_grad(loss))(params)

  recurrence._warned.clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING):
    got = loss_and_grads(kernel)
  want = loss_and_grads("scan")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-6)
  # The kernel ran (not the scan): off GPUs it says so, once.
  lines = [r.getMessage() for r in caplog.records
           if "interpret mode" in r.getMessage()]
  assert len(lines) == (0 if jax.devices()[0].platform == "gpu" else 1)
