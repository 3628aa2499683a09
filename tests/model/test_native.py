"""The native (C++) time loops against the scan they replace.

`native_recurrence.zebra_layer` must give the outputs, final carry and every
gradient of `recurrence.zebra_layer` (the scan with its hand-written backward
pass, itself tested against autodiff and NumPy), for dense and grouped
stripes, with and without remat, at widths and batches that are and are not
multiples of the kernel's vector (16 floats) and row block (4 rows), for any
split of the work over threads, for one step (sampling), forward only, empty
windows (B, T or S = 0), and NaN or infinities anywhere (inputs, weights,
states, cotangents): the same non-finite values in the same places.
Every comparison runs for this CPU's build and, on x86-64, for an AVX2
(x86-64-v3) and a baseline (x86-64) build, so a machine with AVX-512 also
tests the code every other CPU runs. Where there is a compiler
a failed build fails these tests; without one they skip, and
test_native_build.py covers that machine.
"""

import logging
import os
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model import lm
from zebra_jax.model.recurrence import native as native_recurrence
from zebra_jax.model.recurrence import native_build
from zebra_jax.model.recurrence import scan as recurrence

IN = 8  # the layer's input width (grouped: IN / S per stripe)

# The -march builds each comparison runs with ("native": this CPU's), and
# the vector instructions each must have been compiled for.
MARCHES = {
    "x86_64": {"native": None, "x86-64-v3": "avx2", "x86-64": "sse2"},
    "aarch64": {"native": "neon", "armv8-a": "neon"},
}.get(platform.machine(), {"native": None})


def _require_library():
  """Skips only where no library can exist (no compiler, none given); a
  build that fails beside a compiler fails the test."""
  if (native_build.compiler() is None
      and not os.environ.get(native_build.LIB_ENV)):
    pytest.skip("no C++ compiler (test_native_build.py covers this machine)")
  why = native_recurrence.unavailable(jnp.float32)
  assert not why, why


@pytest.fixture(params=list(MARCHES))
def march(request, monkeypatch):
  """Each comparison once per build target."""
  monkeypatch.setenv(native_build.MARCH_ENV, request.param)
  monkeypatch.delenv(native_build.LIB_ENV, raising=False)
  _require_library()
  return request.param


@pytest.fixture
def native():
  """This CPU's build (or $ZEBRA_JAX_NATIVE_LIB's library)."""
  _require_library()


def _normal(rng, shape, scale=1.0):
  return (scale * rng.standard_normal(shape)).astype(np.float32)


