"""model.cpu_bf16_head: the full head's matmuls in bf16 on a CPU's bf16 units.

Where this CPU has AVX512_BF16 and a compiler, the kernel must run (a
failure to build or load it fails, never skips): its products against the
float32 ones within the error bound of rounding both operands to bf16, and
an LM's loss within the bf16 precision the GPU report measures. Everywhere,
the float32 path: with the setting off, with a library built for x86-64-v3
(which must not have the kernel compiled in), on a CPU that lacks the
units, the head is the float32 program, bitwise.
"""

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zebra_jax.model import cpu_bf16_head, lm
from zebra_jax.model.recurrence import native as native_recurrence
from zebra_jax.model.recurrence import native_build, native_check
from tests.helpers import (BF16_LOSS_TOLERANCE, HAS_BF16_UNITS,
                           needs_bf16_units, needs_compiler)

on_x86 = pytest.mark.skipif(platform.machine() != "x86_64",
                            reason="x86-64-v3 is an x86-64 target")



def _bf16(a):
  return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32),
                    np.float64)


def _bound(a, b, k):
  """|op(a) op(b) in float32 - the kernel's| <= this, elementwise: each
  operand rounded to bf16 (8 significant bits) is off by at most 2^-8 of
  itself (a product by 2^-7 + 2^-16), and k float32 sums add k x 2^-24 of
  |a||b|."""
  return (2.0 ** -7 + 2.0 ** -16 + k * 2.0 ** -24) * (np.abs(a) @ np.abs(b))


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("n,h,v", [(37, 33, 51), (64, 128, 300), (3, 1, 17),
                                   (40, 36, 1100)])
def test_products_are_float32_within_the_bf16_rounding(this_cpus_build, tied,
                                                       n, h, v):
  """logits and both gradients: within the bound of the operands' rounding
  of the float32 products, and within float32 sums' error of the exact
  products of the bf16-rounded operands (odd K and N: a zero-padded pair,
  a partial 16-column panel, fewer rows than a register block; d_x's K of
  1,100 words: two passes over K, the second adding to the first, in a
  last panel of 4 columns, which runs in 256-bit registers)."""
  assert not cpu_bf16_head.unavailable(), cpu_bf16_head.unavailable()
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, h)).astype(np.float32)
  w = rng.standard_normal((v, h) if tied else (h, v)).astype(np.float32)
  g = rng.standard_normal((n, v)).astype(np.float32)
  logits, vjp = jax.vjp(lambda x, w: cpu_bf16_head.logits(x, w, tied), x, w)
  d_x, d_w = vjp(jnp.asarray(g))
  w_vh = w if tied else w.T  # [V, H]
  cases = {"logits": (logits, x, w_vh.T, h),
           "d_x": (d_x, g, w_vh, v),
           "d_w": (d_w, *((g.T, x) if tied else (x.T, g)), n)}
  for name, (got, a, b, k) in cases.items():
    got = np.asarray(got, np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.all(np.abs(got - exact) <= _bound(a, b, k)), name
    rounded = _bf16(a) @ _bf16(b)
    sums = (k * 2.0 ** -24) * (np.abs(_bf16(a)) @ np.abs(_bf16(b)))
    assert np.all(np.abs(got - rounded) <= sums + 1e-30), name


@needs_compiler
@needs_bf16_units
def test_any_thread_count_gives_the_same_bits(this_cpus_build, monkeypatch):
  """Threads split the rows; each element sums its pairs in one order."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((150, 40)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((70, 40)), jnp.float32)
  run = lambda: jax.jit(lambda x, w: jax.vjp(
      lambda x, w: cpu_bf16_head.logits(x, w, True), x, w)[1](
          jnp.ones((150, 70), jnp.float32)))(x, w)
  monkeypatch.setattr(native_recurrence, "threads", lambda flops: 1)
  one = run()
  monkeypatch.setattr(native_recurrence, "threads", lambda flops: 7)
  for a, b in zip(one, run()):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _model_cfg(setting, tied=True):
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  cfg = base.get_config().model
  cfg.update(vocab_size=300, embed_size=32, hidden_size=32, num_layers=1,
             num_stripes=2, dropout_embed=0.0, dropout_hidden=0.0,
             dropout_output=0.0, tie_embeddings=tied, cpu_bf16_head=setting)
  return cfg


def _loss_and_grads(setting, tied=True):
  """A ZebraLM's mean cross-entropy and its gradients, and whether the
  compiled program calls the bf16 kernel."""
  cfg = _model_cfg(setting, tied)
  graphdef, params = nnx.split(lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 300)
  carry = lm.init_carry(cfg, 8)  # 64 rows: cpu_bf16_head.MIN_ROWS

  def loss(p):
    logits, _ = lm.apply(graphdef, p, tokens[:, :-1], carry)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
  step = jax.jit(jax.value_and_grad(loss))
  calls = native_recurrence.BF16_MATMUL in step.lower(params).as_text()
  return step(params), calls


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("tied", [True, False])
def test_lm_loss_is_within_the_gpu_reports_bf16_precision(this_cpus_build,
                                                          tied):
  """auto on this CPU runs the kernel; the loss is within
  BF16_LOSS_TOLERANCE of float32's and every gradient within 1% of
  float32's largest."""
  (got, got_g), calls = _loss_and_grads("auto", tied)
  (want, want_g), no_calls = _loss_and_grads("off", tied)
  assert calls and not no_calls
  assert abs(float(got) - float(want)) <= BF16_LOSS_TOLERANCE
  assert float(got) != float(want)  # the products did change
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=0,
                               atol=1e-2 * max(1e-6, np.abs(w).max()))


