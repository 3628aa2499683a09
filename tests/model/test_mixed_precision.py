"""mixed_precision.matmul: float32 results from bf16/fp16 operands, and
gradient dots that read the compute dtype, checked against NumPy in float64
and in the lowered train step of both heads."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from zebra_jax.config import base
from zebra_jax.model import lm, mixed_precision

SPECS = ["nk,vk->nv", "nh,hv->nv", "nd,dk->nk", "...k,dk->...d"]


def _operands(spec, seed=0):
  rng = np.random.default_rng(seed)
  x_shape = {"nk,vk->nv": (6, 5), "nh,hv->nv": (6, 5), "nd,dk->nk": (6, 5),
             "...k,dk->...d": (2, 3, 5)}[spec]
  w_shape = {"nk,vk->nv": (7, 5), "nh,hv->nv": (5, 7), "nd,dk->nk": (5, 7),
             "...k,dk->...d": (7, 5)}[spec]
  out_shape = np.einsum(spec.replace("...", "ab"), np.zeros(x_shape),
                        np.zeros(w_shape)).shape
  return tuple(rng.normal(size=s).astype(np.float32)
               for s in (x_shape, w_shape, out_shape))


def _bf16(a):
  """a rounded to bfloat16, as float64."""
  return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


@pytest.mark.parametrize("spec", SPECS)
def test_float32_is_the_einsum_with_its_gradient(spec):
  """The product and both gradients are the float64 einsums to float32
  rounding (on a CPU the weight gradient runs as library_dots.contract_rows,
  whose sums may round in another order than the plain einsum's)."""
  x, w, g = _operands(spec)
  mixed = lambda x, w: mixed_precision.matmul(spec, x, w, jnp.float32)
  np_spec = spec.replace("...", "ab")
  a, b = np_spec.split("->")[0].split(",")
  c = np_spec.split("->")[1]
  f64 = lambda v: v.astype(np.float64)
  out, pullback = jax.vjp(mixed, x, w)
  want = (np.einsum(np_spec, f64(x), f64(w)),
          np.einsum(f"{c},{b}->{a}", f64(g), f64(w)),
          np.einsum(f"{a},{c}->{b}", f64(x), f64(g)))
  for got, want_d in zip((out, *pullback(g)), want):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want_d, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_bfloat16_gradients_read_the_cotangent_in_bfloat16(spec):
  """The result is the product of the bf16-rounded operands; each gradient
  is the float64 product of bf16-rounded operands and cotangent, returned
  in the operand's own dtype (float32 here)."""
  x, w, g = _operands(spec)
  np_spec = spec.replace("...", "ab")
  out, pullback = jax.vjp(
      lambda x, w: mixed_precision.matmul(spec, x, w, jnp.bfloat16), x, w)
  assert out.dtype == jnp.float32
  want = np.einsum(np_spec, _bf16(x), _bf16(w))
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  dx, dw = pullback(g)
  assert dx.dtype == dw.dtype == jnp.float32
  a, b = np_spec.split("->")[0].split(",")
  c = np_spec.split("->")[1]
  want_dx = np.einsum(f"{c},{b}->{a}", _bf16(g), _bf16(w))
  want_dw = np.einsum(f"{a},{c}->{b}", _bf16(x), _bf16(g))
  # float32 accumulation of exact bf16 products: float32 rounding only.
  np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-6, atol=1e-6)
  # The float32 cotangent would give a different answer: the test sees it.
  assert np.abs(np.einsum(f"{c},{b}->{a}", g, _bf16(w)) - want_dx).max() > 1e-4


def _train_dots(head: str, dtype: str) -> list[str]:
  """The operand types of every dot_general in the lowered gradient of a
  tiny model's training loss."""
  c = base.get_config().model.to_dict()
  c.update(vocab_size=40, embed_size=16, hidden_size=16, num_layers=1,
           num_stripes=2, dtype=dtype, head=head, tie_embeddings=True,
           adaptive_cutoffs=(10, 20), adaptive_div_val=2, adaptive_tie=True,
           adaptive_chunk_rows=8, recurrence="scan")
  cfg = ml_collections.ConfigDict(c)
  graphdef, params = lm.create(cfg, seed=0)
  ids = jnp.zeros((2, 5), jnp.int32)
  carry = lm.init_carry(cfg, 2)

  def loss(params):
    sums, _ = lm.token_sums(graphdef, params, ids, ids, carry)
    return sums["loss_sum"]
  text = jax.jit(jax.grad(loss)).lower(params).as_text()
  return re.findall(r"stablehlo\.dot_general[^\n]*?:\s*\(([^)]*)\)", text)


@pytest.mark.parametrize("head", ["full", "adaptive"])
def test_no_float32_dot_in_a_bfloat16_train_step(head):
  """Every dot of the bf16 step (forward and gradient: layers, embedding,
  head) reads bf16 operands; float32 keeps float32 ones."""
  dots = _train_dots(head, "bfloat16")
  assert len(dots) >= 6
  assert [d for d in dots if "f32" in d] == [], dots
  assert all("bf16" not in d for d in _train_dots(head, "float32"))


def test_a_low_result_is_the_float32_product_rounded_once(monkeypatch):
  """low_result=True: the bf16 product rounded once from its float32
  accumulation (within one bf16 step, 2**-8, of the exact product rounded);
  the dot's own bf16 output (the branch off a CPU, run here by naming
  another backend) is the same bits on this CPU; the gradients are those
  of the float32 result (its cotangent is cast to bf16 either way)."""
  spec = "nk,vk->nv"
  x, w, g = _operands(spec)
  run = lambda: jax.vjp(lambda x, w: mixed_precision.matmul(
      spec, x, w, jnp.bfloat16, low_result=True), x, w)
  out, pullback = run()
  assert out.dtype == jnp.bfloat16
  want = np.einsum(spec, _bf16(x), _bf16(w))
  np.testing.assert_allclose(np.asarray(out, np.float64), want,
                             rtol=2.0 ** -8, atol=1e-6)
  low_g = jnp.asarray(g, jnp.bfloat16)
  grads = pullback(low_g)
  _, float32_pullback = jax.vjp(lambda x, w: mixed_precision.matmul(
      spec, x, w, jnp.bfloat16), x, w)
  for got, want_d in zip(grads, float32_pullback(low_g.astype(jnp.float32))):
    np.testing.assert_array_equal(got, want_d)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  off_cpu, off_cpu_pullback = run()
  np.testing.assert_array_equal(np.asarray(off_cpu, np.float32),
                                np.asarray(out, np.float32))
  for got, want_d in zip(off_cpu_pullback(low_g), grads):  # no library_dots
    np.testing.assert_allclose(got, want_d, rtol=1e-6, atol=1e-6)
