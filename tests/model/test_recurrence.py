"""The hand-written backward pass of the striped recurrence, against JAX's
autodiff of the same scan and against PyTorch's nn.LSTM backward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model.recurrence import scan as recurrence


def _inputs(stripes, width, batch=3, time=6, features=5, seed=0,
            dtype=jnp.float32):
  """(inputs, w_x, bias, h0, c0, w_h) for zebra_layer."""
  k = jax.random.split(jax.random.key(seed), 6)
  inputs = jax.random.normal(k[0], (time, batch, features)).astype(dtype)
  w_x = (0.5 * jax.random.normal(k[1], (features, stripes, 4 * width))
         ).astype(dtype)
  bias = 0.3 * jax.random.normal(k[2], (stripes, 4 * width))
  h0 = 0.5 * jax.random.normal(k[3], (stripes, batch, width))
  c0 = 0.5 * jax.random.normal(k[4], (stripes, batch, width))
  w_h = (0.4 * jax.random.normal(k[5], (stripes, width, 4 * width))
         ).astype(dtype)
  return inputs, w_x, bias, h0, c0, w_h


def _vjp(fn, args, *static, seed=1):
  """Outputs and the gradient of every input under random cotangents on
  every output (the window's ys and both final states)."""
  out, pull = jax.vjp(lambda *a: fn(*a, *static), *args)
  keys = jax.random.split(jax.random.key(seed), 3)
  cts = tuple(jax.random.normal(k, o.shape).astype(o.dtype)
              for k, o in zip(keys, out))
  return out, pull(cts)


def test_gates_match_sigmoid_and_tanh_in_float64():
  # _activate computes all four gates with one tanh: sigmoid(x) as
  # (1 + tanh(x / 2)) / 2.
  z = np.linspace(-30.0, 30.0, 12 * 1667).reshape(-1, 12)  # G = 3
  gates = np.asarray(recurrence._activate(jnp.asarray(z, jnp.float32)))
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))
  i, f, g, o = np.split(z, 4, axis=-1)
  expected = np.concatenate([sigmoid(i), sigmoid(f), np.tanh(g), sigmoid(o)],
                            axis=-1)
  np.testing.assert_allclose(gates, expected, rtol=0, atol=5e-7)


@pytest.mark.parametrize("stripes,width", [(1, 8), (4, 3)])
@pytest.mark.parametrize("remat", [False, True])
def test_backward_matches_autodiff(stripes, width, remat):
  args = _inputs(stripes, width)
  out, grads = _vjp(recurrence.zebra_layer, args, 1, remat)
  want_out, want_grads = _vjp(recurrence.zebra_layer_autodiff, args)
  for got, want in zip(out + grads, want_out + want_grads):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  assert all(np.abs(np.asarray(g)).max() > 1e-2 for g in grads)


def test_backward_matches_autodiff_in_bfloat16():
  args = _inputs(2, 8, dtype=jnp.bfloat16)
  _, grads = _vjp(recurrence.zebra_layer, args)
  _, want = _vjp(recurrence.zebra_layer_autodiff, args)
  assert grads[5].dtype == grads[0].dtype == jnp.bfloat16  # compute dtype
  for got, ref in zip(grads, want):
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(ref, np.float32),
                               atol=0.03 * scale, rtol=0)


def test_unroll_does_not_change_the_backward_pass():
  args = _inputs(2, 4, time=7)
  _, want = _vjp(recurrence.zebra_layer, args, 1)
  _, got = _vjp(recurrence.zebra_layer, args, 3)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_remat_keeps_less_for_the_backward_pass():
  """What the forward pass hands to the backward pass: remat keeps (c, h)
  but not the 4G gates."""
  args = _inputs(2, 4, time=7)
  sizes = {}
  for remat in (False, True):
    _, residuals = recurrence._zebra_layer_fwd(*args, 1, remat)  # pylint: disable=protected-access
    sizes[remat] = sum(x.size for x in jax.tree.leaves(residuals[3]))
  assert sizes[True] * 3 == sizes[False]  # 2G vs 6G per stripe, row, step


