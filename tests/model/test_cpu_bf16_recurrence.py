"""model.cpu_bf16_recurrence: the native time loops' recurrent products in
bf16 on a CPU's bf16 units.

Where this CPU has AVX512_BF16 and a compiler, the loops must run (a
failure to build or load the library fails, never skips). Each step is
checked against NumPy given the loop's own inputs to that step (teacher
forcing: the kernel's h_{t-1}, or dz_{t+1}, rounded to bf16 times W_h
rounded to bf16, summed in float64): a whole-window reference would let a
last-bit difference move an element across a bf16 rounding boundary and
hide the sums' float32 rounding beneath one 2^-8 step. Every split of the
work gives the same bits; remat recomputes the loops' products; the LM's
loss is within the GPU report's bf16 tolerance. Everywhere else: the float32
program, bitwise (the setting off, no units, small stripes, other
recurrences), and a library built without the units refuses the call.
"""

import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zebra_jax.model import cpu_bf16_head, lm
from zebra_jax.model.recurrence import native, native_build
from zebra_jax.model.recurrence import scan
from tests.helpers import (BF16_LOSS_TOLERANCE, assert_same_bits,
                           layer_cotangents, lm_loss_step, needs_bf16_units,
                           needs_compiler, normal_array, value_and_grads)


# max |kernel - NumPy's step| / max(1, max |NumPy's step|) over the cases
# below: <= 6.4e-7 (float32 sums, float32 cell and tanh). 4x that; the
# float32 loops differ from the bf16 ones by 2e-3 to 6e-3.
SCALED_ATOL = 2.5e-6



def _rounded(x):
  """float32 -> bf16 (nearest even) -> float64."""
  return np.asarray(jnp.asarray(np.asarray(x, np.float32), jnp.bfloat16)
                    .astype(jnp.float32), np.float64)


def _activate(z):
  g = z.shape[-1] // 4
  scale = np.repeat([0.5, 0.5, 1.0, 0.5], g)
  return np.tanh(z * scale) * scale + np.repeat([0.5, 0.5, 0.0, 0.5], g)


def _scaled_error(got, want):
  want = np.asarray(want, np.float64)
  return np.abs(np.asarray(got, np.float64) - want).max() / max(
      1.0, np.abs(want).max())


def _window(s, t, b, g, seed=0):
  rng = np.random.default_rng(seed)
  return (normal_array(rng, (s, t, b, 4 * g)),
          normal_array(rng, (s, b, g), 0.5), normal_array(rng, (s, b, g), 0.5),
          normal_array(rng, (s, g, 4 * g), 1 / np.sqrt(g)),
          normal_array(rng, (s, t, b, g)), normal_array(rng, (s, b, g)),
          normal_array(rng, (s, b, g)))


def _loops(window, bf16):
  """The forward call (keeping the gates) and the backward call on its
  results: ys, cs, gates, dz, dh0."""
  x_proj, h0, c0, w_h, d_ys, d_h, d_c = window

  def run(x_proj, h0, c0, w_h, d_ys, d_h, d_c):
    # pylint: disable=protected-access
    ys, h, c, (cs, gates) = native._forward(x_proj, h0, c0, w_h, "gates",
                                            bf16)
    dz, dh0, _ = native._backward(d_ys, gates, cs, c0, w_h, d_h, d_c,
                                  bf16=bf16)
    return ys, cs, gates, dz, dh0
  return [np.asarray(a) for a in jax.jit(run)(*window)]


def _check_steps(x_proj, h0, w_h, d_ys, d_h, got, float32):
  """Forward: every step's gates = act(x_proj + bf16(h_{t-1}) bf16(W_h)),
  h_{t-1} the loop's own output. Backward: every step's output-gate
  gradient = (bf16(dz_{t+1}) bf16(W_h)ᵀ + dy_t) tanh(c_t) o (1 - o), and
  dh0 = bf16(dz_0) bf16(W_h)ᵀ. The float32 loops lie far outside the
  bound."""
  ys, cs, gates, dz, dh0 = got
  g = w_h.shape[1]
  h_prev = np.concatenate([h0[:, None], ys[:, :-1]], 1)
  want_gates = _activate(x_proj + np.einsum(
      "stbg,sgk->stbk", _rounded(h_prev), _rounded(w_h)))
  assert _scaled_error(gates, want_gates) <= SCALED_ATOL
  assert _scaled_error(float32[2], gates) > 100 * SCALED_ATOL
  dh = np.concatenate([np.einsum("stbk,sgk->stbg", _rounded(dz[:, 1:]),
                                 _rounded(w_h)), d_h[:, None]], 1)
  o = gates[..., 3 * g:]
  want_dz_o = (dh + d_ys) * np.tanh(cs) * o * (1 - o)
  assert _scaled_error(dz[..., 3 * g:], want_dz_o) <= SCALED_ATOL
  want_dh0 = np.einsum("sbk,sgk->sbg", _rounded(dz[:, 0]), _rounded(w_h))
  assert _scaled_error(dh0, want_dh0) <= SCALED_ATOL
  assert _scaled_error(float32[4], dh0) > 100 * SCALED_ATOL


