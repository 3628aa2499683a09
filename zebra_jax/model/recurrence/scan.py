"""A ZebraLSTM layer's window with a hand-written backward pass.

Autodiff of a `lax.scan` keeps every intermediate of the cell and, worse,
accumulates the recurrent weight gradient dW_h += h_{t-1}^T dz_t inside the
reverse loop: T small matmuls plus T read-modify-writes of W_h's gradient.
cuDNN does what this module does instead:

  forward   x_proj = inputs W_x + b for the whole window (one matmul), then a
            scan over t: z_t = x_proj_t + h_{t-1} W_h, gates, c_t, h_t.
  backward  the gate derivatives that do not depend on the incoming gradient
            are computed for the whole window at once; a reverse scan carries
            (dh, dc) and runs only multiply-adds and dh_{t-1} = dz_t W_h^T per
            step; then dW_h = sum_t h_{t-1}^T dz_t, dW_x, db and d inputs are
            one large matmul (or sum) each over the whole window.

What the backward pass keeps from the forward pass:
  remat=False  the activated gates, c_t and h_{t-1}: 6G floats per stripe,
               row and step (autodiff keeps about twice that).
  remat=True   only c_t and h_{t-1} (2G); the gates are recomputed before the
               reverse scan as inputs W_x + b + h_{t-1} W_h for all t at once:
               two large, efficient matmuls instead of a second sequential
               forward pass (what `jax.checkpoint` around the scan would do).

Two ways a stripe reads its input (the inputs' rank says which):
  dense    inputs [T, B, I] time-major, w_x [I, S, 4G]: every stripe reads
           the whole input.
  grouped  inputs [S, T, B, I/S] stripe-major, w_x [S, I/S, 4G]: stripe s
           reads only its own slice (the G-LSTM of Kuchaiev & Ginsburg,
           2017); every matmul of the layer is a batch of S matmuls, each
           S times smaller than the dense one.

Shapes: bias [S, 4G] float32, h and c [S, B, G] float32, inputs, w_x
and w_h [S, G, 4G] in the compute dtype. Every window-sized tensor (projected
inputs, saved states, outputs [S, T, B, G] in the compute dtype, gate
derivatives) is stripe-major [S, T, B, ...]: the layout in which the
batched matmuls before and after the time loop read and write their
operands, so none of them is transposed; a time step reads and writes S
contiguous [B, ...] blocks. Gates are ordered [i | f | g | o] inside each
stripe, as in PyTorch.
"""

import functools
import logging

import jax
import jax.numpy as jnp


_warned = set()


def warn_once(message: str) -> None:
  """Logs a warning the first time this process sees it: the kernels' "running
  the scan instead" lines, which every traced layer would repeat."""
  if message not in _warned:
    _warned.add(message)
    logging.warning("%s", message)


def _activate(z):
  """Pre-activations [..., 4G] -> gates [i | f | g | o]: sigmoid, tanh for g.

  All four gates are one tanh over the whole row, sigmoid(x) being
  (1 + tanh(x / 2)) / 2: on a CPU one elementwise pass instead of four, which
  made a grouped layer's forward and backward pass faster; equal to the
  separate functions' accuracy (largest error against float64: 2.5e-7, both).
  """
  g = z.shape[-1] // 4
  scale = jnp.repeat(jnp.asarray([0.5, 0.5, 1.0, 0.5], z.dtype), g)
  shift = jnp.repeat(jnp.asarray([0.5, 0.5, 0.0, 0.5], z.dtype), g)
  return jnp.tanh(z * scale) * scale + shift


def _stripe_cell(x_t, h, c, w_h):
  """One stripe, one step: x_t [B, 4G], h and c [B, G], w_h [G, 4G].

  Returns the activated gates [B, 4G] (what the backward pass needs), c', h'.
  """
  gates = _activate(x_t + jnp.dot(h.astype(w_h.dtype), w_h,
                                  preferred_element_type=jnp.float32))
  i, f, g, o = jnp.split(gates, 4, axis=-1)
  c_new = f * c + i * g
  h_new = o * jnp.tanh(c_new)
  return gates, c_new, h_new


