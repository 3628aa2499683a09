"""model.cpu_bf16_projections: a layer's window products in bf16 on a CPU's
bf16 units.

Where this CPU has AVX512_BF16 and a compiler, the products must run (a
failure to build or load the library fails, never skips): a dense layer's
outputs and every gradient against the same layer whose window products
are float32 dots of operands rounded to bf16, within float32 rounding, far
inside the bf16 rounding that separates both from float32. Everywhere, the
float32 program: with the setting off, where the units are missing, under
another recurrence, the layer's bits are float32's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zebra_jax.model import cpu_bf16_head, lm
from zebra_jax.model.layer import ZebraLSTMLayer
from zebra_jax.model.recurrence import native
from zebra_jax.model.recurrence import scan
from tests.helpers import (BF16_LOSS_TOLERANCE, assert_same_bits,
                           layer_cotangents, lm_loss_step,
                           needs_bf16_units, needs_compiler, normal_array,
                           run_train_steps, tiny_sgd_config,
                           value_and_grads)


# A dense layer of one stripe too large for the loops' own products
# (native._small_stripes): its window products are the ones that change.
T, B, WIDTH = 8, 8, 128

# max |bf16 layer - rounded-operand reference| / max(1, max |reference|)
# per array, measured over three draws: <= 5.2e-7, float32 sums in another
# order. 5x that; the bf16 rounding moves every array by 1.5e-3 to 5e-3
# of float32's.
SCALED_ATOL = 2.5e-6



def _rounded_product(a, b, a_transposed, b_transposed):
  """The native bf16 product's arithmetic as XLA float32 dots: operands
  rounded to bf16 (nearest even), products and sums in float32."""
  rounded = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  contract = ((0 if a_transposed else 1,), (1 if b_transposed else 0,))
  return jax.lax.dot_general(rounded(a), rounded(b), (contract, ((), ())),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)


def _reference_layer(projection):
  """The native layer with its window products as `_rounded_product`'s,
  but the input projection as `projection`'s.

  With the bf16 layer's own projection, the backward products read the
  layer's own dz and h_{t-1}, bit for bit: a last-bit difference there,
  which float32 sums in another order leave in the forward's gates, would
  move some elements across a bf16 rounding boundary, one 2^-8 step of a
  term each, and hide the products' float32 rounding beneath it."""
  def product(a, b, a_transposed, b_transposed):
    if not (a_transposed or b_transposed):  # x W_x: the projection
      return projection(a, b, False, False)
    return _rounded_product(a, b, a_transposed, b_transposed)
  # pylint: disable=protected-access
  return scan.kernel_layer(native._forward, native._backward,
                           native._projected_forward,
                           native._backward_gradients, product)