def _assert_float32_program(setting):
  (got, got_g), calls = _loss_and_grads(setting)
  (want, want_g), _ = _loss_and_grads("off")
  assert not calls
  assert float(got) == float(want)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_array_equal(g, w)


@needs_compiler
@on_x86
def test_an_avx2_build_has_no_kernel_and_runs_float32(monkeypatch):
  """A library built for x86-64-v3 has no AVX512_BF16: auto says why and
  runs the float32 program, bitwise; the kernel was not compiled in (its
  call fails)."""
  monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v3")
  monkeypatch.delenv(native_build.LIB_ENV, raising=False)
  assert not native_recurrence.unavailable(jnp.float32)
  assert not native_recurrence.built_with(cpu_bf16_head.FEATURE)
  if HAS_BF16_UNITS:
    assert "without avx512_bf16" in cpu_bf16_head.unavailable()
  assert not cpu_bf16_head.chosen("auto")
  _assert_float32_program("auto")
  x = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(Exception, match="built without AVX512_BF16"):
    jax.block_until_ready(cpu_bf16_head.logits(x, x, True))


def test_a_cpu_without_the_units_runs_float32(monkeypatch):
  """auto on a CPU that lacks AVX512_BF16: the float32 program, bitwise.
  (The library is loaded first: its loading reads the CPU's flags too.)"""
  library = native_recurrence.unavailable(jnp.float32)
  monkeypatch.setattr(native_check, "cpu_flags",
                      lambda: frozenset({"avx2", "fma"}))
  why = cpu_bf16_head.unavailable()
  assert why == (library or "this CPU has no avx512_bf16")
  assert not cpu_bf16_head.chosen("auto")
  _assert_float32_program("auto")


@needs_compiler
@needs_bf16_units
def test_a_few_rows_run_float32(this_cpus_build):
  """A sampling step's rows (fewer than MIN_ROWS) keep the float32
  products: the bits of the off setting."""
  cfg = _model_cfg("auto")
  model = lm.ZebraLM(cfg, rngs=nnx.Rngs(0))
  assert model.bf16_head
  off = lm.ZebraLM(_model_cfg("off"), rngs=nnx.Rngs(0))
  hidden = jax.random.normal(jax.random.key(2), (1, 3, 32))
  np.testing.assert_array_equal(model.logits(hidden), off.logits(hidden))
  rows = jax.random.normal(jax.random.key(2), (2, 32, 32))
  assert not np.array_equal(model.logits(rows), off.logits(rows))


def test_off_is_the_float32_program():
  """off (default) never loads or calls the kernel."""
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  assert base.get_config().model.cpu_bf16_head == "off"
  assert not cpu_bf16_head.chosen("off")
  _assert_float32_program("off")
  with pytest.raises(ValueError, match="cpu_bf16_head"):
    cpu_bf16_head.chosen("on")
