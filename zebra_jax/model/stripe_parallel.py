"""Stripe parallelism: a model's layers run per device over a mesh.

Given a ("data", "stripe") mesh, each layer's stripes are split over
"stripe" and its rows over "data" (`sharded_layer`): every device runs the
unchanged recurrence on its own stripes, and layer outputs are exchanged
once per window at layer boundaries. The embedding and the head run on each
device's share of the rows (`Rows`, `on_rows`), so their compute divides by
every device too.

Pure data parallelism (a stripe axis of one device) runs this way as well:
left to XLA's sharding propagation, the hand-written backward pass gathered
the whole batch's gate derivatives onto every device and repeated their work
there; per device, the time loops see only their own rows.
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from zebra_jax.model import mesh_axes
from zebra_jax.model.layer import ZebraLSTMLayer, stripe_shuffle


def active(mesh):
  """The mesh to split the model over, or None where one device runs it
  whole (no mesh, or a mesh of one device)."""
  return mesh if mesh is not None and mesh.devices.size > 1 else None


def sharded_layer(layer: ZebraLSTMLayer, inputs: jax.Array, carry, mesh,
                  exchange: str | None):
  """`layer(inputs, carry)` with the stripes split over the mesh's "stripe"
  axis (and the batch over "data"), with no communication inside the time
  loop.

  Args:
    inputs: [batch, time, in_features]. exchange=None: the embedding,
      replicated over "stripe". "rows": the embedding split by rows over
      every device, gathered for this data group's rows (dense: an
      all-gather; grouped: an all-to-all that also keeps only this device's
      stripes' inputs). Otherwise the previous layer's outputs, split along
      the last axis over "stripe" (each device holds its stripes' units),
      which become this layer's input in one exchange per window: "gather"
      (a dense layer reads all of them: all-gather) or "shuffle" (a grouped
      layer reads its share of the stripe shuffle: all-to-all).
    carry: (h, c), each [batch, hidden], split (batch, hidden) over
      ("data", "stripe").
    mesh: the ("data", "stripe") mesh.
  Returns:
    outputs [batch, time, hidden] split along hidden over "stripe", and the
    new (h, c) split as the carry came.
  """
  data, stripe = mesh_axes.DATA_AXIS, mesh_axes.STRIPE_AXIS
  split_in = exchange is not None or layer.grouped
  x_spec = (P((data, stripe)) if exchange == "rows" else
            P(data, None, stripe) if split_in else P(data))
  w_x_spec = P(stripe) if layer.grouped else P(None, stripe)
  carry_spec, out_spec = P(data, stripe), P(data, None, stripe)
  devices = mesh_axes.stripe_devices(mesh)

  def local(x, w_x, bias, h, c, w_h):
    if exchange == "rows" and devices > 1 and layer.grouped:
      # this device's stripes' inputs, for every row of its data group
      x = jax.lax.all_to_all(x, stripe, split_axis=2, concat_axis=0,
                             tiled=True)
    elif exchange == "rows" and devices > 1:
      x = jax.lax.all_gather(x, stripe, axis=0, tiled=True)
    elif exchange == "shuffle" and devices == 1:
      x = stripe_shuffle(x, layer.num_stripes)
    elif exchange == "gather" and devices > 1:
      x = jax.lax.all_gather(x, stripe, axis=2, tiled=True)
    elif exchange == "shuffle":
      x = _shuffle_exchange(x, layer.num_stripes, devices)
    y, (h, c) = layer.window(x, w_x, bias, h, c, w_h)
    return y, h, c

  # check_vma=False: the recurrence's scan buffers start as replicated
  # zeros, which varying-type checks reject. shard_map's transpose then
  # sums the gradient of every argument replicated over an axis over that
  # axis: over "data", the data-parallel gradient all-reduce of w_x, w_h
  # and b; over "stripe", the first layer's input gradient (each device's
  # stripes read the whole embedding).
  if exchange is None and layer.grouped and devices > 1:
    inputs = _gather_cotangent(inputs, mesh)
  y, h, c = jax.shard_map(
      local, mesh=mesh, check_vma=False,
      in_specs=(x_spec, w_x_spec, P(stripe), carry_spec, carry_spec,
                P(stripe)),
      out_specs=(out_spec, carry_spec, carry_spec))(
          inputs, layer.w_x[...], layer.b[...], carry[0], carry[1],
          layer.w_h[...])
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


@dataclasses.dataclass(frozen=True)
class Rows:
  """How one pass spreads the embedding and head over the mesh: the row
  axes, and their parameters, one copy per device (copies) or replicated."""
  mesh: Any
  axes: tuple[str, ...]
  graphdef: Any
  shared: Any
  rest: Any
  copies: bool


def rows(module: nnx.Module, batch: int, mesh, layers: str) -> Rows | None:
  """How one pass over `batch` rows spreads the parameters of `module` but
  its attribute `layers` over `mesh` (None: no mesh, or one device).

  When the rows divide over every device, the embedding and the head run
  data-parallel over the whole mesh: each device looks up and scores
  B/(data x stripe) rows. Their parameters enter as one copy per device
  ([devices, ...], split over every device), so the lookup's and the
  head's gradients of a tied table add up on each device before the one
  all-reduce that sums the copies. Otherwise (sampling a few rows) they
  stay replicated over "stripe": every stripe device looks up all of its
  data group's rows and the last window is gathered once for the head.
  """
  mesh = active(mesh)
  if mesh is None:
    return None
  graphdef, shared, rest = nnx.split(
      module, lambda path, _: path[0] != layers, ...)
  # The layers' parameters stay out of these shard_maps (their shapes
  # stand in for them), so they are never gathered for them.
  rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      rest)
  n = mesh.devices.size
  if batch % n:
    return Rows(mesh, (mesh_axes.DATA_AXIS,), graphdef, shared, rest,
                copies=False)
  axes = (mesh_axes.DATA_AXIS, mesh_axes.STRIPE_AXIS)
  per_device = NamedSharding(mesh, P(axes))
  shared = jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(
          jnp.broadcast_to(x, (n,) + x.shape), per_device), shared)
  return Rows(mesh, axes, graphdef, shared, rest, copies=True)


def on_rows(module: nnx.Module, layout: Rows | None, local: Callable,
            x: jax.Array, *row_args, total=False):
  """`local(module, x, *row_args)`, the embedding's or the head's work on
  some rows, spread over the mesh by rows as `layout` (`rows`) says.

  Without a layout this is `local(module, ...)`. With one, every device
  runs `local` on its rows with the embedding's and head's parameters; the
  last layer's window, split over "stripe" along its units, comes re-laid
  out by rows (one all-to-all; its transpose in the backward pass).

  total: local returns sums, added over the devices; otherwise per-row
  values [rows, ...], returned split as the rows came.
  """
  if layout is None:
    return local(module, x, *row_args)
  spec = P(layout.axes)

  def on_device(shared, x, *row_args):
    if layout.copies:  # this device's copy
      shared = jax.tree.map(lambda a: a[0], shared)
    out = local(nnx.merge(layout.graphdef, shared, layout.rest), x,
                *row_args)
    return jax.lax.psum(out, layout.axes) if total else out

  return jax.shard_map(
      on_device, mesh=layout.mesh, check_vma=False,
      in_specs=((spec if layout.copies else P(), spec)
                + (spec,) * len(row_args)),
      out_specs=P() if total else spec)(layout.shared, x, *row_args)
