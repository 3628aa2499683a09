"""Multi-process start-up: one JAX process per host (or per GPU), one global mesh.

A run is multi-process when --coordinator_address/--num_processes/--process_id
are given, or when a cluster launcher says so (SLURM with more than one task,
Open MPI, or JAX_COORDINATOR_ADDRESS in the environment); jax.distributed then
finds its peers and every device of every process joins the mesh. Must run
before anything touches a JAX backend. JAX is imported when a function
runs, not with the flags: --help and `zebra-jax fields` start no JAX.
"""

import os
from typing import Callable, TypeVar

from absl import flags

from zebra_jax.errors import UserError

T = TypeVar("T")

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "Multi-process: host:port of process 0 (auto-detected under SLURM/MPI).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-process: total number of processes.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-process: this process's rank, 0-based.")


def _launched_by_cluster() -> bool:
  env = os.environ
  return (int(env.get("SLURM_NTASKS", "1")) > 1
          or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
          or "JAX_COORDINATOR_ADDRESS" in env)


def initialize() -> bool:
  """Starts jax.distributed when the run spans processes; True if it did."""
  import jax
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
    return True
  if _launched_by_cluster():
    jax.distributed.initialize()  # reads SLURM / Open MPI / env itself
    return True
  return False


def process_zero_first(fn: Callable[[], T], what: str) -> T:
  """fn() on process 0; then, once it has succeeded, on every other process.

  For work that writes shared files (tokenizing into the workdir): process 0
  does it once while the others wait at a barrier, then they find its files
  and only read them. If process 0 fails, every process stops with an error
  instead of waiting forever.
  """
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  if jax.process_count() == 1:
    return fn()
  result, failure = None, None
  if jax.process_index() == 0:
    try:
      result = fn()
    except Exception as e:  # raised below, after the others are told
      failure = e
  ok = multihost_utils.broadcast_one_to_all(np.int32(failure is None))
  if failure is not None:
    raise failure
  if not int(ok):
    raise UserError(f"process 0 failed while {what}: its output says why")
  if jax.process_index() != 0:
    result = fn()
  return result