_cell = jax.vmap(_stripe_cell)  # all stripes: one batched matmul [S, B, G] x [S, G, 4G]


def _matmul(a, b, contract, batch=((), ())):
  """lax.dot_general into float32: the operand order and the one contracted
  axis stated, where einsum may swap the operands or contract (t, b) as two
  axes in another order, either of which makes XLA copy a window-sized
  operand (or the result) into a transposed layout first."""
  return jax.lax.dot_general(a, b, (contract, batch),
                             preferred_element_type=jnp.float32)


def _window_product(a, b, a_transposed=False, b_transposed=False,
                    bf16_product=None):
  """op(a) op(b) into float32: matrices, or batches of them over a leading
  stripe axis (op transposes a batch's last two axes).

  bf16_product: None, XLA's float32 dot; else a 2-D product with bf16
  operands and float32 sums (`native.bf16_product`, model.
  cpu_bf16_projections), which a batch of one stripe takes too. A batch of
  several stripes keeps XLA's batched float32 dot: one bf16 call per
  stripe ran at 0.57x to 1.89x its speed by shape and product (2 to 16
  stripes of 64 to 512 units, 2 Zen 4 cores), no steady gain, where a
  dense layer's one product ran 1.5-1.9x faster (lab/results-log.md).
  """
  lead = a.ndim - 2
  if bf16_product is not None and (not lead or a.shape[0] == 1):
    if not lead:
      return bf16_product(a, b, a_transposed, b_transposed)
    return bf16_product(a[0], b[0], a_transposed, b_transposed)[None]
  contract = ((lead + (0 if a_transposed else 1),),
              (lead + (1 if b_transposed else 0),))
  return _matmul(a, b, contract, ((0,), (0,)) if lead else ((), ()))


def project_inputs(inputs, w_x, bias, bf16_product=None):
  """inputs W_x + b for the whole window -> [S, T, B, 4G] float32.

  dense [T, B, I] x [I, S, 4G] as one [T*B, I] x [I, S*4G] matmul; grouped
  [S, T, B, I/S] x [S, I/S, 4G], a batched matmul whose batch axis leads
  both operands and the result. bf16_product: `_window_product`'s.
  """
  if inputs.ndim == 3:
    t, b, i = inputs.shape
    _, s, k = w_x.shape
    x_proj = _window_product(inputs.reshape(t * b, i), w_x.reshape(i, s * k),
                             bf16_product=bf16_product)
    x_proj = jnp.moveaxis(x_proj.reshape(t, b, s, k), 2, 0)
  else:
    s, t, b, i = inputs.shape
    x_proj = _window_product(inputs.reshape(s, t * b, i), w_x,
                             bf16_product=bf16_product
                             ).reshape(s, t, b, w_x.shape[-1])
  return x_proj + bias[:, None, None, :]


