"""The device mesh and the shardings every step uses.

A 2-D mesh ("data", "stripe") over all devices of all processes.
parallel.stripe_devices (default 1) sets the size of the "stripe" axis, the
rest of the devices form "data":

  data    the batch and the LSTM carry are split along their batch axis;
          parameters and optimizer state are replicated over it. Each device
          runs the model on its own rows (model/stripe_parallel.py), and the
          gradients are all-reduced once (NCCL on GPUs).
  stripe  one model across devices: every ZebraLSTM layer's stripes are split
          over it (w_x, w_h, b, their optimizer state, the carry (h, c) and
          the stripe-major activations). A layer's stripes never meet inside
          the time loop, so the recurrence needs no communication there; the
          devices exchange the layer output once per window at layer
          boundaries (lm.py, `ZebraLSTMLayer.sharded`). The embedding and the
          head's parameters stay replicated; the head runs data-parallel
          over every device of the mesh, each scoring its share of the rows
          (lm.py, `ZebraLM._on_rows`), so its compute divides as the
          layers' does.

With stripe_devices = 1 every sharding below is the data-parallel one, and the
model runs exactly the single-program code it runs on one device.
"""

import math

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from zebra_jax.errors import UserError
# The axis names live with the model, which splits its stripes over them.
from zebra_jax.model.mesh_axes import DATA_AXIS, STRIPE_AXIS, stripe_devices



def check_stripe_devices(stripe_devices: int, num_stripes: int,
                         num_devices: int) -> None:
  """stripe_devices must divide model.num_stripes and the device count."""
  example = math.gcd(num_stripes, num_devices)
  fix = (f": set --config.parallel.stripe_devices to a divisor of both, e.g. "
         f"{example}")
  if num_stripes % stripe_devices:
    raise UserError(f"--config.parallel.stripe_devices={stripe_devices} does "
                    f"not divide model.num_stripes={num_stripes}{fix}")
  if num_devices % stripe_devices:
    raise UserError(f"--config.parallel.stripe_devices={stripe_devices} does "
                    f"not divide the {num_devices} devices{fix}")


def make_mesh(devices=None, stripe_devices: int = 1) -> jax.sharding.Mesh:
  """All devices of all processes (or the given ones) as data x stripe.

  Several processes: the stripe axis stays inside a process (a node), on its
  fastest links; the data axis spans the processes.
  """
  # Auto axes: shardings are annotations on jit, as in the rest of this code.
  auto = (jax.sharding.AxisType.Auto,) * 2
  devices = jax.devices() if devices is None else list(devices)
  n, p = len(devices), stripe_devices
  if n % p:
    raise UserError(f"--config.parallel.stripe_devices={p} does not divide "
                    f"the {n} devices: set it to a divisor of {n}, e.g. 1")
  processes = len({d.process_index for d in devices})
  if p > 1 and processes > 1:
    local = n // processes
    if local % p:
      raise UserError(f"parallel.stripe_devices={p} does not divide the "
                      f"{local} devices of a process: the stripe axis must "
                      f"stay inside a node")
    grid = mesh_utils.create_hybrid_device_mesh(
        (local // p, p), (processes, 1), devices, process_is_granule=True)
  elif p > 1:
    grid = mesh_utils.create_device_mesh((n // p, p), devices)
  else:  # the device order of the 1-D data-parallel mesh
    grid = np.asarray(devices).reshape(n, 1)
  return jax.sharding.Mesh(grid, (DATA_AXIS, STRIPE_AXIS), axis_types=auto)


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def replicated_like(mesh, tree):
  """ShapeDtypeStructs of `tree`, replicated over the mesh: a restore target."""
  rep = replicated(mesh)
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)


def batch_sharded(mesh) -> NamedSharding:
  """Leading (batch) axis split over the data axis."""
  return NamedSharding(mesh, P(DATA_AXIS))


def carry_sharded(mesh) -> NamedSharding:
  """A carry leaf [batch, hidden]: batch over data, hidden over stripe.

  Hidden unit s*G + g belongs to stripe s, so each device holds its own
  stripes' units, contiguous.
  """
  if stripe_devices(mesh) == 1:
    return batch_sharded(mesh)
  return NamedSharding(mesh, P(DATA_AXIS, STRIPE_AXIS))


def check_batch(batch_size: int, what: str, mesh=None, micro_batches: int = 1):
  """A global batch must split evenly over devices (and micro-batches)."""
  devices = (mesh.shape[DATA_AXIS] if mesh is not None
             else jax.device_count())
  n = devices * micro_batches
  if batch_size % n:
    split = f"{devices} devices" + (
        f" x {micro_batches} micro-batches (train.grad_accum_steps)"
        if micro_batches > 1 else "")
    raise UserError(f"{what}={batch_size} does not divide over {split}: set "
                    f"--config.{what} to a multiple of {n}")


def global_batch(mesh, local: np.ndarray) -> jax.Array:
  """This process's rows of a batch -> one global array sharded on 'data'."""
  return jax.make_array_from_process_local_data(batch_sharded(mesh), local)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_shardings(mesh, tree):
  """Shardings for a tree of parameters (or of optimizer state shaped like
  them): a leaf whose Param carries `stripe_axis` metadata is split along
  that axis over "stripe"; every other leaf is replicated."""
  rep = replicated(mesh)
  if stripe_devices(mesh) == 1:
    return jax.tree.map(lambda _: rep, tree)

  def spec(x):
    axis = (x.get_metadata().get("stripe_axis") if _is_variable(x) else None)
    if axis is None:
      return jax.tree.map(lambda _: rep, x)
    return jax.tree.map(lambda _: NamedSharding(
        mesh, P(*([None] * axis), STRIPE_AXIS)), x)
  return jax.tree.map(spec, tree, is_leaf=_is_variable)


def state_shardings(mesh, state):
  """Carry leaves split on 'data' (and 'stripe'); the layers' parameters and
  their optimizer state split on 'stripe'; everything else replicated."""
  rep, carry = replicated(mesh), carry_sharded(mesh)
  return jax.tree.map(lambda _: rep, state).replace(
      params=param_shardings(mesh, state.params),
      opt_state=param_shardings(mesh, state.opt_state),
      carry=jax.tree.map(lambda _: carry, state.carry))
