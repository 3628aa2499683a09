"""The entry points' malloc settings: a compiled program's temporaries are
reused from call to call instead of being faulted in anew
(runtime/host_memory.py); importing the package leaves malloc as it was.

Each case runs in a fresh process, since the settings only take hold before
JAX starts its backend; the process with the settings switched off is the
reference, and shows the faults the settings remove.
"""

import json
import os
import subprocess
import sys

import pytest

from zebra_jax.runtime import host_memory

pytestmark = pytest.mark.skipif(not host_memory.is_glibc(),
                                reason="glibc's malloc only")

# A program whose 80 MB product must be materialised between the matmul and
# the reductions: one temporary block above glibc's 64 MB per-thread heap.
_PROGRAM = """
import json, resource, statistics
import jax, jax.numpy as jnp
import zebra_jax.main  # what the zebra-jax command imports, then as it does:
from zebra_jax.runtime import host_memory
host_memory.reuse_freed_host_memory()  # before JAX starts its backend

def f(x, y):
  z = x @ y
  return jnp.sort(z, axis=0)[0] + z.max(axis=0)

x = jnp.ones((2048, 16)); y = jnp.ones((16, 10240))
compiled = jax.jit(f).lower(x, y).compile()
faults = []
for _ in range(20):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  compiled(x, y).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({
    # The median call: while the heap settles in the first calls, an odd
    # call can still land on memory it has not touched before.
    "faults_per_call": statistics.median(faults[5:]),
    "temp_pages": compiled.memory_analysis().temp_size_in_bytes / 4096}))
"""


def _faults(opt_out: bool) -> dict:
  env = dict(os.environ)
  env.pop(host_memory.OPT_OUT, None)
  if opt_out:
    env[host_memory.OPT_OUT] = "1"
  out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env,
                       capture_output=True, text=True, timeout=300, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_temporaries_are_not_faulted_in_on_every_call():
  reference = _faults(opt_out=True)
  assert reference["temp_pages"] > 64 * 2**20 / 4096  # above one heap
  # Without the settings every call faults in (nearly) all its temporaries...
  assert reference["faults_per_call"] > 0.5 * reference["temp_pages"]
  # ...with them, the memory of the last call is reused.
  reused = _faults(opt_out=False)
  assert reused["faults_per_call"] < 0.05 * reused["temp_pages"]


_ENTRY_POINT = """
import sys
import zebra_jax.main
from zebra_jax.runtime import host_memory
imported = host_memory.settings_in_effect()
sys.argv = ["zebra-jax", "--mode=eval", "--workdir=/nonexistent/run"]
try:
  zebra_jax.main.run()  # answers with one error line, exit 2
except SystemExit:
  pass
print(imported, host_memory.settings_in_effect())
"""


def test_the_entry_point_sets_them_and_importing_does_not():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop(host_memory.OPT_OUT, None)
  out = subprocess.run([sys.executable, "-c", _ENTRY_POINT], env=env,
                       capture_output=True, text=True, timeout=120)
  assert "error: " in out.stderr, out.stderr
  assert out.stdout.split() == ["False", "True"]


def test_settings_in_effect_observes_them():
  """In a fresh process: glibc's defaults map a large block anew, the
  settings serve it from the heap."""
  out = subprocess.run([sys.executable, "-c", (
      "from zebra_jax.runtime import host_memory as h; "
      "print(h.settings_in_effect(), h.reuse_freed_host_memory(), "
      "h.settings_in_effect())")],
      env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
      text=True, timeout=60, check=True)
  assert out.stdout.split() == ["False", "True", "True"]


def test_opt_out_changes_nothing(monkeypatch):
  monkeypatch.setenv(host_memory.OPT_OUT, "1")
  assert host_memory.reuse_freed_host_memory() is False


def test_only_where_jax_computes_on_the_cpu(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert not host_memory.computes_on_cpu()
  assert host_memory.reuse_freed_host_memory() is False
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert host_memory.computes_on_cpu()