def _scan_time(step, carry, xs, reverse=False, unroll=1, overwrite=None):
  """`lax.scan` over axis 1 of stripe-major [S, T, ...] arrays.

  step(carry, xs[:, t]) -> (carry, out_t [S, ...]); the outs come back
  stacked as [S, T, ...]. Reading and writing the window in place (dynamic
  slices of S contiguous blocks) keeps it in the matmuls' layout: scanning
  over a leading time axis would need the window transposed on the way in
  and out.

  overwrite {i: j}: the window of out leaf i is written over xs leaf j (same
  shape and dtype), which step t reads before it writes: no buffer to
  allocate and zero for that output, nor a copy of xs leaf j.
  """
  overwrite = overwrite or {}
  xs_leaves, xs_tree = jax.tree.flatten(xs)
  num_steps = xs_leaves[0].shape[1]
  at = lambda leaves, t: xs_tree.unflatten(
      [jax.lax.dynamic_index_in_dim(a, t, 1, keepdims=False) for a in leaves])
  # A step's shapes from its operands' shapes: a window of T = 0 has no
  # step to index.
  one_step = xs_tree.unflatten([jax.ShapeDtypeStruct(
      (a.shape[0], *a.shape[2:]), a.dtype) for a in xs_leaves])
  out_shapes, out_tree = jax.tree.flatten(
      jax.eval_shape(step, carry, one_step)[1])
  buffers = [xs_leaves[overwrite[i]] if i in overwrite else
             jnp.zeros((o.shape[0], num_steps, *o.shape[1:]), o.dtype)
             for i, o in enumerate(out_shapes)]
  read_from = {j: i for i, j in overwrite.items()}
  if num_steps == 0:  # no step to trace: the carry as it came, empty outs
    return carry, out_tree.unflatten(buffers)

  def body(state, t):
    carry, buffers = state
    leaves = [buffers[read_from[j]] if j in read_from else a
              for j, a in enumerate(xs_leaves)]
    carry, out = step(carry, at(leaves, t))
    buffers = [jax.lax.dynamic_update_index_in_dim(buf, o, t, 1)
               for buf, o in zip(buffers, jax.tree.leaves(out))]
    return (carry, buffers), None

  (carry, buffers), _ = jax.lax.scan(
      body, (carry, buffers), jnp.arange(num_steps), reverse=reverse,
      unroll=unroll)
  return carry, out_tree.unflatten(buffers)


def previous_steps(first, window):
  """What each step of a [S, T, ...] window starts from: `first` [S, ...]
  at t = 0, then the window's step t - 1 ([S, T, ...], also for T = 0)."""
  return jnp.concatenate([first[:, None], window[:, :-1]],
                         axis=1)[:, :window.shape[1]]


def _tie(d_ys):
  """A float32 zero that depends on one cotangent element, whatever its
  value (inf or NaN included: 0 x inf would be NaN); a constant zero for an
  empty window, where there is no work to order."""
  if d_ys.size == 0:
    return jnp.zeros((), jnp.float32)
  return 0.0 * jnp.nan_to_num(d_ys.reshape(-1)[0].astype(jnp.float32))


def _forward(x_proj, h0, c0, w_h, unroll, keep):
  """Runs the window. keep: None, "states" (c_t, h_{t-1}) or "gates" (the
  activated gates too): what the backward pass will need, [S, T, ...]."""
  def step(hc, x_t):
    h, c = hc
    gates, c_new, h_new = _cell(x_t, h, c, w_h)
    saved = {None: (), "states": (c_new, h), "gates": (c_new, h, gates)}[keep]
    return (h_new, c_new), (h_new.astype(w_h.dtype), saved)

  # On a CPU the gates overwrite x_proj, the window each step reads them
  # from (tests/model/test_recurrence.py checks that XLA then copies no
  # window per step). Elsewhere each keeps its own window: an accelerator's
  # compiler may fuse that read into several kernels, and copy the window
  # every step to keep them apart.
  overwrite = ({3: 0} if keep == "gates" and jax.default_backend() == "cpu"
               else None)
  (h, c), (ys, saved) = _scan_time(step, (h0, c0), x_proj, unroll=unroll,
                                   overwrite=overwrite)
  return ys, h, c, saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False):
  """(outputs [S, T, B, G] in w_h's dtype, final h, final c)."""
  del remat  # only changes what the backward pass keeps
  return zebra_layer_autodiff(inputs, w_x, bias, h0, c0, w_h, unroll)


def _zebra_layer_fwd(inputs, w_x, bias, h0, c0, w_h, unroll, remat):
  x_proj = project_inputs(inputs, w_x, bias)
  ys, h, c, saved = _forward(x_proj, h0, c0, w_h, unroll,
                             keep="states" if remat else "gates")
  return (ys, h, c), (inputs, w_x, bias, saved, c0, w_h)


