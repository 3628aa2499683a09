"""model.cpu_fused_head: the tied head's loss and gradients in one native call.

"on" takes the call wherever the library loads, "auto" only with the bf16
products. Where there is a compiler, the call must run (a failed build fails, never
skips): its loss and its three gradients against XLA's head
(`softmax_xent`, which is optax's bit for bit) within the bound of float32
sums taken in another order; with the bf16 products (model.cpu_bf16_head
=auto beside it, on a CPU with AVX512_BF16), within the bound of rounding
their operands to bf16 that tests/model/test_cpu_bf16_head.py holds the
bf16 head to. Everywhere, the fallback: with the setting off, an untied
head, accuracy asked for, or no native library, the head is XLA's program,
bitwise.
"""

import platform


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zebra_jax.model import cpu_bf16_head, cpu_fused_head, lm, softmax_xent
from zebra_jax.model.recurrence import native as native_recurrence
from zebra_jax.model.recurrence import native_build
from tests.helpers import (BF16_LOSS_TOLERANCE, needs_bf16_units,
                           needs_compiler)

EPS = 2.0 ** -24  # float32's unit roundoff
# Both operands of a product rounded to bf16 (8 significant bits): each off
# by at most 2^-8 of itself, their product by 2^-7 + 2^-16 of |a||b|.
BF16_ROUNDING = 2.0 ** -7 + 2.0 ** -16



def _inputs(n, h, v, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((n, h)), jnp.float32),
          jnp.asarray(rng.standard_normal((v, h)) * 0.3, jnp.float32),
          jnp.asarray(rng.standard_normal((v,)) * 0.3, jnp.float32),
          jnp.asarray(rng.integers(0, v, n), jnp.int32))


def _xla_loss_sum(hidden, embed, bias, targets):
  return softmax_xent.cross_entropy(hidden @ embed.T + bias, targets).sum()


def _bounds(hidden, embed, bias, targets, rounding=0.0):
  """Per-element bounds on |fused - XLA| for the losses and d_h, d_embed,
  d_bias: each side's float32 sums are within K x 2^-24 of |a||b| of the
  exact sum (K terms), so the two within twice that, plus `rounding` of
  |a||b| for bf16 products; a logit error moves the loss by at most twice
  its largest (its log-sum-exp and its target), and each probability p by
  p times that plus the V-term sum's and exp's rounding. d_bias sums in
  float32 either way."""
  x, w, b = (np.asarray(a, np.float64) for a in (hidden, embed, bias))
  n, v = x.shape[0], w.shape[0]
  logits = x @ w.T + b
  d_logit = (rounding + 2 * x.shape[1] * EPS) * (
      np.abs(x) @ np.abs(w).T) + 2 * EPS * np.abs(logits)
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  d = p.copy()
  d[np.arange(n), np.asarray(targets)] -= 1
  loss = -np.log(p[np.arange(n), np.asarray(targets)])
  d_p = 2 * d_logit.max(1, keepdims=True) + (v + 8) * EPS  # relative to p
  return {
      "loss": 2 * d_logit.max(1) + (v + 8) * EPS + 4 * EPS * loss,
      "d_h": (rounding + 2 * v * EPS) * (np.abs(d) @ np.abs(w))
             + (d_p * p) @ np.abs(w),
      "d_e": (rounding + 2 * n * EPS) * (np.abs(d).T @ np.abs(x))
             + (d_p * p).T @ np.abs(x),
      "d_b": 2 * n * EPS * np.abs(d).sum(0) + (d_p * p).sum(0),
  }


