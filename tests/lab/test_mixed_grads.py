"""lab.mixed_grads on a CPU: each row's step is traced with the matmul it
names, and the product's matmul is back in place after."""

import subprocess
import sys

import jax.numpy as jnp
import pytest

from lab import mixed_grads
from zebra_jax.model import mixed_precision


@pytest.mark.slow
def test_each_row_traces_its_matmul(monkeypatch):
  product = mixed_precision.matmul
  plain, calls = mixed_grads.float32_gradients, []

  def spy(spec, x, w, dtype):
    calls.append(dtype)
    return plain(spec, x, w, dtype)
  monkeypatch.setattr(mixed_grads, "float32_gradients", spy)
  rows = mixed_grads.time_rows(dry=True)
  assert [r["name"] for r in rows] == ["scan bf16 grads", "scan f32 grads"]
  assert all(r["ms_per_step"] > 0 for r in rows)
  assert rows[0]["x_f32_grads"] > 0
  # only the second build traced the plain einsum, in the recipe's bf16
  assert calls and {jnp.dtype(d) for d in calls} == {jnp.dtype(jnp.bfloat16)}
  assert mixed_precision.matmul is product


def test_without_a_gpu_it_asks_for_one():
  got = subprocess.run([sys.executable, "-m", "lab.mixed_grads"],
                       capture_output=True, text=True, timeout=120)
  assert got.returncode == 2
  assert got.stderr.strip().splitlines()[-1].startswith(
      "error: this compares GPU matmuls")