def _layer_args(stripes=1, width=WIDTH, n_in=WIDTH, grouped=False):
  """A layer's arguments as ZebraLSTMLayer passes them to the recurrence."""
  rng = np.random.default_rng(0)
  s, g = stripes, width
  inputs, w_x = (((s, T, B, n_in // s), (s, n_in // s, 4 * g)) if grouped
                 else ((T, B, n_in), (n_in, s, 4 * g)))
  return tuple(jnp.asarray(normal_array(rng, shape, scale)) for shape, scale
               in ((inputs, 1.0), (w_x, 1 / np.sqrt(n_in)), ((s, 4 * g), 0.2),
                   ((s, B, g), 0.5), ((s, B, g), 0.5),
                   ((s, g, 4 * g), 0.8 / np.sqrt(g))))


def _scaled_error(got, want):
  want = np.asarray(want, np.float64)
  return np.abs(np.asarray(got, np.float64) - want).max() / max(
      1.0, np.abs(want).max())


def _bf16_calls(fn, args) -> int:
  """How many native bf16 matmuls fn's gradient program calls."""
  grad = jax.grad(lambda *a: sum(x.sum() for x in fn(*a)),
                  argnums=tuple(range(len(args))))
  return jax.jit(grad).lower(*args).as_text().count(native.BF16_MATMUL)


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("remat", [False, True])
def test_dense_layer_is_float32_sums_of_bf16_operands(this_cpus_build,
                                                      remat):
  """Outputs and final carry within SCALED_ATOL of the layer whose window
  products round their operands to bf16 and sum in float32; with the same
  layer's projection, the gradients of every argument too; each array
  moved off float32's by the rounding."""
  assert not cpu_bf16_head.unavailable(), cpu_bf16_head.unavailable()
  args = _layer_args()
  bf16 = lambda *a: native.zebra_layer(*a, 1, remat, True)
  # x W_x (under remat twice: the gates recomputed), dz W_xᵀ, xᵀ dz and
  # h_prevᵀ dz.
  assert _bf16_calls(bf16, args) == 4 + remat
  cotangents = layer_cotangents(args)
  run = lambda fn: jax.tree.leaves(value_and_grads(fn, args, cotangents))
  got = run(bf16)
  rounded = run(lambda *a: _reference_layer(_rounded_product)(*a, remat,
                                                              True))
  own = run(lambda *a: _reference_layer(native.bf16_product)(*a, remat,
                                                             True))
  float32 = run(lambda *a: native.zebra_layer(*a, 1, remat))
  for g, w in zip(got[:3], rounded[:3]):  # ys, h, c
    assert _scaled_error(g, w) <= SCALED_ATOL
  for g, w, f in zip(got, own, float32):
    assert _scaled_error(g, w) <= SCALED_ATOL
    assert _scaled_error(g, f) > 100 * SCALED_ATOL


@needs_compiler
@needs_bf16_units
@pytest.mark.parametrize("stripes,width,n_in,grouped,calls", [
    (1, WIDTH, WIDTH, False, 4),
    (2, WIDTH, WIDTH, False, 3),  # h_prevᵀ dz batched over stripes: float32
    (2, WIDTH, 2 * WIDTH, True, 0),  # every product batched: float32
    (1, 32, 32, False, 0),  # small stripes: the loops' own float32 products
])
def test_products_in_bf16_are_large_stripes_unbatched(
    this_cpus_build, stripes, width, n_in, grouped, calls):
  args = _layer_args(stripes, width, n_in, grouped)
  assert _bf16_calls(lambda *a: native.zebra_layer(*a, 1, False, True),
                     args) == calls


@needs_compiler
@needs_bf16_units
def test_a_sampling_steps_few_rows_run_float32(this_cpus_build):
  """One step of B rows (under native.BF16_MIN_ROWS): float32 products."""
  inputs, *rest = _layer_args()
  assert _bf16_calls(lambda *a: native.zebra_layer(*a, 1, False, True),
                     (inputs[:1], *rest)) == 0


def _model_cfg(setting, recurrence="native"):
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  cfg = base.get_config().model
  cfg.update(vocab_size=64, embed_size=WIDTH, hidden_size=WIDTH,
             num_layers=1, num_stripes=1, dropout_embed=0.0,
             dropout_hidden=0.0, dropout_output=0.0, recurrence=recurrence,
             cpu_bf16_projections=setting)
  return cfg


def _loss_and_grads(setting, recurrence="native"):
  """A ZebraLM's mean cross-entropy and its gradients, and how many native
  bf16 matmuls the compiled program calls."""
  step, params = lm_loss_step(_model_cfg(setting, recurrence), B, T)
  calls = step.lower(params).as_text().count(native.BF16_MATMUL)
  return step(params), calls


@needs_compiler
@needs_bf16_units
def test_lm_loss_is_within_the_gpu_reports_bf16_precision(this_cpus_build):
  """auto on this CPU calls the products (the head's stay float32: its own
  setting is off); the loss is within BF16_LOSS_TOLERANCE of float32's and
  every gradient within 1% of float32's largest."""
  (got, got_g), calls = _loss_and_grads("auto")
  (want, want_g), no_calls = _loss_and_grads("off")
  assert (calls, no_calls) == (4, 0)
  assert abs(float(got) - float(want)) <= BF16_LOSS_TOLERANCE
  assert float(got) != float(want)  # the products did change
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=0,
                               atol=1e-2 * max(1e-6, np.abs(w).max()))


@needs_compiler
def test_off_is_the_layers_float32_call(this_cpus_build):
  """off builds float32 layers; their layer call is the recurrence's
  without the setting's argument, bitwise, with no bf16 call."""
  model = lm.ZebraLM(_model_cfg("off"), rngs=nnx.Rngs(0))
  assert not any(layer.bf16_projections for layer in model.layers)
  args = _layer_args()
  cotangents = layer_cotangents(args)
  off = lambda *a: native.zebra_layer(*a, 1, False, False)
  without = lambda *a: native.zebra_layer(*a, 1, False)
  assert _bf16_calls(off, args) == 0
  assert_same_bits(value_and_grads(off, args, cotangents),
                    value_and_grads(without, args, cotangents))


@needs_compiler
def test_without_the_units_auto_is_off(this_cpus_build, monkeypatch):
  """auto where cpu_bf16_head.unavailable() names a reason (no units, a
  build without them, no library, a GPU): off's program, bitwise."""
  (want, want_g), _ = _loss_and_grads("off")
  monkeypatch.setattr(cpu_bf16_head, "unavailable",
                      lambda: "this CPU has no avx512_bf16")
  (got, got_g), calls = _loss_and_grads("auto")
  assert calls == 0
  assert float(got) == float(want)
  assert_same_bits(got_g, want_g)


def test_other_recurrences_run_float32():
  """auto under the scan (as under the Pallas kernels): its products stay
  float32, off's bits."""
  (got, got_g), calls = _loss_and_grads("auto", "scan")
  (want, want_g), _ = _loss_and_grads("off", "scan")
  assert calls == 0
  assert float(got) == float(want)
  assert_same_bits(got_g, want_g)


def test_setting_is_checked():
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  assert base.get_config().model.cpu_bf16_projections == "off"
  assert not cpu_bf16_head.chosen("off", "cpu_bf16_projections")
  with pytest.raises(ValueError, match="cpu_bf16_projections: 'on'"):
    cpu_bf16_head.chosen("on", "cpu_bf16_projections")
  with pytest.raises(ValueError, match="cpu_bf16_projections"):
    lm.ZebraLM(_model_cfg("on"), rngs=nnx.Rngs(0))
  layer = ZebraLSTMLayer(8, 8, 1, rngs=nnx.Rngs(0))
  assert not layer.bf16_projections


@needs_compiler
@needs_bf16_units
def test_training_with_auto_lowers_the_loss(this_cpus_build):
  """wt103:tiny widened to a dense layer of large stripes, auto: its layers
  take the products, and the loss on a repeated batch of counting
  sequences (each id followed by the next) falls."""
  cfg = tiny_sgd_config(embed_size=WIDTH, hidden_size=WIDTH, num_stripes=1,
                        stripe_input="dense", head="full",
                        recurrence="native", cpu_bf16_projections="auto")
  cfg.optim.learning_rate = 5.0
  model = lm.ZebraLM(cfg.model, rngs=nnx.Rngs(0))
  assert all(layer.bf16_projections for layer in model.layers)
  b, t, v = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  ids = ((np.arange(b)[:, None] + np.arange(t + 1)) % v).astype(np.int32)
  batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:],
           "reset": np.asarray(True)}
  _, metrics = run_train_steps(cfg, 1, [batch] * 8)
  losses = [float(m["loss_sum"] / m["count"]) for m in metrics]
  assert np.all(np.isfinite(losses))
  assert losses[-1] < losses[0] - 0.3, losses