def _zebra_layer_bwd(unroll, remat, residuals, cotangents):
  inputs, w_x, bias, saved, c0, w_h = residuals
  d_ys, d_h_last, d_c_last = cotangents
  dt = w_h.dtype
  # Tie all window-scale work below to the incoming gradient with a real data
  # dependency (0 * one cotangent element made finite; XLA keeps float
  # x * 0, which it cannot prove finite). Otherwise XLA schedules it as soon
  # as the forward pass has run, and its window-sized results stay alive
  # through every later layer (optimization barriers are gone by the time
  # the CPU backend schedules): a few % more memory without remat, and none
  # saved with it. A NaN in that element must not reach every gradient: it
  # lands where the native loops put it.
  tie = _tie(d_ys)
  if remat:
    cs, h_prev = saved
    h_prev = h_prev + tie
    s, t, b, g = h_prev.shape
    gates = _activate(
        project_inputs(inputs, w_x + tie.astype(w_x.dtype), bias)
        + _matmul(h_prev.astype(dt).reshape(s, t * b, g), w_h, ((2,), (1,)),
                  ((0,), (0,))).reshape(s, t, b, 4 * g))
  else:
    cs, h_prev, gates = saved
    gates = gates + tie
  cs = cs + tie
  dz, dh0, dc0 = reverse_window(d_ys, gates, cs, c0, w_h, d_h_last, d_c_last,
                                unroll)
  return window_gradients(dz, inputs, h_prev, w_x, bias, w_h, dh0, dc0)


def reverse_window(d_ys, gates, cs, c0, w_h, d_h, d_c, unroll=1):
  """The backward pass's reverse loop: the activated gates [S, T, B, 4G] and
  c_t [S, T, B, G] of the window, and the cotangents of its outputs and
  final (h, c) -> dz [S, T, B, 4G] f32, dh0, dc0 [S, B, G] f32. The
  signature of `kernel_layer`'s backward: any forward kernel pairs with it.
  """
  dt = w_h.dtype
  # Everything that does not depend on the carried (dh, dc) is computed here,
  # for the whole window at once: large, vectorised, multi-threaded passes.
  # The reverse loop is then only multiply-adds and one matmul per step.
  i, f, g, o = jnp.split(gates, 4, axis=-1)
  c_prev = previous_steps(c0, cs)
  tanh_c = jnp.tanh(cs)
  dc_dh = o * (1.0 - tanh_c * tanh_c)                # dc_t / dh_t
  dz_dcdh = jnp.concatenate([g * i * (1.0 - i),       # d pre-activation i
                             c_prev * f * (1.0 - f),  # f
                             i * (1.0 - g * g),       # g   (per unit dc)
                             tanh_c * o * (1.0 - o)], # o   (per unit dh)
                            axis=-1)
  w_h_t = jnp.swapaxes(w_h, 1, 2)  # [S, 4G, G]: contiguous for dz W_h^T

  def step(carry, xs):
    dh, dc = carry
    d_y, dc_dh_t, dz_dcdh_t, f_t = xs
    dh = dh + d_y.astype(jnp.float32)
    dc = dc + dh * dc_dh_t
    dz = jnp.concatenate([dc, dc, dc, dh], axis=-1) * dz_dcdh_t
    dh_prev = jnp.einsum("sbk,skg->sbg", dz.astype(dt), w_h_t,
                         preferred_element_type=jnp.float32)
    return (dh_prev, dc * f_t), dz

  (dh0, dc0), dz = _scan_time(
      step, (d_h.astype(jnp.float32), d_c.astype(jnp.float32)),
      (d_ys, dc_dh, dz_dcdh, f), reverse=True, unroll=unroll)
  return dz, dh0, dc0