@needs_compiler
@pytest.mark.parametrize("n,h,v", [
    (37, 33, 51),     # fewer rows than a chunk; H odd, not a panel's width
    (130, 40, 300),   # two whole chunks of 64 and two rows
    (70, 64, 1000),   # H a whole number of panels: d_b's column one more
])
def test_loss_and_gradients_are_xlas_within_float32_sums(this_cpus_build, n,
                                                         h, v):
  assert not cpu_fused_head.unavailable(), cpu_fused_head.unavailable()
  args = _inputs(n, h, v)
  call = cpu_fused_head._call  # pylint: disable=protected-access
  losses = np.asarray(jax.jit(lambda *a: call(*a, False)[0])(*args),
                      np.float64)
  want_losses = np.asarray(softmax_xent.cross_entropy(
      args[0] @ args[1].T + args[2], args[3]), np.float64)
  got, got_grads = jax.jit(jax.value_and_grad(
      cpu_fused_head.loss_sum, argnums=(0, 1, 2)))(*args)
  want, want_grads = jax.jit(jax.value_and_grad(
      _xla_loss_sum, argnums=(0, 1, 2)))(*args)
  bounds = _bounds(*args)
  assert np.all(np.abs(losses - want_losses) <= bounds["loss"])
  assert abs(float(got) - float(want)) <= bounds["loss"].sum() + (
      n * EPS * float(want))
  for name, g, w in zip(("d_h", "d_e", "d_b"), got_grads, want_grads):
    diff = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
    assert np.all(diff <= bounds[name]), (name, diff.max())


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("n,h,v", [(37, 33, 51), (130, 40, 300)])
def test_bf16_products_are_xlas_within_their_rounding(this_cpus_build, n, h,
                                                      v):
  """bf16=True: each product within the bound of rounding both operands to
  bf16 of XLA's float32 head (and within float32 sums' of the bf16 head's
  own products: they round the same operands)."""
  assert not cpu_bf16_head.unavailable(), cpu_bf16_head.unavailable()
  args = _inputs(n, h, v)
  got, got_grads = jax.jit(jax.value_and_grad(
      lambda *a: cpu_fused_head.loss_sum(*a, True), argnums=(0, 1, 2)))(*args)
  want, want_grads = jax.jit(jax.value_and_grad(
      _xla_loss_sum, argnums=(0, 1, 2)))(*args)
  bounds = _bounds(*args, rounding=BF16_ROUNDING)
  assert abs(float(got) - float(want)) <= bounds["loss"].sum()
  assert float(got) != float(want)  # the products did change
  for name, g, w in zip(("d_h", "d_e", "d_b"), got_grads, want_grads):
    diff = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
    assert np.all(diff <= bounds[name]), (name, diff.max())


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="x86-64-v3 is an x86-64 target")
def test_an_avx2_build_refuses_the_bf16_products(monkeypatch):
  monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v3")
  monkeypatch.delenv(native_build.LIB_ENV, raising=False)
  args = _inputs(5, 8, 10)
  assert np.isfinite(float(cpu_fused_head.loss_sum(*args)))
  with pytest.raises(Exception, match="built without AVX512_BF16"):
    jax.block_until_ready(cpu_fused_head.loss_sum(*args, True))


@needs_compiler
def test_the_bounds_are_not_vacuous(this_cpus_build):
  """A gradient off by one part in 10^4 fails them."""
  args = _inputs(37, 33, 51)
  _, want_grads = jax.jit(jax.value_and_grad(
      _xla_loss_sum, argnums=(0, 1, 2)))(*args)
  bounds = _bounds(*args)
  off = np.asarray(want_grads[0], np.float64) * (1 + 1e-4)
  assert np.any(np.abs(off - np.asarray(want_grads[0])) > bounds["d_h"])


def _grads_of_mean(args, expected, extra=1.0, bf16=False):
  """The gradients of extra x (the fused sum / N), the sum told to expect
  the cotangent `expected`."""
  n = args[0].shape[0]
  f = lambda h, e, b: extra * cpu_fused_head.loss_sum(
      h, e, b, args[3], bf16, expected) / n
  return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*args[:3])


@needs_compiler
@pytest.mark.parametrize("bf16", [False, True])
def test_an_expected_cotangent_is_folded_into_the_call(this_cpus_build,
                                                       bf16):
  """A mean's 1/N, told to the call, scales d_logits inside it: the same
  gradients as the sum's scaled after the call, within float32's rounding
  of that one product, and the program has no pass over d_embed that
  scales it. Another cotangent (3/N) is still applied, exactly as told."""
  if bf16 and cpu_bf16_head.unavailable():
    pytest.skip(cpu_bf16_head.unavailable())
  args = _inputs(130, 40, 300)
  n = args[0].shape[0]
  mean = float(np.float32(1.0) / np.float32(n))
  plain = _grads_of_mean(args, 1.0, bf16=bf16)
  folded = _grads_of_mean(args, mean, bf16=bf16)
  tripled = _grads_of_mean(args, mean, extra=3.0, bf16=bf16)
  # Each side within the sum's bound (of XLA's gradients) over N.
  bounds = _bounds(*args, rounding=BF16_ROUNDING if bf16 else 0.0)
  for name, a, b, c in zip(("d_h", "d_e", "d_b"), plain, folded, tripled):
    a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
    assert np.all(np.abs(a - b) <= 2 * bounds[name] / n), name
    assert np.abs(3 * b - c).max() <= 4 * EPS * np.abs(c).max(), name
  v, h = args[1].shape

  def scaling_passes(expected):
    f = lambda e: cpu_fused_head.loss_sum(args[0], e, args[2], args[3],
                                          bf16, expected) / n
    text = jax.jit(jax.grad(f)).lower(args[1]).compile().as_text()
    entry = text[text.index("ENTRY"):]
    return [l for l in entry.splitlines()
            if f"f32[{v},{h}]" in l.split("=", 1)[-1][:30]
            and ("multiply" in l or "fusion(" in l)]
  assert scaling_passes(1.0), "the unfolded program scales d_embed"
  assert not scaling_passes(mean), scaling_passes(mean)