def _args(stripes, kind, *, steps, batch, width, n_in=IN, seed=0,
          dtype=jnp.float32):
  """Layer arguments as ZebraLSTMLayer passes them (see recurrence.py);
  U_s scales as 1/sqrt(G), so gates stay off saturation at every width."""
  rng = np.random.default_rng(seed)
  s, g = stripes, width
  if kind == "dense":
    inputs = _normal(rng, (steps, batch, n_in))
    w_x = _normal(rng, (n_in, s, 4 * g), 1.0 / np.sqrt(n_in))
  else:  # grouped: stripe s reads its own n_in / S inputs
    inputs = _normal(rng, (s, steps, batch, n_in // s))
    w_x = _normal(rng, (s, n_in // s, 4 * g), 1.0 / np.sqrt(n_in // s))
  w_h = _normal(rng, (s, g, 4 * g), 0.8 / np.sqrt(g))
  return (jnp.asarray(inputs, dtype), jnp.asarray(w_x, dtype),
          jnp.asarray(_normal(rng, (s, 4 * g), 0.2)),
          jnp.asarray(_normal(rng, (s, batch, g), 0.5)),
          jnp.asarray(_normal(rng, (s, batch, g), 0.5)),
          jnp.asarray(w_h, dtype))


def _value_and_grads(layer_fn, args, poison=None):
  """(ys, h, c) and every argument's gradient for fixed random cotangents
  (no gradient path is zero or symmetric); poison (which, index, value)
  puts one value into cotangent `which` (0: ys, 1: h, 2: c)."""
  outs, vjp = jax.vjp(layer_fn, *args)
  rng = np.random.default_rng(7)
  cts = [jnp.asarray(_normal(rng, o.shape), o.dtype) for o in outs]
  if poison is not None:
    which, index, value = poison
    cts[which] = cts[which].at[index].set(value)
  return outs, vjp(tuple(cts))


NAMES = ["ys", "h", "c", "d_inputs", "d_w_x", "d_bias", "d_h0", "d_c0",
         "d_w_h"]
# max |error| / max(1, max |reference|) per array, measured over the cases
# below: <= 4.8e-7 (a tanh that differs from XLA's in the last bits, sums
# in another order); tolerance 5x.
SCALED_ATOL = 2.5e-6


def _native(remat=False, poison=None):
  return jax.jit(lambda *a: _value_and_grads(
      lambda *x: native_recurrence.zebra_layer(*x, 1, remat), a, poison))


def _scan(remat=False, poison=None):
  return jax.jit(lambda *a: _value_and_grads(
      lambda *x: recurrence.zebra_layer(*x, 1, remat), a, poison))


def _assert_close(got, want, names=NAMES):
  """Equal shapes and dtypes; NaN, +inf and -inf in the same places; the
  finite values within SCALED_ATOL of the largest finite one."""
  for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    for kind in (np.isnan, np.isposinf, np.isneginf):
      np.testing.assert_array_equal(kind(g), kind(w),
                                    err_msg=f"{name}: {kind.__name__}")
    finite = np.isfinite(w)
    scale = max(1.0, float(np.abs(w[finite]).max(initial=0.0)))
    np.testing.assert_allclose(g[finite], w[finite], rtol=0,
                               atol=SCALED_ATOL * scale, err_msg=name)


CASES = [  # stripes, kind, steps, batch, width
    (2, "dense", 3, 4, 4),       # scalar tails only: G < 16
    (4, "grouped", 5, 3, 5),     # odd width, fewer rows than a row block
    (1, "dense", 4, 9, 20),      # one stripe: its rows split over threads
    (2, "grouped", 3, 6, 32),    # whole vectors, 4-column-vector blocks
    (2, "dense", 2, 5, 80),      # packed panels of W and a vector
    (1, "dense", 3, 11, 57),     # panels, a vector and a scalar tail on
                                 # every build; a full row block and 3
    (1, "dense", 1, 1, 32),      # one step of one row: sampling, dense
    (4, "grouped", 1, 1, 16),    # ... and grouped
    (1, "grouped", 2, 3, 16),    # one stripe, grouped
    (2, "grouped", 24, 6, 16),   # 144 rows a stripe: the weight gradients
                                 # summed in chunks, from the window's end
]


@pytest.mark.parametrize("stripes,kind,steps,batch,width", CASES)
def test_matches_scan(march, stripes, kind, steps, batch, width):
  args = _args(stripes, kind, steps=steps, batch=batch, width=width,
               seed=width)
  _assert_close(_native()(*args), _scan()(*args))


@pytest.mark.parametrize("stripes,kind,width,n_in,small", [
    (8, "grouped", 64, 512, True),   # lab.bench's grouped S=8: 32,768 floats
    (16, "grouped", 32, 512, True),  # a stripe
    (8, "dense", 16, 64, True),      # 5,120
    (8, "dense", 64, 512, False),    # 147,456
    (1, "dense", 512, 512, False)])  # 2,097,152
def test_small_stripes_run_their_projection_and_weight_gradients_natively(
    native, stripes, kind, width, n_in, small):
  """Up to SMALL_STRIPE_FLOATS a stripe, the backward call computes the
  weight gradients too, and a grouped layer's forward loop projects its own
  inputs; larger stripes keep XLA's window matmuls (the comparisons
  above, at widths up to 80, test the library's calls)."""
  s, t, b = stripes, 16, 8
  shapes = ((t, b, n_in) if kind == "dense" else (s, t, b, n_in // s),
            (n_in, s, 4 * width) if kind == "dense" else
            (s, n_in // s, 4 * width),
            (s, 4 * width), (s, b, width), (s, b, width),
            (s, width, 4 * width))
  args = [jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes]
  loss = lambda *a: native_recurrence.zebra_layer(*a)[0].sum()
  text = jax.jit(jax.grad(loss, argnums=(1, 2, 5))).lower(*args).as_text()
  # pylint: disable=protected-access
  targets = set(re.findall(r"zebra_native_\w+(?=_[0-9a-f]{12})", text))
  assert targets == (
      {native_recurrence._BACKWARD_GRADS,
       native_recurrence._FORWARD_PROJECTED} if small and kind == "grouped"
      else {native_recurrence._BACKWARD_GRADS, native_recurrence._FORWARD}
      if small else {native_recurrence._BACKWARD, native_recurrence._FORWARD})


def test_vector_instructions_are_the_targets(march):
  """A build for a target without AVX-512 used none (its code, not this
  CPU's, is what the comparisons above ran)."""
  want = MARCHES[march]
  if want is None:  # native: what this CPU has
    flags = native_build.cpu_features().split()
    want = next((isa for isa in ("avx512f", "avx2", "sse2") if isa in flags),
                native_recurrence.vector_isa())
  assert native_recurrence.vector_isa() == want


def test_remat_matches_scan(native):
  """remat: the backward pass recomputes the gates from (c_t, outputs)."""
  args = _args(2, "grouped", steps=4, batch=5, width=24, seed=3)
  _assert_close(_native(remat=True)(*args), _scan(remat=True)(*args))


@pytest.mark.parametrize("stripes,kind,steps,batch", [
    (1, "dense", 1, 1), (4, "grouped", 1, 1), (2, "dense", 5, 3),
    (3, "grouped", 4, 2), (2, "dense", 1, 5)])
def test_forward_only_matches_scan(march, monkeypatch, stripes, kind, steps,
                                   batch):
  """Evaluation and sampling: no gradient, so nothing kept for one. The
  kernel runs every step here, single steps included (which otherwise run
  as the scan's one step)."""
  monkeypatch.setattr(native_recurrence, "SINGLE_STEPS_NATIVE", True)
  args = _args(stripes, kind, steps=steps, batch=batch, width=24, seed=11)
  layer = lambda f: jax.jit(lambda *a: f(*a, 1, False))
  _assert_close(layer(native_recurrence.zebra_layer)(*args),
                layer(recurrence.zebra_layer)(*args), NAMES[:3])


def test_a_single_step_runs_as_the_scans_step(native):
  """Sampling and serving's decode steps: one step with nothing kept holds
  no call into the library, small or large (XLA fuses the scan's step); a
  window of steps does, and so does a step whose gradient is taken."""
  lowered = lambda fn, args: jax.jit(fn).lower(*args).as_text()
  layer = lambda *a: native_recurrence.zebra_layer(*a, 1, False)
  for width in (32, 512):
    step = _args(1, "dense", steps=1, batch=1, width=width, n_in=width)
    assert "zebra_native" not in lowered(layer, step)
    assert "zebra_native" in lowered(
        lambda *a: _value_and_grads(layer, a), step)
  window = _args(1, "dense", steps=2, batch=1, width=32)
  assert "zebra_native" in lowered(layer, window)


@pytest.mark.parametrize("stripes,kind,steps,batch,remat", [
    (2, "dense", 3, 0, False),    # B = 0: an empty shard
    (2, "grouped", 3, 0, True),
    (2, "dense", 0, 4, False),    # T = 0: an empty window
    (2, "grouped", 0, 4, True),
    (0, "dense", 3, 4, False),    # S = 0: no stripes
])
def test_empty_windows_match_scan(native, stripes, kind, steps, batch, remat):
  """Outputs and every gradient through the layer, forward and backward, on
  both backends (the scan had failed at B = 0 and T = 0, the native layer's
  gradient at T = 0 with a TypeError): the carry passes through, every
  weight gradient is zero."""
  args = _args(stripes, kind, steps=steps, batch=batch, width=16)
  got, want = _native(remat)(*args), _scan(remat)(*args)
  _assert_close(got, want)
  for name, g, a in zip(NAMES[3:], got[1], args):
    assert g.shape == a.shape, name
    if name in ("d_w_x", "d_bias", "d_w_h"):
      np.testing.assert_array_equal(np.asarray(g), 0.0, err_msg=name)


@pytest.mark.parametrize("kind", ["dense", "grouped"])
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_any_thread_split_gives_the_same_bits(native, monkeypatch, threads,
                                              kind):
  """Threads take whole stripes, or a stripe's rows in parts; each row's
  arithmetic is the same whichever thread runs it. The weight gradients
  are summed in the same order inside the backward loop (1 or 2 threads,
  whole stripes) and after it (3 or 7: rows split), over 150 rows a
  stripe, several chunks."""
  args = _args(2, kind, steps=30, batch=5, width=20, seed=5)
  monkeypatch.setattr(native_recurrence, "threads", lambda flops: 1)
  one = _native()(*args)
  monkeypatch.setattr(native_recurrence, "threads", lambda flops: threads)
  many = _native()(*args)
  for name, a, b in zip(NAMES, jax.tree.leaves(one), jax.tree.leaves(many)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("stripes,threads,batch,width", [
    (1, 2, 9, 80), (1, 3, 9, 80), (1, 7, 9, 80), (2, 7, 9, 80), (1, 2, 1, 80),
    (1, 2, 20, 200), (1, 3, 20, 200)])
def test_a_split_by_hidden_units_gives_the_same_bits(march, monkeypatch,
                                                     stripes, threads, batch,
                                                     width):
  """A dense stripe's hidden units split over threads that move in step
  (each its own columns of W, every row; 2, 3 or 7 parts of 80 units, so
  parts end inside a vector on some builds; one row, as sampling; hidden
  200, whose parts end inside a panel: the partial panel's columns): the
  bits of one thread, which match the scan."""
  args = _args(stripes, "dense", steps=16, batch=batch, width=width, seed=6)
  monkeypatch.setattr(native_recurrence, "threads", lambda flops: 1)
  one = _native()(*args)
  monkeypatch.setattr(native_recurrence, "threads", lambda flops: threads)
  monkeypatch.setattr(native_recurrence, "MIN_UNIT_SPLIT_FLOPS", 0)
  assert native_recurrence.unit_parts(stripes, batch, width, threads) > 1
  many = _native()(*args)
  for name, a, b in zip(NAMES, jax.tree.leaves(one), jax.tree.leaves(many)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  _assert_close(many, _scan()(*args))


def test_only_large_dense_stripes_split_by_units():
  """Units split where each thread's share of a time step is worth a wait
  a step (sampling's one row too, at hidden 512); never with a stripe a
  thread."""
  assert native_recurrence.unit_parts(1, 32, 512, 2) == 2   # dense S=1
  assert native_recurrence.unit_parts(1, 32, 512, 16) == 16
  assert native_recurrence.unit_parts(2, 32, 512, 8) == 4
  assert native_recurrence.unit_parts(8, 32, 64, 16) == 1   # grouped S=8
  assert native_recurrence.unit_parts(2, 32, 512, 2) == 1
  assert native_recurrence.unit_parts(1, 1, 512, 2) == 2   # sampling
  assert native_recurrence.unit_parts(1, 1, 512, 8) == 1
  assert native_recurrence.unit_parts(1, 32, 16, 2) == 1    # too little
  # PyTorch's word_language_model LSTM (hidden 200, batch 20): units, each
  # thread half of W and every row, not 10 rows that underfill a block
  assert native_recurrence.unit_parts(1, 20, 200, 2) == 2


def test_threads_are_sized_to_the_work(monkeypatch):
  """A sampling step runs on the calling thread; a training window on every
  core the process has, shared among its devices; between, a thread per
  MIN_FLOPS_PER_THREAD."""
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
  monkeypatch.setattr(jax, "local_device_count", lambda: 1)
  threads, least = native_recurrence.threads, (
      native_recurrence.MIN_FLOPS_PER_THREAD)
  assert threads(2 * 4 * 1 * 1 * 128 * 512) == 1  # S=4, T=B=1, G=128
  assert threads(2 * 64 * 32 * 512 * 2048) == 4   # S=1, T=64, B=32, G=512
  assert threads(3 * least) == 3
  assert threads(0) == 1
  monkeypatch.setattr(jax, "local_device_count", lambda: 8)
  assert threads(2 * 64 * 32 * 512 * 2048) == 1


NAN, INF = float("nan"), float("inf")
# (argument, index, value): a non-finite value put into one element.
POISONS = {
    "nan_input": ("inputs", (1, 2, 3), NAN),
    "inf_input": ("inputs", (2, 0, 5), INF),
    "-inf_input": ("inputs", (0, 3, 1), -INF),
    "nan_w_h": ("w_h", (1, 3, 20), NAN),
    "-inf_w_h": ("w_h", (0, 5, 40), -INF),
    "nan_h0": ("h0", (0, 1, 2), NAN),
    "inf_c0": ("c0", (1, 2, 7), INF),     # a cell that is already infinite
    "nan_bias": ("bias", (0, 17), NAN),
    "nan_w_x": ("w_x", (3, 1, 9), NAN),
}
_ARGS = ["inputs", "w_x", "bias", "h0", "c0", "w_h"]


@pytest.mark.parametrize("poison", list(POISONS))
def test_non_finite_values_propagate_as_in_the_scan(march, poison):
  """One NaN or infinity (S=2, T=6, B=4, G=16): the same NaN and inf in the
  outputs, the carry and every gradient as the scan's (a clamp that turned
  NaN into +-1 hid it from the loss and the trainer's non-finite guard)."""
  name, index, value = POISONS[poison]
  args = list(_args(2, "dense", steps=6, batch=4, width=16, seed=1))
  i = _ARGS.index(name)
  args[i] = args[i].at[index].set(value)
  got, want = _native()(*args), _scan()(*args)
  _assert_close(got, want)
  # It did reach the results (an inf may saturate gates, a NaN spreads).
  assert not all(np.isfinite(a).all() for a in jax.tree.leaves(want))


# (cotangent, index, value): a non-finite value in the incoming gradient of
# ys [S, T, B, G], h or c [S, B, G]. Element 0 of ys's is the one the scan
# orders its window-scale work by.
COTANGENT_POISONS = {
    "nan_d_ys_first": (0, (0, 0, 0, 0), NAN),
    "inf_d_ys_first": (0, (0, 0, 0, 0), INF),
    "nan_d_ys": (0, (1, 2, 3, 4), NAN),
    "nan_d_h": (1, (0, 1, 2), NAN),
    "-inf_d_c": (2, (1, 0, 5), -INF),
}


@pytest.mark.parametrize("poison,remat", [
    *((p, False) for p in COTANGENT_POISONS), ("nan_d_ys_first", True)])
def test_non_finite_cotangents_land_as_in_the_scan(native, poison, remat):
  """One NaN or infinity in a cotangent: the same non-finite gradients on
  both backends, and not every one of them (a NaN in d_ys's first element
  had made all 16,428 of the scan's gradients NaN, against native's 148)."""
  args = _args(2, "dense", steps=6, batch=4, width=16, seed=1)
  which, index, value = COTANGENT_POISONS[poison]
  got = _native(remat, (which, index, value))(*args)
  want = _scan(remat, (which, index, value))(*args)
  _assert_close(got, want)
  grads = jax.tree.leaves(want[1])
  assert not all(np.isfinite(g).all() for g in grads)
  assert any(np.isfinite(g).any() for g in grads)
  if poison == "nan_d_ys_first":  # spreads only backward from step 0
    np.testing.assert_array_equal(np.isnan(want[1][0]).sum(), 8)


def test_overflowing_pre_activation_is_the_scans(march):
  """Weights so large that h W overflows to +inf for one gate column: the
  gates saturate as the scan's do (one step, positive h: every summation
  order overflows)."""
  args = list(_args(2, "dense", steps=1, batch=3, width=16, seed=2))
  args[3] = jnp.abs(args[3])
  args[5] = args[5].at[1, :, 37].set(3e38)
  got, want = _native()(*args), _scan()(*args)
  _assert_close(got, want)


def test_the_comparison_is_not_vacuous(native):
  """A wrong gate shows: the kernel with the forget and input gates' order
  swapped in its weights is far from the scan."""
  args = list(_args(2, "dense", steps=3, batch=4, width=16, seed=9))
  got = _native()(*args)
  w_h = args[5].reshape(2, 16, 4, 16)[:, :, [1, 0, 2, 3]].reshape(2, 16, 64)
  args[5] = w_h
  with pytest.raises(AssertionError):
    _assert_close(got, _scan()(*args))


def test_a_hidden_nan_fails_the_comparison(native):
  """The NaN check itself: a NaN replaced by a finite value shows."""
  args = list(_args(2, "dense", steps=3, batch=4, width=16, seed=9))
  args[0] = args[0].at[1, 1, 1].set(NAN)
  want = _scan()(*args)
  hidden = jax.tree.map(lambda a: jnp.nan_to_num(a, nan=1.0), want)
  with pytest.raises(AssertionError, match="isnan"):
    _assert_close(hidden, want)


def test_lm_matches_scan(native):
  """A whole ZebraLM (grouped stripes, two layers) with
  model.recurrence=native: the loss and its gradients equal the scan's."""
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  cfg = base.get_config().model
  cfg.update(vocab_size=37, embed_size=16, hidden_size=16, num_layers=2,
             num_stripes=4, stripe_input="grouped", dropout_embed=0.0,
             dropout_hidden=0.0, dropout_output=0.0)
  tokens = jax.random.randint(jax.random.key(0), (3, 6), 0, 37)

  def loss_and_grads(kernel):
    cfg.recurrence = kernel
    graphdef, params = nnx.split(lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))
    carry = lm.init_carry(cfg, 3)

    def loss(p):
      logits, _ = lm.apply(graphdef, p, tokens[:, :-1], carry)
      return jnp.mean(jax.nn.logsumexp(logits, -1))
    return jax.jit(jax.value_and_grad(loss))(params)

  (got, got_g), (want, want_g) = loss_and_grads("native"), loss_and_grads(
      "scan")
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=0,
                               atol=SCALED_ATOL * max(1.0, np.abs(w).max()))


def test_a_nan_in_the_recurrence_makes_the_trainer_skip_the_step(native):
  """A NaN in a gate's bias, on the native path: the gradients are not
  finite, so the train step leaves the parameters as they were. (A tanh
  that clamped NaN to +-1 gave finite outputs and gradients: no gradient
  multiplies the bias, so the step went ahead with the NaN in it.)"""
  # pylint: disable=g-import-not-at-top
  from tests.helpers import random_batches, run_train_steps, tiny_sgd_config
  from zebra_jax.runtime import parallel
  from zebra_jax.training import train_state
  cfg = tiny_sgd_config(recurrence="native")
  mesh = parallel.make_mesh(jax.devices()[:1])
  _, _, state = train_state.init_state(cfg, mesh)
  bias = state.params["layers"][0]["b"]
  bias[...] = bias[...].at[0, 0].set(jnp.nan)
  before = jax.device_get(state)
  after, metrics = run_train_steps(cfg, 1, random_batches(cfg, 1),
                                   state=state)
  assert metrics[0]["skipped"] == 1.0
  for x, y in zip(jax.tree.leaves(before.params),
                  jax.tree.leaves(after.params)):
    np.testing.assert_array_equal(x, y)
  # ... and a clean step on the same path goes ahead.
  _, metrics = run_train_steps(cfg, 1, random_batches(cfg, 1))
  assert metrics[0]["skipped"] == 0.0


def test_bfloat16_runs_the_scan_and_says_why_once(caplog, monkeypatch):
  monkeypatch.setattr(recurrence, "_warned", set())  # said before?
  args = _args(2, "dense", steps=3, batch=4, width=8, dtype=jnp.bfloat16)
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      got = native_recurrence.zebra_layer(*args, 1, False)
  want = recurrence.zebra_layer(*args, 1, False)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(w, np.float32))
  lines = [r.getMessage() for r in caplog.records
           if "running the scan instead" in r.getMessage()]
  assert lines == ["model.recurrence=native: it computes in float32, not "
                   "bfloat16; running the scan instead"]


def test_symbolic_shapes_run_the_scan():
  """jax.export traces with symbolic batch and time: the scan runs, so an
  exported model holds no call into this machine's library."""
  args = _args(2, "dense", steps=3, batch=4, width=8)
  b, t = jax.export.symbolic_shape("b, t")
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  shapes[0] = jax.ShapeDtypeStruct((t, b, IN), jnp.float32)
  shapes[3] = shapes[4] = jax.ShapeDtypeStruct((2, b, 8), jnp.float32)
  exported = jax.export.export(jax.jit(
      lambda *a: native_recurrence.zebra_layer(*a, 1, False)))(*shapes)
  assert "zebra_native" not in exported.mlir_module()
  got = exported.call(*args)
  want = recurrence.zebra_layer(*args, 1, False)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6,
                               atol=1e-6)


def _lm_program(recurrence: str, dtype: str = "float32") -> str:
  """The lowered loss gradient of a small ZebraLM."""
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  cfg = base.get_config().model
  cfg.update(vocab_size=37, embed_size=16, hidden_size=16, num_layers=2,
             num_stripes=4, stripe_input="grouped", dropout_embed=0.0,
             dropout_hidden=0.0, dropout_output=0.0, dtype=dtype,
             recurrence=recurrence)
  graphdef, params = nnx.split(lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))
  tokens = jnp.zeros((3, 6), jnp.int32)
  carry = lm.init_carry(cfg, 3)

  def loss(p):
    return jnp.sum(lm.apply(graphdef, p, tokens, carry)[0])
  return jax.jit(jax.grad(loss)).lower(params).as_text()


def test_auto_is_the_default_and_runs_native_on_a_cpu_in_float32(
    native, caplog, monkeypatch):
  """base's model.recurrence=auto: the native loops on a CPU in float32
  (the same program as asking for them), the scan in bfloat16, neither
  with a warning."""
  from zebra_jax.configs import base  # pylint: disable=g-import-not-at-top
  assert base.get_config().model.recurrence == "auto"
  monkeypatch.setattr(recurrence, "_warned", set())
  with caplog.at_level(logging.WARNING):
    auto = _lm_program("auto")
    auto_bf16 = _lm_program("auto", "bfloat16")
  assert "zebra_native" in auto
  assert auto == _lm_program("native")
  assert "zebra_native" not in auto_bf16
  assert auto_bf16 == _lm_program("scan", "bfloat16")
  assert not [r for r in caplog.records if "recurrence" in r.getMessage()]


def test_auto_without_the_library_runs_the_scan_and_says_why_once(
    caplog, monkeypatch):
  monkeypatch.setattr(recurrence, "_warned", set())
  monkeypatch.setattr(native_recurrence, "_loaded",
                      lambda: ("no C++ compiler found (set CXX)", ""))
  with caplog.at_level(logging.WARNING):
    got = _lm_program("auto")
    _lm_program("auto")
  assert "zebra_native" not in got
  assert got == _lm_program("scan")
  lines = [r.getMessage() for r in caplog.records
           if "model.recurrence=auto" in r.getMessage()]
  assert lines == ["model.recurrence=auto: the native time loops are "
                   "unavailable (no C++ compiler found (set CXX)); running "
                   "the scan"]