def window_gradients(dz, inputs, h_prev, w_x, bias, w_h, dh0, dc0,
                     bf16_product=None):
  """The backward pass's epilogue, shared with the Pallas kernel.

  From the gate pre-activation gradients of the whole window (dz, float32
  [S, T, B, 4G]) and h_{t-1} of every step: the gradients of zebra_layer's
  arguments, those of the inputs, W_x, b and W_h one matmul (or sum) each.
  bf16_product: `_window_product`'s.
  """
  dt = w_h.dtype
  s, t, b, k = dz.shape
  # (t, b) as one axis: every window contraction runs over one contiguous
  # axis, and no operand is copied into another order first (which a
  # contraction over two axes made XLA do, at a cost on every layer's pass).
  dz_dt = dz.astype(dt).reshape(s, t * b, k)
  d_w_h = _window_product(h_prev.astype(dt).reshape(s, t * b, w_h.shape[1]),
                          dz_dt, a_transposed=True, bf16_product=bf16_product)
  if inputs.ndim == 3:  # dense [T, B, I], w_x [I, S, 4G]
    i = inputs.shape[-1]
    d_w_x = _window_product(inputs.reshape(t * b, i), _stripes_side_by_side(
        dz_dt), a_transposed=True, bf16_product=bf16_product).reshape(i, s, k)
  else:  # grouped [S, T, B, I/S], w_x [S, I/S, 4G]: batched over stripes
    d_w_x = _window_product(inputs.reshape(s, t * b, w_x.shape[1]), dz_dt,
                            a_transposed=True, bf16_product=bf16_product)
  d_bias = dz.sum(axis=(1, 2))
  return (input_gradient(dz, inputs, w_x, bf16_product),
          d_w_x.astype(w_x.dtype), d_bias.astype(bias.dtype), dh0, dc0,
          d_w_h.astype(dt))


def _stripes_side_by_side(window):
  """[S, T*B, K] -> [T*B, S*K]: a dense layer's stripes as one matrix's
  columns, the layout of its w_x [I, S*4G]."""
  s, rows, k = window.shape
  return jnp.moveaxis(window, 0, 1).reshape(rows, s * k)


def input_gradient(dz, inputs, w_x, bf16_product=None):
  """The inputs' gradient, dz W_x^T over the whole window: dense [T, B, I]
  (every stripe's share summed), grouped [S, T, B, I/S]. bf16_product:
  `_window_product`'s."""
  s, t, b, k = dz.shape
  dz_dt = dz.astype(w_x.dtype).reshape(s, t * b, k)
  if inputs.ndim == 3:
    i = inputs.shape[-1]
    d_inputs = _window_product(
        _stripes_side_by_side(dz_dt), w_x.reshape(i, s * k),
        b_transposed=True, bf16_product=bf16_product).reshape(t, b, i)
  else:
    d_inputs = _window_product(dz_dt, w_x, b_transposed=True,
                               bf16_product=bf16_product
                               ).reshape(inputs.shape)
  return d_inputs.astype(inputs.dtype)


zebra_layer.defvjp(_zebra_layer_fwd, _zebra_layer_bwd)


