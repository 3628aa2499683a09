"""The native (C++) time loops against the scan they replace.

`native_recurrence.zebra_layer` must give the outputs, final carry and every
gradient of `recurrence.zebra_layer` (the scan with its hand-written backward
pass, itself tested against autodiff and NumPy), for dense and grouped
stripes, with and without remat, at widths and batches that are and are not
multiples of the kernel's vector (16 floats) and row block (4 rows), and for
any split of the work over threads. Where it cannot run, the layer runs the
scan and says why once.
"""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model import lm, native_recurrence, recurrence

IN = 8  # the layer's input width (grouped: IN / S per stripe)

pytestmark = pytest.mark.skipif(
    bool(native_recurrence.unavailable(jnp.float32)),
    reason=f"native kernels: {native_recurrence.unavailable(jnp.float32)}")


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


def _value_and_grads(layer_fn, args):
  """(ys, h, c) and every argument's gradient for fixed random cotangents
  (no gradient path is zero or symmetric)."""
  outs, vjp = jax.vjp(layer_fn, *args)
  rng = np.random.default_rng(7)
  cts = tuple(jnp.asarray(_normal(rng, o.shape), o.dtype) for o in outs)
  return outs, vjp(cts)


NAMES = ["ys", "h", "c", "d_inputs", "d_w_x", "d_bias", "d_h0", "d_c0",
         "d_w_h"]
# max |error| / max(1, max |reference|) per array, measured over the cases
# below: <= 4.8e-7 (a tanh that differs from XLA's in the last bits, sums
# in another order); tolerance 5x.
SCALED_ATOL = 2.5e-6


def _native(remat=False):
  return jax.jit(lambda *a: _value_and_grads(
      lambda *x: native_recurrence.zebra_layer(*x, 1, remat), a))


def _scan(remat=False):
  return jax.jit(lambda *a: _value_and_grads(
      lambda *x: recurrence.zebra_layer(*x, 1, remat), a))


def _assert_close(got, want):
  for name, g, w in zip(NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g), np.asarray(w)
    atol = SCALED_ATOL * max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=name)


CASES = [  # stripes, kind, steps, batch, width
    (2, "dense", 3, 4, 4),       # scalar tails only: G < 16
    (4, "grouped", 5, 3, 5),     # odd width, fewer rows than a row block
    (1, "dense", 4, 9, 20),      # one stripe: its rows split over threads
    (2, "grouped", 3, 6, 32),    # whole vectors, 4-column-vector blocks
    (2, "dense", 2, 5, 80),      # a 64-column block, a vector and a tail
]


@pytest.mark.parametrize("stripes,kind,steps,batch,width", CASES)
def test_matches_scan(stripes, kind, steps, batch, width):
  args = _args(stripes, kind, steps=steps, batch=batch, width=width,
               seed=width)
  _assert_close(_native()(*args), _scan()(*args))


def test_remat_matches_scan():
  """remat: the backward pass recomputes the gates from (c_t, outputs)."""
  args = _args(2, "grouped", steps=4, batch=5, width=24, seed=3)
  _assert_close(_native(remat=True)(*args), _scan(remat=True)(*args))


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_any_thread_split_gives_the_same_bits(monkeypatch, threads):
  """Threads take whole stripes, or a stripe's rows in parts; each row's
  arithmetic is the same whichever thread runs it."""
  args = _args(2, "dense", steps=3, batch=5, width=20, seed=5)
  one = _native()(*args)
  monkeypatch.setattr(native_recurrence, "threads", lambda: threads)
  many = _native()(*args)
  for name, a, b in zip(NAMES, jax.tree.leaves(one), jax.tree.leaves(many)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_the_comparison_is_not_vacuous():
  """A wrong gate shows: the kernel with the forget and input gates' order
  swapped in its weights is far from the scan."""
  args = list(_args(2, "dense", steps=3, batch=4, width=16, seed=9))
  got = _native()(*args)
  w_h = args[5].reshape(2, 16, 4, 16)[:, :, [1, 0, 2, 3]].reshape(2, 16, 64)
  args[5] = w_h
  with pytest.raises(AssertionError):
    _assert_close(got, _scan()(*args))


def test_lm_matches_scan():
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


def test_no_compiler_runs_the_scan_and_says_why(tmp_path):
  """A machine without a C++ compiler (and nothing cached): one warning
  line, and the scan's results."""
  code = (
      "import logging, jax.numpy as jnp, numpy as np\n"
      "from zebra_jax.model import native_recurrence as n, recurrence\n"
      "args = [jnp.ones(s, jnp.float32) * 0.1 for s in "
      "((2, 3, 8), (8, 1, 16), (1, 16), (1, 3, 4), (1, 3, 4), (1, 4, 16))]\n"
      "got = n.zebra_layer(*args, 1, False)\n"
      "want = recurrence.zebra_layer(*args, 1, False)\n"
      "assert all(np.array_equal(g, w) for g, w in zip(got, want))\n")
  env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
         "XDG_CACHE_HOME": str(tmp_path)}
  result = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  lines = [l for l in result.stderr.splitlines() if "running the scan" in l]
  assert len(lines) == 1, result.stderr
  assert "no-such-compiler" in lines[0] or "building" in lines[0], lines