# (stripes, steps, batch, units): dense S=1 at the wlm shape (hidden units
# split over 2 threads), a few rows (rows a thread), one row, two stripes,
# odd sizes (a partial panel, an odd K).
SHAPES = [(1, 5, 20, 200), (1, 4, 3, 64), (1, 3, 1, 200), (2, 3, 8, 96),
          (1, 4, 33, 130), (1, 3, 5, 65)]


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("s,t,b,g", SHAPES)
def test_each_step_is_float32_sums_of_bf16_operands(this_cpus_build, s, t, b,
                                                    g):
  """`_check_steps` on the loops of large stripes."""
  assert not cpu_bf16_head.unavailable(), cpu_bf16_head.unavailable()
  window = _window(s, t, b, g)
  x_proj, h0, _, w_h, d_ys, d_h, _ = window
  _check_steps(x_proj, h0, w_h, d_ys, d_h, _loops(window, True),
               _loops(window, False))


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("threads", [2, 3])
def test_a_split_by_hidden_units_gives_one_threads_bits(this_cpus_build,
                                                        monkeypatch, threads):
  """The bf16 loops on one thread, by batch rows and by hidden units (2 or
  3 parts of 200 units: parts end inside a 16-column panel): the same
  bits."""
  window = _window(1, 6, 20, 200, seed=3)
  monkeypatch.setattr(native, "threads", lambda flops: 1)
  one = _loops(window, True)
  monkeypatch.setattr(native, "threads", lambda flops: threads)
  monkeypatch.setattr(native, "MIN_UNIT_SPLIT_FLOPS", 0)
  assert native.unit_parts(1, 20, 200, threads) == threads
  units = _loops(window, True)
  monkeypatch.setattr(native, "MIN_UNIT_SPLIT_FLOPS", 1 << 62)
  rows = _loops(window, True)
  for a, b, c in zip(one, units, rows):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def _layer_args(stripes=1, width=128, t=8, b=8):
  rng = np.random.default_rng(0)
  s, g = stripes, width
  return tuple(jnp.asarray(normal_array(rng, shape, scale)) for shape, scale
               in (((t, b, g), 1.0), ((g, s, 4 * g), 1 / np.sqrt(g)),
                   ((s, 4 * g), 0.2), ((s, b, g), 0.5), ((s, b, g), 0.5),
                   ((s, g, 4 * g), 0.8 / np.sqrt(g))))


def _loop_calls(fn, args, bf16: bool) -> int:
  """How many time-loop calls of fn's gradient program carry bf16=bf16."""
  grad = jax.grad(lambda *a: sum(x.sum() for x in fn(*a)),
                  argnums=tuple(range(len(args))))
  text = jax.jit(grad).lower(*args).as_text()
  return text.count(f"bf16 = {str(bf16).lower()}")


# Under remat the backward loop reads recomputed gates: XLA's tanh and
# float32 sums in another order change their last bits, and the loop's
# rounding of dz to bf16 turns a last bit into a 2^-8 step now and then.
# mean |remat - kept| / mean |kept| per array, measured at widths 128 and
# 200: <= 8.1e-5 with the bf16 recomputation, >= 3.3e-4 for every gradient
# with a float32 one.
REMAT_MEAN_ERROR = 1.5e-4


def _mean_error(got, want):
  want = np.asarray(want, np.float64)
  return (np.abs(np.asarray(got, np.float64) - want).mean()
          / np.abs(want).mean())