def test_one_stripe_backward_matches_torch_lstm():
  """S = 1 is nn.LSTM: the same loss gives the same gradients for the
  inputs, h0, c0, W_hh, W_ih and the bias."""
  torch = pytest.importorskip(
      "torch", reason="the PyTorch reference needs torch: pip install torch")
  batch, time, width = 3, 5, 4
  x_proj, _, _, h0, c0, w_h = _inputs(1, width, batch, time,
                                      features=4 * width, seed=3)
  w_x = jnp.eye(4 * width)[:, None, :]  # inputs are the gate inputs
  bias = jnp.zeros((1, 4 * width))
  lstm = torch.nn.LSTM(input_size=4 * width, hidden_size=width).double()
  with torch.no_grad():  # identity input weights: x_t is the gate input
    lstm.weight_ih_l0.copy_(torch.eye(4 * width))
    lstm.bias_ih_l0.zero_()
    lstm.bias_hh_l0.zero_()
    lstm.weight_hh_l0.copy_(torch.from_numpy(np.asarray(w_h[0]).T.copy()))
  tx = torch.from_numpy(np.asarray(x_proj, np.float64)).requires_grad_()
  th0 = torch.from_numpy(np.asarray(h0, np.float64)).requires_grad_()
  tc0 = torch.from_numpy(np.asarray(c0, np.float64)).requires_grad_()
  out, (h_n, c_n) = lstm(tx, (th0, tc0))
  weights = np.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
  loss = ((out * torch.from_numpy(weights)).sum() + (h_n * c_n).sum())
  loss.backward()

  def jax_loss(x_proj, h0, c0, w_h, w_x, bias):
    ys, h, c = recurrence.zebra_layer(x_proj, w_x, bias, h0, c0, w_h)
    return (ys[0] * weights).sum() + (h * c).sum()  # ys [S=1, T, B, G]
  grads = jax.grad(jax_loss, argnums=(0, 1, 2, 3, 4, 5))(
      x_proj, h0, c0, w_h, w_x, bias)
  np.testing.assert_allclose(grads[0], tx.grad.numpy(), atol=1e-5)
  np.testing.assert_allclose(grads[1], th0.grad.numpy(), atol=1e-5)
  np.testing.assert_allclose(grads[2], tc0.grad.numpy(), atol=1e-5)
  np.testing.assert_allclose(grads[3][0], lstm.weight_hh_l0.grad.numpy().T,
                             atol=1e-5)
  np.testing.assert_allclose(grads[4][:, 0], lstm.weight_ih_l0.grad.numpy().T,
                             atol=1e-5)
  np.testing.assert_allclose(grads[5][0], lstm.bias_ih_l0.grad.numpy(),
                             atol=1e-5)


def _while_bodies(hlo_text):
  """{name: text} of the computations that compiled while loops run."""
  names = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo_text))
  bodies, current = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"%?([\w.\-]+) \(.*\{$", line)
    if head:
      current = head.group(1) if head.group(1) in names else None
      if current:
        bodies[current] = []
    elif current:
      bodies[current].append(line)
  assert set(bodies) == names, (names, set(bodies))
  return {name: "\n".join(lines) for name, lines in bodies.items()}


@pytest.mark.parametrize("stripes,width,grouped", [(1, 8, False),
                                                   (4, 3, False),
                                                   (4, 3, True)])
def test_time_loops_copy_no_window(stripes, width, grouped):
  # Each time step must read and write only its own slice of the window
  # buffers. A step that copied a whole window (XLA's answer when it cannot
  # prove a buffer is read before it is overwritten in place) would make
  # the loop O(T^2) in memory traffic, with the results still right.
  time_steps, batch = 16, 4
  args = _inputs(stripes, width, batch=batch, time=time_steps,
                 features=stripes * 5)
  if grouped:
    inputs, _, bias, h0, c0, w_h = args
    inputs = jnp.moveaxis(inputs.reshape(time_steps, batch, stripes, 5), 2, 0)
    w_x = 0.5 * jax.random.normal(jax.random.key(7), (stripes, 5, 4 * width))
    args = (inputs, w_x, bias, h0, c0, w_h)

  def loss(*a):
    ys, h, c = recurrence.zebra_layer(*a, 1, False)
    return jnp.sum(ys ** 2) + jnp.sum(h * c)

  hlo = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).lower(
      *args).compile().as_text()
  bodies = _while_bodies(hlo)
  assert len(bodies) >= 2  # the forward and the reverse loop
  window = time_steps * batch * width * stripes  # elements of [S, T, B, G]
  for name, body in bodies.items():
    for shape in re.findall(r"= f32\[([\d,]+)\][^ ]* copy\(", body):
      size = np.prod([int(d) for d in shape.split(",")])
      assert size < window, f"{name} copies a window-sized f32[{shape}]"