def kernel_layer(forward, backward, projected_forward=None,
                 backward_gradients=None, bf16_product=None,
                 recurrent_product=None):
  """`zebra_layer` with its two time loops run by kernels (the Pallas and
  the native CPU ones); the rest, the input projection, the gates'
  recomputation under remat and the window gradients, is this module's,
  but where the kernels offer their own projection or weight gradients.

  forward(x_proj, h0, c0, w_h, keep) -> (ys, h, c, saved), saved () / (cs,)
    / (cs, gates) for keep None / "states" / "gates".
  backward(d_ys, gates, cs, c0, w_h, d_h, d_c) -> (dz, dh0, dc0), d_h and
    d_c float32.
  projected_forward(inputs, w_x, bias, h0, c0, w_h, keep) -> forward's
    results with the input projection its own, or None (None, or no
    function: this module's projection, then forward).
  backward_gradients(d_ys, gates, cs, c0, w_h, d_h, d_c, inputs, ys, h0) ->
    (dz, dh0, dc0, (d_w_x, d_bias, d_w_h)): backward with the window's
    weight gradients (float32) its own, or None (None, or no function:
    backward, then this module's window matmuls).
  bf16_product(a, b, a_transposed, b_transposed): a 2-D product with bf16
    operands and float32 sums, which the window products outside the time
    loops take where the layer is called with bf16_products=True
    (`_window_product`); the kernels' own products and loops are theirs.
  recurrent_product(h_prev [S, N, G], w_h [S, G, 4G]) -> [S, N, 4G]: the
    product the kernels' loops compute, for remat's recomputed gates to
    match them (None: float32, XLA's).
  Returns layer(inputs, w_x, bias, h0, c0, w_h, remat, bf16_products=False)
  -> (ys, h, c).
  """
  def window_product(bf16_products):
    """bf16_product where the call asks for it; None: XLA's float32."""
    if not bf16_products:
      return None
    if bf16_product is None:
      raise ValueError("bf16_products=True: this kernel has no bf16 product")
    return bf16_product

  def run_forward(inputs, w_x, bias, h0, c0, w_h, keep, bf16_products):
    out = projected_forward and projected_forward(inputs, w_x, bias, h0, c0,
                                                  w_h, keep)
    if out is None:
      out = forward(project_inputs(inputs, w_x, bias,
                                   window_product(bf16_products)),
                    h0, c0, w_h, keep)
    return out

  @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
  def layer(inputs, w_x, bias, h0, c0, w_h, remat, bf16_products=False):
    del remat  # only changes what the backward pass keeps
    ys, h, c, _ = run_forward(inputs, w_x, bias, h0, c0, w_h, None,
                              bf16_products)
    return ys, h, c

  def layer_fwd(inputs, w_x, bias, h0, c0, w_h, remat, bf16_products):
    ys, h, c, saved = run_forward(inputs, w_x, bias, h0, c0, w_h,
                                  "states" if remat else "gates",
                                  bf16_products)
    return (ys, h, c), (inputs, w_x, bias, h0, c0, w_h, ys, saved)

  def layer_bwd(remat, bf16_products, residuals, cotangents):
    products = window_product(bf16_products)
    inputs, w_x, bias, h0, c0, w_h, ys, saved = residuals
    d_ys, d_h_last, d_c_last = cotangents
    dt = w_h.dtype
    # h_{t-1} in the compute dtype is exactly the previous output: the scan
    # casts its float32 h_{t-1} to that dtype before every use in the
    # backward pass, so nothing else needs saving.
    h_prev = previous_steps(h0.astype(dt), ys)
    if remat:  # recompute the gates with two large matmuls, as the scan does
      (cs,) = saved
      s, t, b, g = h_prev.shape
      h_rows = h_prev.reshape(s, t * b, g)
      recurrent = (recurrent_product(h_rows, w_h) if recurrent_product
                   else _matmul(h_rows, w_h, ((2,), (1,)), ((0,), (0,))))
      gates = _activate(project_inputs(inputs, w_x, bias, products)
                        + recurrent.reshape(s, t, b, 4 * g))
    else:
      cs, gates = saved
    d_h32 = d_h_last.astype(jnp.float32)
    d_c32 = d_c_last.astype(jnp.float32)
    out = backward_gradients and backward_gradients(
        d_ys, gates, cs, c0, w_h, d_h32, d_c32, inputs, ys, h0)
    if out is None:
      dz, dh0, dc0 = backward(d_ys, gates, cs, c0, w_h, d_h32, d_c32)
      return window_gradients(dz, inputs, h_prev, w_x, bias, w_h, dh0, dc0,
                              products)
    dz, dh0, dc0, (d_w_x, d_bias, d_w_h) = out
    return (input_gradient(dz, inputs, w_x, products),
            d_w_x.astype(w_x.dtype),
            d_bias.astype(bias.dtype), dh0, dc0, d_w_h.astype(dt))

  layer.defvjp(layer_fwd, layer_bwd)
  return layer



def zebra_layer_autodiff(inputs, w_x, bias, h0, c0, w_h, unroll=1):
  """The same function left to JAX's autodiff: the reference that tests and
  the benchmark compare the hand-written backward pass against."""
  ys, h, c, _ = _forward(project_inputs(inputs, w_x, bias), h0, c0, w_h, unroll,
                         keep=None)
  return ys, h, c
