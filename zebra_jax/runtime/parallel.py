"""The device mesh and the shardings every step uses.

One 1-D mesh ("data",) over all devices of all processes: parameters and
optimizer state are replicated, the batch and the LSTM carry are split along
their batch axis. XLA inserts the gradient all-reduce (NCCL on GPUs).
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zebra_jax.errors import UserError

DATA_AXIS = "data"


def make_mesh(devices=None) -> jax.sharding.Mesh:
  """All devices of all processes (or the given ones) on one 'data' axis."""
  # Auto axes: shardings are annotations on jit, as in the rest of this code.
  auto = (jax.sharding.AxisType.Auto,)
  if devices is None:
    return jax.make_mesh((jax.device_count(),), (DATA_AXIS,), axis_types=auto)
  return jax.sharding.Mesh(np.asarray(devices), (DATA_AXIS,), axis_types=auto)


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


def check_batch(batch_size: int, what: str, mesh=None, micro_batches: int = 1):
  """A global batch must split evenly over devices (and micro-batches)."""
  devices = mesh.size if mesh is not None else jax.device_count()
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


def state_shardings(mesh, state):
  """Carry leaves split on 'data'; everything else replicated."""
  rep, bat = replicated(mesh), batch_sharded(mesh)
  return jax.tree.map(lambda _: rep, state).replace(
      carry=jax.tree.map(lambda _: bat, state.carry))
