"""Multi-process start-up: one JAX process per host (or per GPU), one global mesh.

A run is multi-process when --coordinator_address/--num_processes/--process_id
are given, or when a cluster launcher says so (SLURM with more than one task,
Open MPI, or JAX_COORDINATOR_ADDRESS in the environment); jax.distributed then
finds its peers and every device of every process joins the mesh. Must run
before anything touches a JAX backend.
"""

import os

import jax
from absl import flags

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
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
    return True
  if _launched_by_cluster():
    jax.distributed.initialize()  # reads SLURM / Open MPI / env itself
    return True
  return False