@needs_compiler
@needs_bf16_units
def test_remat_recomputes_the_loops_products(this_cpus_build):
  """Remat's recomputed h_{t-1} W_h is the loops' product (NumPy's bf16
  operands, float32 sums), and the gradients stay within REMAT_MEAN_ERROR
  of the layer that kept its gates, where a float32 recomputation (the
  same layer with recurrent_product=None) lies beyond twice that."""
  args = _layer_args()
  h_rows, w_h = args[3], args[5]
  # pylint: disable-next=protected-access
  got = native._bf16_recurrent_product(h_rows, w_h)
  want = np.einsum("sng,sgk->snk", _rounded(h_rows), _rounded(w_h))
  assert _scaled_error(got, want) <= SCALED_ATOL
  cotangents = layer_cotangents(args)
  run = lambda fn: jax.tree.leaves(value_and_grads(fn, args, cotangents))
  kept = run(lambda *a: native.zebra_layer(*a, 1, False, False, True))
  recomputed = run(lambda *a: native.zebra_layer(*a, 1, True, False, True))
  float32 = scan.kernel_layer(
      # pylint: disable=protected-access
      functools.partial(native._forward, bf16=True),
      functools.partial(native._backward, bf16=True), None, None,
      native.bf16_product, None)
  float32 = run(lambda *a: float32(*a, True, False))
  assert len(kept) == 9  # ys, h, c, then the six gradients
  for k, r in zip(kept[:3], recomputed[:3]):  # the same forward loop
    np.testing.assert_array_equal(k, r)
  for k, r, f in zip(kept[3:], recomputed[3:], float32[3:]):
    assert _mean_error(r, k) <= REMAT_MEAN_ERROR
    assert _mean_error(f, k) > 2 * REMAT_MEAN_ERROR


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("stripes,width,n_in,bf16_calls", [
    (1, 128, 128, 2),  # dense, large: forward and backward in bf16
    (2, 128, 128, 2),  # two large stripes
    (1, 32, 32, 0),  # small stripes: float32 loops
])
def test_loops_in_bf16_are_large_stripes(this_cpus_build, stripes, width,
                                         n_in, bf16_calls):
  args = _layer_args(stripes, width)
  layer = lambda *a: native.zebra_layer(*a, 1, False, False, True)
  assert _loop_calls(layer, args, True) == bf16_calls
  off = lambda *a: native.zebra_layer(*a, 1, False, False, False)
  assert _loop_calls(off, args, True) == 0


def _model_cfg(setting, recurrence="native", width=128, stripes=1,
               stripe_input="dense"):
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  cfg = base.get_config().model
  cfg.update(vocab_size=64, embed_size=width, hidden_size=width,
             num_layers=2, num_stripes=stripes, stripe_input=stripe_input,
             dropout_embed=0.0, dropout_hidden=0.0, dropout_output=0.0,
             recurrence=recurrence, cpu_bf16_recurrence=setting)
  return cfg


def _loss_and_grads(setting, **kw):
  step, params = lm_loss_step(_model_cfg(setting, **kw), 8, 8)
  return step(params)


@needs_compiler
@needs_bf16_units
def test_lm_loss_is_within_the_gpu_reports_bf16_precision(this_cpus_build):
  """auto on this CPU: the loss within BF16_LOSS_TOLERANCE of float32's, every
  gradient within 1% of float32's largest, and not float32's bits (the
  untrained model's loss is log(64) to float32's precision either way:
  its gradients show the loops' rounding)."""
  got, got_g = _loss_and_grads("auto")
  want, want_g = _loss_and_grads("off")
  assert abs(float(got) - float(want)) <= BF16_LOSS_TOLERANCE
  assert any(np.any(np.asarray(g) != np.asarray(w)) for g, w in
             zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)))
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=0,
                               atol=1e-2 * max(1e-6, np.abs(w).max()))


@needs_compiler
def test_float32_where_it_does_not_apply(this_cpus_build, monkeypatch):
  """auto with small stripes (grouped S=8 of 16 units), under the scan, or
  where cpu_bf16_head.unavailable() names a reason: off's bits."""
  for kw in (dict(width=128, stripes=8, stripe_input="grouped"),
             dict(recurrence="scan")):
    assert_same_bits(_loss_and_grads("auto", **kw),
                      _loss_and_grads("off", **kw))
  want = _loss_and_grads("off")
  monkeypatch.setattr(cpu_bf16_head, "unavailable",
                      lambda: "this CPU has no avx512_bf16")
  assert_same_bits(_loss_and_grads("auto"), want)


def test_setting_is_checked():
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  assert base.get_config().model.cpu_bf16_recurrence == "off"
  with pytest.raises(ValueError, match="cpu_bf16_recurrence: 'on'"):
    lm.ZebraLM(_model_cfg("on"), rngs=nnx.Rngs(0))
  model = lm.ZebraLM(_model_cfg("off"), rngs=nnx.Rngs(0))
  assert not any(layer.bf16_recurrence for layer in model.layers)


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="x86-64-v3 is an x86-64 target")
def test_an_avx2_build_refuses_the_bf16_loops(monkeypatch):
  """A library built for x86-64-v3 has no AVX512_BF16: auto is off there,
  and a loop call asked for bf16 fails with the reason, never running
  float32 loops in its place."""
  monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v3")
  monkeypatch.delenv(native_build.LIB_ENV, raising=False)
  assert not native.unavailable(jnp.float32)
  assert not cpu_bf16_head.chosen("auto", "cpu_bf16_recurrence")
  window = _window(1, 3, 4, 32)
  with pytest.raises(Exception, match="built without AVX512_BF16"):
    _loops(window, True)