@needs_compiler
def test_one_thread_count_gives_the_same_bits(this_cpus_build, monkeypatch):
  """Rows split over the threads: the loss and d_h the same bits for any
  count; d_embed and d_bias the same bits for the same count, and within
  float32 sums of each other across counts."""
  args = _inputs(150, 40, 70)

  def run(threads):
    monkeypatch.setattr(native_recurrence, "threads", lambda flops: threads)
    call = cpu_fused_head._call  # pylint: disable=protected-access
    return [np.asarray(a) for a in jax.jit(lambda *a: call(*a, True))(*args)]
  one, three, again = run(1), run(3), run(3)
  for a, b in zip(three, again):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(one[:2], three[:2]):
    np.testing.assert_array_equal(a, b)
  bounds = _bounds(*args)
  for name, a, b in zip(("d_e", "d_b"), one[2:], three[2:]):
    assert np.all(np.abs(a - b) <= bounds[name]), name


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("n", [151, 3])
def test_bf16_d_embed_is_the_same_bits_for_any_thread_count(
    this_cpus_build, monkeypatch, n):
  """With bf16 products d_embed's product runs over every row in order
  whatever the thread count (the threads split the vocabulary): the loss,
  d_h and d_embed the same bits for 1, 2 and 3 threads (an odd row count:
  parts start at even rows, one may be empty); d_bias (the parts' sums
  added in order) within float32 sums across counts."""
  args = _inputs(n, 40, 70)

  def run(threads):
    monkeypatch.setattr(native_recurrence, "threads", lambda flops: threads)
    call = cpu_fused_head._call  # pylint: disable=protected-access
    return [np.asarray(a)
            for a in jax.jit(lambda *a: call(*a, True, True))(*args)]
  one, two, three = run(1), run(2), run(3)
  for other in (two, three):
    for a, b in zip(one[:3], other[:3]):
      np.testing.assert_array_equal(a, b)
    assert np.all(np.abs(one[3] - other[3]) <= _bounds(*args)["d_b"])


@needs_compiler
def test_a_target_outside_the_vocabulary_gives_nan(this_cpus_build):
  hidden, embed, bias, _ = _inputs(3, 8, 10)
  targets = jnp.asarray([1, 10, -1], jnp.int32)
  losses = np.asarray(cpu_fused_head._call(  # pylint: disable=protected-access
      hidden, embed, bias, targets, False)[0])
  assert np.isfinite(losses[0]) and np.isnan(losses[1:]).all()


def _model_cfg(setting, tied=True, bf16="off"):
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  cfg = base.get_config().model
  cfg.update(vocab_size=300, embed_size=32, hidden_size=32, num_layers=1,
             num_stripes=2, dropout_embed=0.0, dropout_hidden=0.0,
             dropout_output=0.0, tie_embeddings=tied, cpu_fused_head=setting,
             cpu_bf16_head=bf16)
  return cfg


def _token_sums(setting, tied=True, with_accuracy=False, bf16="off"):
  """A ZebraLM's loss sum over a window (64 rows: cpu_bf16_head.MIN_ROWS)
  and its gradients, and whether the compiled program makes the fused
  call."""
  cfg = _model_cfg(setting, tied, bf16)
  graphdef, params = nnx.split(lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 300)
  carry = lm.init_carry(cfg, 8)

  def loss(p):
    sums, _ = lm.token_sums(graphdef, p, tokens[:, :-1], tokens[:, 1:],
                            carry, with_accuracy=with_accuracy)
    return sums["loss_sum"]
  step = jax.jit(jax.value_and_grad(loss))
  calls = native_recurrence.FUSED_XENT in step.lower(params).as_text()
  return step(params), calls


