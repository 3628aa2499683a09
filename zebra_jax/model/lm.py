"""ZebraLSTM: an LSTM whose hidden state is cut into independent stripes.

A layer of hidden size H has S stripes of width G = H / S. The input projection
is computed for the whole window outside the time loop; only the
block-diagonal recurrence h_s -> 4G gates of stripe s runs inside `lax.scan`.
model.stripe_input says how a stripe reads the layer input: "dense" (the whole
input) or "grouped" (its own 1/S slice, so every matmul of the layer shrinks by
S; a fixed stripe shuffle between layers lets stripes meet). S = 1 is exactly
the classic LSTM (PyTorch `nn.LSTM`, gate order i, f, g, o, with its two
biases summed), under either.
The layer's arithmetic and its hand-written backward pass live in
`recurrence.py`. Traced inside `stripe_parallel(mesh)`, each layer's stripes
are split over the mesh's "stripe" axis (`ZebraLSTMLayer.sharded`): every
device runs the same recurrence on its own stripes, and layer outputs are
exchanged once per window at layer boundaries; the head then scores each
device's share of the rows (`ZebraLM._on_rows`).

Parameters are float32; matmuls run in `dtype` with float32 accumulation, and the
cell state `c`, the carry and the logits stay float32.

The model is an NNX module used functionally: `create` splits it into a graph
definition and a parameter `nnx.State`, and `apply` merges them inside pure,
jittable functions. `apply` gives logits [B, T, V] (exact log-probabilities
with the adaptive head); `token_sums` gives the loss sums that train and eval
steps need, which for the adaptive head never builds [B*T, V].
"""

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from zebra_jax.model import adaptive_softmax as asm, metrics, recurrence
from zebra_jax.model import native_recurrence, pallas_recurrence
from zebra_jax.model.config import DTYPES, ModelConfig
from zebra_jax.model import mesh_axes

# One (h, c) pair per layer, each [batch, hidden] float32.
Carry = tuple[tuple[jax.Array, jax.Array], ...]


# The mesh whose "stripe" axis the layers' stripes are split over while a
# function is traced (`stripe_parallel`); None: every device runs the whole
# model (data parallelism only).
_STRIPE_MESH = contextvars.ContextVar("stripe_mesh", default=None)


@contextlib.contextmanager
def stripe_parallel(mesh):
  """Traces inside this context run each layer per device over `mesh`: its
  rows split over "data", its stripes over "stripe" (a no-op for a mesh of
  one device).

  Pure data parallelism (a stripe axis of one device) runs this way too: left
  to XLA's sharding propagation, the hand-written backward pass gathered the
  whole batch's gate derivatives onto every device and repeated their work
  there; per device, the time loops see only their own rows.
  """
  token = _STRIPE_MESH.set(
      mesh if mesh is not None and mesh.devices.size > 1 else None)
  try:
    yield
  finally:
    _STRIPE_MESH.reset(token)


def stripe_mesh():
  """The mesh `stripe_parallel` set for the trace under way, or None."""
  return _STRIPE_MESH.get()


def with_stripe_parallel(fn, mesh):
  """fn, traced inside `stripe_parallel(mesh)` (fn itself on a mesh of one
  device)."""
  if mesh.devices.size == 1:
    return fn

  def traced(*args):
    with stripe_parallel(mesh):
      return fn(*args)
  return traced


def compute_dtype(name: str) -> jnp.dtype:
  """The jnp dtype of a model.dtype name (one of config.DTYPES)."""
  if name not in DTYPES:
    raise ValueError(f"compute dtype {name!r} is not one of {DTYPES}")
  return getattr(jnp, name)


def _orthogonal_stripes(key, num_stripes, width):
  """Each stripe's recurrent block [G, 4G] starts with orthonormal rows."""
  keys = jax.random.split(key, num_stripes)
  init = jax.nn.initializers.orthogonal()
  return jax.vmap(lambda k: init(k, (width, 4 * width), jnp.float32))(keys)


