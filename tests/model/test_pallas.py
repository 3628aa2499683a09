"""The fused Pallas stripe kernel against the scan it replaces.

The kernel runs in Pallas interpret mode here (CPU): outputs, final carry and
every gradient must equal `recurrence.zebra_layer` (the scan with its
hand-written backward pass, itself tested against autodiff). Lowering for
the GPU (Triton) backend is checked without a GPU by exporting for CUDA.
"""

import contextlib
import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from zebra_jax.model import lm, pallas_recurrence, recurrence

T, B, G, IN = 3, 4, 4, 8  # window, batch, stripe width, layer input


def _normal(rng, shape, scale=1.0):
  return (scale * rng.standard_normal(shape)).astype(np.float32)


def _args(stripes, kind, dtype, seed=0, batch=B, width=G):
  """Layer arguments as ZebraLSTMLayer passes them (see recurrence.py).

  NumPy draws them: jax.random would compile a kernel per shape."""
  rng = np.random.default_rng(seed)
  s, g = stripes, width
  if kind == "dense":
    inputs = _normal(rng, (T, batch, IN))
    w_x = _normal(rng, (IN, s, 4 * g), 0.4)
  else:  # grouped: stripe s reads its own IN/S inputs
    inputs = _normal(rng, (s, T, batch, IN // s))
    w_x = _normal(rng, (s, IN // s, 4 * g), 0.4)
  bias = _normal(rng, (s, 4 * g), 0.2)
  h0 = _normal(rng, (s, batch, g), 0.5)
  c0 = _normal(rng, (s, batch, g), 0.5)
  w_h = _normal(rng, (s, g, 4 * g), 0.4)
  return (jnp.asarray(inputs, dtype), jnp.asarray(w_x, dtype),
          jnp.asarray(bias), jnp.asarray(h0), jnp.asarray(c0),
          jnp.asarray(w_h, dtype))


def _value_and_grads(layer_fn, args, cotangents):
  """(ys, h, c) and the gradients of every argument for the given
  cotangents of ys, h and c."""
  outs, vjp = jax.vjp(layer_fn, *args)
  return outs, vjp(tuple(ct.astype(o.dtype)
                         for ct, o in zip(cotangents, outs)))


def _cotangents(args):
  """Fixed random weights for ys [S, T, B, G], h and c [S, B, G]: no
  gradient path is zero or symmetric."""
  s, b, g = args[3].shape
  rng = np.random.default_rng(7)
  return tuple(jnp.asarray(_normal(rng, shape)) for shape in
               ((s, T, b, g), (s, b, g), (s, b, g)))


# On-chip budget that holds U_s and two batch rows: batch 4 runs as two
# programs per stripe, so every test also checks that the grid covers each
# (stripe, batch block) once.
TWO_ROWS = G * 4 * G * 4 + 2 * 6 * G * 4


def _pallas(remat=False, budget=TWO_ROWS):
  return lambda *a: pallas_recurrence.zebra_layer(
      *a, 1, remat, interpret=True, budget=budget)


def _scan(remat=False):
  return lambda *a: recurrence.zebra_layer(*a, 1, remat)


def _check(args, remat=False, rtol=1e-5, atol_frac=1e-6):
  """Kernel against scan; returns both results."""
  cts = _cotangents(args)
  got = jax.jit(lambda a, c: _value_and_grads(_pallas(remat), a, c))(args, cts)
  want = jax.jit(lambda a, c: _value_and_grads(_scan(remat), a, c))(args, cts)
  _compare(got, want, rtol, atol_frac)
  return got, want


def _compare(got, want, rtol, atol_frac):
  """Each array close to its reference; atol scales with the reference."""
  names = ["ys", "h", "c", "d_inputs", "d_w_x", "d_bias", "d_h0", "d_c0",
           "d_w_h"]
  for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert g.shape == w.shape, name
    atol = atol_frac * max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("kind", ["dense", "grouped"])
@pytest.mark.parametrize("stripes", [1, 2, 4, 8])
def test_matches_scan_float32(stripes, kind):
  assert pallas_recurrence.plan(B, G, jnp.float32, triton=False,
                                budget=TWO_ROWS) == (2, "")
  _check(_args(stripes, kind, jnp.float32))


def test_matches_scan_bfloat16():
  """bf16 matmuls, f32 cell state: the same arithmetic in the same order,
  so only rounding of the bf16 operands may differ."""
  args = _args(8, "grouped", jnp.bfloat16, seed=1)
  got, _ = _check(args, rtol=2e-2, atol_frac=2e-2)
  # Bounded, and not vacuous: the bf16 outputs are far from exact fp32.
  exact = jax.jit(_scan())(*[a.astype(jnp.float32) for a in args])
  bf16_err = np.abs(np.asarray(got[0][0], np.float32)
                    - np.asarray(exact[0])).max()
  assert 1e-4 < bf16_err < 5e-2


def test_remat_matches_scan():
  """remat: the backward pass recomputes the gates from (c_t, outputs)."""
  _check(_args(4, "dense", jnp.float32, seed=2), remat=True)


def test_plan_from_on_chip_memory():
  kib = 1 << 10
  h100 = 227 * kib
  # bf16 U_s at G=128 is 128 KiB: fits an H100, next to a 32-row batch
  # block's one-step tiles (32 x 6G floats = 96 KiB; 64 rows would not).
  assert pallas_recurrence.plan(256, 128, jnp.bfloat16, triton=True,
                                budget=h100) == (32, "")
  # fp32 U_s at G=128 is 256 KiB: does not.
  rows, why = pallas_recurrence.plan(64, 128, jnp.float32, triton=True,
                                     budget=h100)
  assert rows is None and "256 KiB" in why and "227 KiB" in why
  # Triton tiles are powers of two >= 16.
  assert pallas_recurrence.plan(64, 48, jnp.bfloat16, triton=True,
                                budget=h100)[0] is None
  assert pallas_recurrence.plan(8, 64, jnp.bfloat16, triton=True,
                                budget=h100)[0] is None
  assert pallas_recurrence.plan(8, 64, jnp.bfloat16, triton=False,
                                budget=h100) == (8, "")
  # Batch 48 on Triton: the largest power-of-two block dividing it is 16.
  assert pallas_recurrence.plan(48, 64, jnp.bfloat16, triton=True,
                                budget=h100) == (16, "")


def test_too_wide_falls_back_to_scan_with_one_warning(caplog):
  args = _args(2, "dense", jnp.float32, seed=4)
  with caplog.at_level(logging.WARNING):
    got = pallas_recurrence.zebra_layer(*args, 1, False, interpret=True,
                                        budget=64)
  want = recurrence.zebra_layer(*args, 1, False)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  lines = [r.getMessage() for r in caplog.records
           if "running the scan instead" in r.getMessage()]
  assert len(lines) == 1 and "on-chip budget" in lines[0]
  assert "\n" not in lines[0]


def _triton_target():
  """jax >= 0.11 lowers Triton kernels without a GPU only for a named
  abstract GPU; jax 0.10 lowers for a default one."""
  mesh_params = inspect.signature(jax.sharding.AbstractMesh).parameters
  if "abstract_device" not in mesh_params:
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100",
                                       num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=device))


@pytest.mark.parametrize("remat", [False, True])
def test_lowers_for_gpu_triton(remat):
  """Both kernels lower through Pallas' Triton backend (bf16, G=16, batch
  block 16), exported for CUDA on this CPU machine."""
  s, t, b, g, n_in = 4, 4, 16, 16, 32
  sds = jax.ShapeDtypeStruct
  bf16, f32 = jnp.bfloat16, jnp.float32
  specs = (sds((t, b, n_in), bf16), sds((n_in, s, 4 * g), bf16),
           sds((s, 4 * g), f32), sds((s, b, g), f32), sds((s, b, g), f32),
           sds((s, g, 4 * g), bf16))

  def loss(*a):
    ys, h, c = pallas_recurrence.zebra_layer(*a, 1, remat, interpret=False,
                                             budget=227 << 10)
    return jnp.sum(ys.astype(f32)) + jnp.sum(h) + jnp.sum(c)

  fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))
  with _triton_target():
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
            "__gpu$xla.gpu.triton")])(*specs)
  module = exported.mlir_module()
  assert module.count("__gpu$xla.gpu.triton") == 2
  assert "zebra_stripe_forward" in module
  assert "zebra_stripe_backward" in module


@pytest.mark.parametrize("stripe_input", ["dense", "grouped"])
def test_model_recurrence_pallas_trains_like_scan(stripe_input, caplog):
  """model.recurrence=pallas reaches every layer of the LM: the loss and
  every parameter gradient equal model.recurrence=scan's, and off GPUs one
  warning line says the kernel runs in interpret mode."""
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

  pallas_recurrence._warned.clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING):
    got = loss_and_grads("pallas")
  want = loss_and_grads("scan")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-6)
  # The kernel ran (not the scan): off GPUs it says so, once.
  lines = [r.getMessage() for r in caplog.records
           if "interpret mode" in r.getMessage()]
  assert len(lines) == (0 if jax.devices()[0].platform == "gpu" else 1)
