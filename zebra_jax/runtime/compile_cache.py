"""A persistent XLA compilation cache, so a rerun or a requeued job loads its
compiled steps instead of compiling them again (minutes for a large model).

The cache lives in WORKDIR/xla_cache by default: a resumed run finds it, and
under SLURM it is on the filesystem every node sees. ZEBRA_COMPILATION_CACHE
names another folder (one shared by several runs, say), or turns it off with
"off". A JAX_COMPILATION_CACHE_DIR the user set wins over both. JAX reads the
setting at the process's first compile, so `enable` runs before any.
"""

import os

import jax

ENV = "ZEBRA_COMPILATION_CACHE"
_OFF = ("", "0", "off", "none", "false")


def enable(workdir: str) -> str | None:
  """Points JAX's compilation cache at a folder; returns it (None if off)."""
  already = jax.config.jax_compilation_cache_dir
  if already:  # JAX_COMPILATION_CACHE_DIR or a caller's own choice
    return already
  chosen = os.environ.get(ENV)
  if chosen is not None and chosen.strip().lower() in _OFF:
    return None
  path = os.path.abspath(chosen or os.path.join(workdir, "xla_cache"))
  jax.config.update("jax_compilation_cache_dir", path)
  return path