def dropout(x, rate: float, rng):
  """Inverted dropout; a no-op when rng is None (evaluation) or rate is 0."""
  if rng is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class ZebraLSTMLayer(nnx.Module):
  """One striped LSTM layer: a dense or grouped input projection, and a
  block-diagonal recurrence."""

  def __init__(self, in_features: int, hidden_size: int, num_stripes: int, *,
               rngs: nnx.Rngs, dtype=jnp.float32, unroll: int = 1,
               remat: bool = False, custom_vjp: bool = True,
               grouped: bool = False, kernel: str = "scan"):
    s, width = num_stripes, hidden_size // num_stripes
    if grouped and in_features % s:
      raise ValueError(f"a grouped layer needs in_features={in_features} "
                       f"divisible by num_stripes={s}")
    self.num_stripes, self.width, self.grouped = s, width, grouped
    self.dtype, self.unroll, self.remat = dtype, unroll, remat
    # remat: the backward pass keeps only (h, c) and recomputes the gates.
    # custom_vjp=False: JAX's autodiff of the scan (a reference for tests and
    # the benchmark; it ignores remat).
    self.custom_vjp = custom_vjp
    # scan | pallas | native (pallas_recurrence.py, native_recurrence.py:
    # the same math)
    self.kernel = kernel
    # PyTorch nn.LSTM's uniform init range, 1/sqrt(H). A grouped unit reads
    # S times fewer inputs and recurrent units, so 1/sqrt(H/S) keeps its
    # pre-activation's variance (and S = 1 grouped draws the dense weights).
    bound = 1.0 / (width if grouped else hidden_size) ** 0.5
    # Gate-major inside each stripe: [i | f | g | o].
    # dense w_x [in, S, 4G]: every stripe reads the whole input;
    # grouped w_x [S, in/S, 4G]: stripe s reads inputs s*in/S .. (s+1)*in/S.
    shape = ((s, in_features // s, 4 * width) if grouped
             else (in_features, s, 4 * width))
    # stripe_axis: the axis that counts stripes, split over the mesh's
    # "stripe" axis under stripe parallelism (model/mesh_axes.py).
    self.w_x = nnx.Param(jax.random.uniform(
        rngs.params(), shape, jnp.float32, -bound, bound),
                         stripe_axis=0 if grouped else 1)
    self.w_h = nnx.Param(_orthogonal_stripes(rngs.params(), s, width),
                         stripe_axis=0)  # [S, G, 4G]
    bias = jnp.zeros((s, 4, width), jnp.float32).at[:, 1].set(1.0)  # forget bias 1
    self.b = nnx.Param(bias.reshape(s, 4 * width), stripe_axis=0)

  def __call__(self, inputs: jax.Array, carry: tuple[jax.Array, jax.Array]):
    """Runs the layer over a window.

    Args:
      inputs: [batch, time, in_features], any float dtype.
      carry: (h, c), each [batch, hidden] float32.
    Returns:
      outputs [batch, time, hidden] in the compute dtype, and the new (h, c).
    """
    return self._window(inputs, self.w_x[...], self.b[...], carry[0],
                        carry[1], self.w_h[...])

  def _window(self, inputs, w_x, bias, h0, c0, w_h):
    """`__call__` on the stripes that w_h holds (all, or a device's share):
    inputs [B, T, in] (for a grouped layer: those stripes' inputs), h0 and c0
    [B, their units] -> (outputs [B, T, their units], (h, c))."""
    s, width, dt = w_h.shape[0], self.width, self.dtype
    b, t, n_in = inputs.shape
    if self.grouped:  # stripe-major [S, T, B, in/S]: stripe s's own slice
      inputs = inputs.reshape(b, t, s, n_in // s).transpose(2, 1, 0, 3)
    else:  # time-major [T, B, in]
      inputs = inputs.transpose(1, 0, 2)
    to_stripes = lambda a: a.reshape(b, s, width).transpose(1, 0, 2)  # [S, B, G]
    args = (inputs.astype(dt), w_x.astype(dt), bias,
            to_stripes(h0), to_stripes(c0), w_h.astype(dt))
    if self.custom_vjp:
      layer_fn = {"pallas": pallas_recurrence.zebra_layer,
                  "native": native_recurrence.zebra_layer}.get(
                      self.kernel, recurrence.zebra_layer)
      ys, h, c = layer_fn(*args, self.unroll, self.remat)
    else:
      ys, h, c = recurrence.zebra_layer_autodiff(*args, self.unroll)
    outputs = ys.transpose(2, 1, 0, 3).reshape(b, t, s * width)  # [B, T, H]
    from_stripes = lambda a: a.transpose(1, 0, 2).reshape(b, s * width)
    return outputs, (from_stripes(h), from_stripes(c))

  def sharded(self, inputs: jax.Array, carry, mesh, exchange: str | None):
    """`__call__` with the stripes split over the mesh's "stripe" axis (and
    the batch over "data"): every device runs the unchanged recurrence on its
    own stripes, with no communication inside the time loop.

    Args:
      inputs: [batch, time, in_features]. exchange=None: the embedding,
        replicated over "stripe". "rows": the embedding split by rows over
        every device, gathered for this data group's rows (dense: an
        all-gather; grouped: an all-to-all that also keeps only this
        device's stripes' inputs). Otherwise the previous layer's outputs,
        split along the last axis over "stripe" (each device holds its
        stripes' units), which become this layer's input in one exchange
        per window: "gather" (a dense layer reads all of them: all-gather)
        or "shuffle" (a grouped layer reads its share of the stripe shuffle:
        all-to-all).
      carry: (h, c), each [batch, hidden], split (batch, hidden) over
        ("data", "stripe").
      mesh: the ("data", "stripe") mesh.
    Returns:
      outputs [batch, time, hidden] split along hidden over "stripe", and
      the new (h, c) split as the carry came.
    """
    data, stripe = mesh_axes.DATA_AXIS, mesh_axes.STRIPE_AXIS
    split_in = exchange is not None or self.grouped
    x_spec = (P((data, stripe)) if exchange == "rows" else
              P(data, None, stripe) if split_in else P(data))
    w_x_spec = P(stripe) if self.grouped else P(None, stripe)
    carry_spec, out_spec = P(data, stripe), P(data, None, stripe)
    devices = mesh_axes.stripe_devices(mesh)

    def local(x, w_x, bias, h, c, w_h):
      if exchange == "rows" and devices > 1 and self.grouped:
        # this device's stripes' inputs, for every row of its data group
        x = jax.lax.all_to_all(x, stripe, split_axis=2, concat_axis=0,
                               tiled=True)
      elif exchange == "rows" and devices > 1:
        x = jax.lax.all_gather(x, stripe, axis=0, tiled=True)
      elif exchange == "shuffle" and devices == 1:
        x = stripe_shuffle(x, self.num_stripes)
      elif exchange == "gather" and devices > 1:
        x = jax.lax.all_gather(x, stripe, axis=2, tiled=True)
      elif exchange == "shuffle":
        x = _shuffle_exchange(x, self.num_stripes, devices)
      y, (h, c) = self._window(x, w_x, bias, h, c, w_h)
      return y, h, c

    # check_vma=False: the recurrence's scan buffers start as replicated
    # zeros, which varying-type checks reject. shard_map's transpose then
    # sums the gradient of every argument replicated over an axis over that
    # axis: over "data", the data-parallel gradient all-reduce of w_x, w_h
    # and b; over "stripe", the first layer's input gradient (each device's
    # stripes read the whole embedding).
    if exchange is None and self.grouped and devices > 1:
      inputs = _gather_cotangent(inputs, mesh)
    y, h, c = jax.shard_map(
        local, mesh=mesh, check_vma=False,
        in_specs=(x_spec, w_x_spec, P(stripe), carry_spec, carry_spec,
                  P(stripe)),
        out_specs=(out_spec, carry_spec, carry_spec))(
            inputs, self.w_x[...], self.b[...], carry[0], carry[1],
            self.w_h[...])
    return y, (h, c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_cotangent(x, mesh):
  """The identity, whose gradient is gathered over "stripe" at once.

  A grouped first layer reads the replicated embedding in stripes, so its
  input gradient arrives split over "stripe". Gathered here it is one
  window of activations; left to the compiler, the embedding's gradient (a
  vocabulary-sized table) was gathered instead.
  """
  del mesh
  return x


def _gather_cotangent_fwd(x, mesh):
  del mesh
  return x, None


def _gather_cotangent_bwd(mesh, _, ct):
  return (jax.lax.with_sharding_constraint(
      ct, NamedSharding(mesh, P(mesh_axes.DATA_AXIS))),)


_gather_cotangent.defvjp(_gather_cotangent_fwd, _gather_cotangent_bwd)


def _shuffle_exchange(x, num_stripes: int, devices: int):
  """`stripe_shuffle` between devices that each hold a share of the stripes.

  x: [b, T, H/p], this device's S/p stripes' units (stripe-major). Returns
  this device's H/p positions of the shuffled [b, T, H], which are the inputs
  of its stripes in the next grouped layer. Position g*S + s of the shuffle
  is unit g of stripe s, so device k needs units k*G/p .. (k+1)*G/p of every
  stripe: one all-to-all when p divides G; otherwise every device gathers
  all units and keeps its share.
  """
  stripe = mesh_axes.STRIPE_AXIS
  b, t, local_units = x.shape
  s, p = num_stripes, devices
  width = local_units * p // s
  x = x.reshape(b, t, s // p, width)
  if width % p == 0:
    # chunk k of every stripe's units goes to device k; the received
    # chunks stack up by source device: [b, T, S, G/p], stripes in order.
    mine = jax.lax.all_to_all(x, stripe, split_axis=3, concat_axis=2,
                              tiled=True)
    return mine.swapaxes(-1, -2).reshape(b, t, local_units)
  full = jax.lax.all_gather(x, stripe, axis=2, tiled=True)  # [b, T, S, G]
  shuffled = full.swapaxes(-1, -2).reshape(b, t, s * width)
  start = jax.lax.axis_index(stripe) * local_units
  return jax.lax.dynamic_slice_in_dim(shuffled, start, local_units, axis=2)


def stripe_shuffle(x: jax.Array, num_stripes: int) -> jax.Array:
  """A fixed channel permutation, [..., H] -> [..., H], free of FLOPs.

  ShuffleNet's channel shuffle: units viewed as [S, G] are read out as
  [G, S], so unit g of stripe s lands at position g*S + s. Stripe s' of the
  next grouped layer then reads G/S units from every stripe (when S divides
  G): stripes that never meet inside a layer meet across layers.
  """
  *lead, h = x.shape
  s = num_stripes
  return x.reshape(*lead, s, h // s).swapaxes(-1, -2).reshape(*lead, h)


@dataclasses.dataclass(frozen=True)
class _Rows:
  """How one pass spreads the embedding and head over the mesh
  (`ZebraLM.rows`): the row axes, and their parameters, one copy per device
  (copies) or replicated."""
  mesh: Any
  axes: tuple[str, ...]
  graphdef: Any
  shared: Any
  rest: Any
  copies: bool


class ZebraLM(nnx.Module):
  """Embedding -> num_layers x ZebraLSTM -> a full or adaptive softmax head.

  head="full": an [E, V] matrix, tied to the [V, E] embedding when
  tie_embeddings and E == H (params "embed", "head_w", "head_b").
  head="adaptive": `AdaptiveSoftmax` over frequency clusters
  (params "adaptive_softmax"); with adaptive_tie and E == H the input is an
  `AdaptiveInput` sharing its tables and projections ("adaptive_input"),
  otherwise the usual "embed" table. Tying needs E == H under both heads
  because the tied tables live in the LSTM output's width.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg = ModelConfig.of(cfg)
    dt = compute_dtype(cfg.dtype)
    self.dtype = dt
    self.head = cfg.head
    self.dropout_embed = float(cfg.dropout_embed)
    self.dropout_hidden = float(cfg.dropout_hidden)
    self.dropout_output = float(cfg.dropout_output)
    same_width = cfg.embed_size == cfg.hidden_size
    if self.head == "adaptive" and cfg.adaptive_tie and same_width:
      self.adaptive_input = asm.AdaptiveInput(
          cfg.vocab_size, cfg.hidden_size, cfg.adaptive_cutoffs,
          cfg.adaptive_div_val, rngs=rngs, dtype=dt)
    else:
      self.embed = nnx.Param(jax.random.uniform(
          rngs.params(), (cfg.vocab_size, cfg.embed_size), jnp.float32,
          -0.1, 0.1))
    sizes = [cfg.embed_size] + [cfg.hidden_size] * cfg.num_layers
    s = cfg.num_stripes
    # grouped: every layer reads its input in stripes, the first one too when
    # embed_size divides by S (else it reads the embedding densely); the
    # layers after the first read the previous one's outputs shuffled.
    grouped = cfg.stripe_input == "grouped"
    self.shuffle_stripes = grouped and s > 1
    self.layers = nnx.List([
        ZebraLSTMLayer(sizes[i], cfg.hidden_size, s, rngs=rngs,
                       dtype=dt, unroll=cfg.unroll, remat=cfg.remat,
                       grouped=grouped and sizes[i] % s == 0,
                       kernel=cfg.recurrence)
        for i in range(cfg.num_layers)])
    if self.head == "adaptive":
      self.tied = hasattr(self, "adaptive_input")
      self.adaptive_softmax = asm.AdaptiveSoftmax(
          cfg.vocab_size, cfg.hidden_size, cfg.adaptive_cutoffs,
          cfg.adaptive_div_val, rngs=rngs, dtype=dt,
          tied_input=self.adaptive_input if self.tied else None,
          chunk_rows=cfg.adaptive_chunk_rows)
      return
    self.tied = bool(cfg.tie_embeddings and same_width)
    if not self.tied:
      bound = 1.0 / cfg.hidden_size ** 0.5
      self.head_w = nnx.Param(jax.random.uniform(
          rngs.params(), (cfg.hidden_size, cfg.vocab_size), jnp.float32,
          -bound, bound))
    self.head_b = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32))

  def features(self, tokens: jax.Array, carry: Carry, dropout_rng=None,
               rows: "_Rows | None" = None):
    """The last LSTM layer's outputs for a window.

    Args:
      tokens: [batch, time] int32.
      carry: one (h, c) pair per layer, each [batch, hidden] float32.
      dropout_rng: a PRNG key for training; None disables dropout.
      rows: `self.rows(batch)`, how the embedding spreads over the mesh.
    Returns:
      hidden [batch, time, hidden] in the compute dtype (output dropout
      applied), and the new carry.
    """
    rngs = (list(jax.random.split(dropout_rng, len(self.layers) + 1))
            if dropout_rng is not None else [None] * (len(self.layers) + 1))
    with jax.named_scope("embedding"):
      x = self._on_rows(rows, ZebraLM._embed, tokens)
      x = dropout(x, self.dropout_embed, rngs[0])
    new_carry = []
    mesh = _STRIPE_MESH.get()
    for i, layer in enumerate(self.layers):
      with jax.named_scope(f"zebra_lstm_{i}"):
        if mesh is not None:  # the exchange between layers is in `sharded`
          exchange = (("rows" if rows and rows.copies else None) if i == 0
                      else "shuffle" if self.shuffle_stripes else "gather")
          x, layer_carry = layer.sharded(x, carry[i], mesh, exchange)
        else:
          if i > 0 and self.shuffle_stripes:
            x = stripe_shuffle(x, layer.num_stripes)
          x, layer_carry = layer(x, carry[i])
        new_carry.append(layer_carry)
        last = i == len(self.layers) - 1
        rate = self.dropout_output if last else self.dropout_hidden
        x = dropout(x, rate, rngs[i + 1])
    # Under stripe parallelism x stays split over "stripe" along its units;
    # the head (`_on_rows`) takes it re-laid out by rows.
    return x, tuple(new_carry)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    if self.head == "adaptive" and self.tied:
      return self.adaptive_input(tokens)  # [B, T, H] float32
    return jnp.take(self.embed[...], tokens, axis=0)  # [B, T, E]

  def rows(self, batch: int) -> "_Rows | None":
    """How one pass over `batch` rows spreads the embedding and the head
    over the mesh `stripe_parallel` set (None: no mesh, one device).

    When the rows divide over every device, the embedding and the head run
    data-parallel over the whole mesh: each device looks up and scores
    B/(data x stripe) rows. Their parameters enter as one copy per device
    ([devices, ...], split over every device), so the lookup's and the
    head's gradients of a tied table add up on each device before the one
    all-reduce that sums the copies. Otherwise (sampling a few rows) they
    stay replicated over "stripe": every stripe device looks up all of its
    data group's rows and the last window is gathered once for the head.
    """
    mesh = _STRIPE_MESH.get()
    if mesh is None:
      return None
    graphdef, shared, rest = nnx.split(
        self, lambda path, _: path[0] != "layers", ...)
    # The layers' parameters stay out of these shard_maps (their shapes
    # stand in for them), so they are never gathered for them.
    rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        rest)
    n = mesh.devices.size
    if batch % n:
      return _Rows(mesh, (mesh_axes.DATA_AXIS,), graphdef, shared, rest,
                   copies=False)
    axes = (mesh_axes.DATA_AXIS, mesh_axes.STRIPE_AXIS)
    per_device = NamedSharding(mesh, P(axes))
    shared = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            jnp.broadcast_to(x, (n,) + x.shape), per_device), shared)
    return _Rows(mesh, axes, graphdef, shared, rest, copies=True)

  def _on_rows(self, rows, local, x: jax.Array, *row_args, total=False):
    """`local(module, x, *row_args)`, the embedding's or the head's work on
    some rows, spread over the mesh by rows as `rows` (`self.rows`) says.

    Without a mesh this is `local(self, ...)`. Under one, every device runs
    `local` on its rows with the embedding's and head's parameters; the
    last layer's window, split over "stripe" along its units, comes
    re-laid out by rows (one all-to-all; its transpose in the backward
    pass). The head's compute thus divides by every device, as the LSTM's
    does.

    total: local returns sums, added over the devices; otherwise per-row
    values [rows, ...], returned split as the rows came.
    """
    if rows is None:
      return local(self, x, *row_args)
    spec = P(rows.axes)

    def on_device(shared, x, *row_args):
      if rows.copies:  # this device's copy
        shared = jax.tree.map(lambda a: a[0], shared)
      out = local(nnx.merge(rows.graphdef, shared, rows.rest), x, *row_args)
      return jax.lax.psum(out, rows.axes) if total else out

    return jax.shard_map(
        on_device, mesh=rows.mesh, check_vma=False,
        in_specs=(spec if rows.copies else P(), spec) + (spec,) * len(row_args),
        out_specs=P() if total else spec)(rows.shared, x, *row_args)

  def logits(self, hidden: jax.Array, rows=None) -> jax.Array:
    """[B, T, H] -> [B, T, V] float32: logits (full head) or exact
    log-probabilities (adaptive head; their softmax is the same distribution,
    so sampling, scoring and export need not know which head ran)."""
    return self._on_rows(rows, ZebraLM._logits, hidden)

  def _logits(self, hidden: jax.Array) -> jax.Array:
    with jax.named_scope("head"):
      if self.head == "adaptive":
        b, t, h = hidden.shape
        return self.adaptive_softmax.log_probs(
            hidden.reshape(b * t, h)).reshape(b, t, -1)
      b, t, h = hidden.shape
      flat = hidden.reshape(b * t, h).astype(self.dtype)
      if self.tied:  # [V, H]: contracted on its H axis as it is stored
        w, axis = self.embed[...], 1
      else:
        w, axis = self.head_w[...], 0
      logits = jax.lax.dot_general(flat, w.astype(self.dtype),
                                   (((1,), (axis,)), ((), ())),
                                   preferred_element_type=jnp.float32)
      return (logits + self.head_b[...]).reshape(b, t, -1)

  def target_log_probs(self, hidden: jax.Array, targets: jax.Array,
                       rows=None) -> jax.Array:
    """log p(target): hidden [B, T, H], targets [B, T] -> [B, T] float32."""
    return self._on_rows(rows, ZebraLM._target_log_probs, hidden, targets)

  def _target_log_probs(self, hidden, targets):
    if self.head == "full":
      logp = jax.nn.log_softmax(self._logits(hidden), axis=-1)
      return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    b, t, h = hidden.shape
    with jax.named_scope("head"):
      nll = self.adaptive_softmax.nll(hidden.reshape(b * t, h),
                                      targets.reshape(b * t))
    return -nll.reshape(b, t)

  def token_sums(self, hidden: jax.Array, targets: jax.Array,
                 with_accuracy: bool = True,
                 rows=None) -> dict[str, jax.Array]:
    """metrics.token_sums for this head, from hidden [B, T, H].

    The adaptive head scores targets with the chunked `nll`, never building
    [B*T, V]; its accuracy needs a full-vocabulary `predict`, so
    with_accuracy=False leaves "correct" out. The full head has the logits
    anyway and always counts "correct".
    """
    return self._on_rows(
        rows,
        functools.partial(ZebraLM._token_sums, with_accuracy=with_accuracy),
        hidden, targets, total=True)

  def _token_sums(self, hidden, targets, with_accuracy):
    if self.head == "full":
      logits = self._logits(hidden)
      with jax.named_scope("loss"):
        return metrics.token_sums(logits, targets)
    log_probs = self._target_log_probs(hidden, targets)  # chunked nll
    with jax.named_scope("loss"):
      sums = {"loss_sum": -log_probs.sum(),
              "count": jnp.asarray(targets.size, jnp.float32)}
    if with_accuracy:
      with jax.named_scope("accuracy"):
        b, t, h = hidden.shape
        best = self.adaptive_softmax.predict(hidden.reshape(b * t, h))
        sums["correct"] = (best == targets.reshape(b * t)).astype(
            jnp.float32).sum()
    return sums

  def __call__(self, tokens: jax.Array, carry: Carry, dropout_rng=None):
    """(logits [batch, time, vocab] float32, new carry); see `logits`."""
    rows = self.rows(tokens.shape[0])
    hidden, new_carry = self.features(tokens, carry, dropout_rng, rows)
    return self.logits(hidden, rows), new_carry


def init_carry(cfg: ModelConfig, batch_size: int) -> Carry:
  """Zero (h, c) for every layer: the state at the start of a stream."""
  cfg = ModelConfig.of(cfg)
  zeros = lambda: jnp.zeros((batch_size, cfg.hidden_size), jnp.float32)
  return tuple((zeros(), zeros()) for _ in range(cfg.num_layers))


def create(cfg: ModelConfig, seed: int):
  """Builds the model and returns (graphdef, params): params is an nnx.State."""
  return nnx.split(ZebraLM(cfg, rngs=nnx.Rngs(seed)))


def abstract(cfg: ModelConfig):
  """(graphdef, params as ShapeDtypeStructs), without allocating: for restores."""
  return nnx.split(nnx.eval_shape(lambda: ZebraLM(cfg, rngs=nnx.Rngs(0))))


def apply(graphdef, params, tokens, carry, dropout_rng=None):
  """Pure forward pass: (logits [B, T, V] float32, new carry).

  For the adaptive head the "logits" are exact log-probabilities.
  """
  return nnx.merge(graphdef, params)(tokens, carry, dropout_rng)


def last_logits(graphdef, params, tokens, carry):
  """(logits of the last position [B, V] float32, new carry), no dropout.

  What consuming a prompt needs: the head runs on one position, not T.
  """
  lm = nnx.merge(graphdef, params)
  rows = lm.rows(tokens.shape[0])
  hidden, new_carry = lm.features(tokens, carry, rows=rows)
  return lm.logits(hidden[:, -1:], rows)[:, 0], new_carry


def decode_step(params, carry, tokens, *, graphdef):
  """One generated token: tokens [B] -> (logits [B, V] float32, new carry).

  The one recurrent step that sampling, serving, export and the generation
  benchmark all run; bind `graphdef` with functools.partial.
  """
  logits, new_carry = apply(graphdef, params, tokens[:, None], carry)
  return logits[:, 0], new_carry


def token_sums(graphdef, params, inputs, targets, carry, dropout_rng=None,
               with_accuracy: bool = True):
  """Pure loss pass: ({"loss_sum", "count"[, "correct"]} float32, new carry).

  What train and eval steps call: `metrics.token_sums(apply(...)[0], targets)`
  for the full head; the chunked adaptive-softmax loss otherwise (see
  `ZebraLM.token_sums` for when "correct" is left out).
  """
  lm = nnx.merge(graphdef, params)
  rows = lm.rows(inputs.shape[0])
  hidden, new_carry = lm.features(inputs, carry, dropout_rng, rows)
  return lm.token_sums(hidden, targets, with_accuracy, rows), new_carry


def target_log_probs(graphdef, params, inputs, targets, carry):
  """Pure scoring pass, no dropout: (log p(targets) [B, T] float32, carry).

  The adaptive head reads them off its chunked loss, without [B, T, V].
  """
  lm = nnx.merge(graphdef, params)
  rows = lm.rows(inputs.shape[0])
  hidden, new_carry = lm.features(inputs, carry, rows=rows)
  return lm.target_log_probs(hidden, targets, rows), new_carry


def num_params(params: Any) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def stripe_blocks(params, layer: int) -> Sequence[jax.Array]:
  """The recurrent blocks of one layer, [G, 4G] each (for inspection and tests)."""
  return list(params["layers"][layer]["w_h"][...])