@needs_compiler
def test_the_lm_loss_runs_the_call_and_is_xlas_within_float32(
    this_cpus_build):
  (got, got_g), calls = _token_sums("on")
  (want, want_g), no_calls = _token_sums("off")
  assert calls and not no_calls
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=0,
                               atol=1e-5 * max(1e-6, np.abs(w).max()))


@needs_compiler
@needs_bf16_units
def test_with_the_bf16_head_the_lm_loss_is_within_its_precision(
    this_cpus_build):
  """Both auto: the fused call with bf16 products (no bf16 matmul call
  beside it); the mean loss within BF16_LOSS_TOLERANCE of float32's and
  every gradient within 1% of float32's largest, as the bf16 head's
  test."""
  cfg = _model_cfg("auto", bf16="auto")
  graphdef, params = nnx.split(lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 300)
  program = jax.jit(lambda p: lm.token_sums(
      graphdef, p, tokens[:, :-1], tokens[:, 1:], lm.init_carry(cfg, 8),
      with_accuracy=False)[0]["loss_sum"]).lower(params).as_text()
  assert native_recurrence.FUSED_XENT in program
  assert native_recurrence.BF16_MATMUL not in program
  (got, got_g), _ = _token_sums("auto", bf16="auto")
  (_, f32_g), _ = _token_sums("on")
  (want, want_g), _ = _token_sums("off")
  assert abs(float(got) - float(want)) / 64 <= BF16_LOSS_TOLERANCE
  assert not all(np.array_equal(g, f) for g, f in zip(  # bf16 products ran
      jax.tree.leaves(got_g), jax.tree.leaves(f32_g)))
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=0,
                               atol=1e-2 * max(1e-6, np.abs(w).max()))


def _assert_xla_program(setting, **kw):
  (got, got_g), calls = _token_sums(setting, **kw)
  (want, want_g), _ = _token_sums("off", **kw)
  assert not calls
  assert float(got) == float(want)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_array_equal(g, w)


@needs_compiler
def test_an_untied_head_or_accuracy_runs_xlas_head(this_cpus_build):
  """The call reads the embedding as the head's matrix and gives no
  accuracy: an untied head, and a pass that counts accuracy, keep XLA's."""
  _assert_xla_program("on", tied=False)
  _assert_xla_program("on", with_accuracy=True)


@needs_compiler
def test_auto_without_the_bf16_products_runs_xlas_head(this_cpus_build):
  """auto takes the call only where it measured faster: with bf16 products
  (model.cpu_bf16_head=auto, off here)."""
  assert not cpu_fused_head.chosen("auto")
  assert cpu_fused_head.chosen("auto", bf16=True)
  _assert_xla_program("auto")


def test_without_the_library_runs_xlas_head(monkeypatch):
  monkeypatch.setattr(native_recurrence, "_loaded",
                      lambda: ("no C++ compiler found (set CXX)", ""))
  assert cpu_fused_head.unavailable() == "no C++ compiler found (set CXX)"
  assert not cpu_fused_head.chosen("on", bf16=True)
  _assert_xla_program("on")


def test_a_compute_dtype_other_than_float32_runs_xlas_head():
  assert "float32" in cpu_fused_head.unavailable(jnp.bfloat16)
  assert not cpu_fused_head.chosen("on", jnp.bfloat16)


def test_off_is_xlas_head():
  """off (default) never loads or calls the library."""
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  assert base.get_config().model.cpu_fused_head == "off"
  assert not cpu_fused_head.chosen("off", bf16=True)
  _assert_xla_program("off")
  with pytest.raises(ValueError, match="cpu_fused_head"):
    cpu_fused_head.chosen("always")


def test_on_where_the_call_cannot_run_says_so_once(monkeypatch, caplog):
  monkeypatch.setattr(cpu_fused_head, "unavailable",
                      lambda dtype=None: "no native library here")
  cpu_fused_head._say_unavailable.cache_clear()  # pylint: disable=protected-access
  with caplog.at_level("WARNING"):
    assert not cpu_fused_head.chosen("on")
    assert not cpu_fused_head.chosen("on")
    assert not cpu_fused_head.chosen("auto", bf16=True)
  lines = [r.getMessage() for r in caplog.records
           if "cpu_fused_head" in r.getMessage()]
  assert lines == ["model.cpu_fused_head=on: XLA's head runs instead: "
                   "no native library here"]
