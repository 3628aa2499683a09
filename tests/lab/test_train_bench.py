"""`python -m lab.train_bench --quick`: the real training loop and
the PyTorch loop both run, over the same tokens, and report finite speeds.
No timing assertions: CI machines are shared and noisy.

The smoke run is a fresh process so that the flag below reaches XLA before
it starts: LLVM optimisation level 0 halves compile time for these tiny
shapes and changes nothing asserted here.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from lab.benchmarks import training_loop
from tests.helpers import REPO


@pytest.mark.slow
def test_quick_run_times_both_loops_over_the_same_tokens(tmp_path):
  path = tmp_path / "train_bench.json"
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
  out = subprocess.run(
      [sys.executable, "-m", "lab.train_bench", "--quick",
       "--stripes=2", f"--json={path}"],
      capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "tok/s" in out.stdout  # the table
  assert "first step (compiling included)" in out.stderr  # the loop's log
  result = json.loads(path.read_text())

  shape = training_loop.SHAPES["quick"]
  steps, warmup = shape["steps"], shape["warmup"]
  assert (result["config"]["steps"], result["config"]["warmup"]) == (
      steps, warmup)
  rows = {r["name"]: r for r in result["rows"]}
  has_torch = importlib.util.find_spec("torch") is not None
  want = {"jax_S2_dense"} | ({"torch_1t"} if has_torch else set())
  assert set(rows) == want, sorted(rows)
  for name, r in rows.items():
    assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, name
    # Each side counts what it consumed: the loop by its logged steps,
    # torch by the targets it scored.
    assert r["steps"] == steps, name
    assert r["tokens"] == steps * shape["batch"] * shape["seq_len"], name
    assert r["load_before"] >= 0 and r["load_after"] >= 0, name
    assert math.isfinite(r["final_loss"]), name
  # Both sides read the same train ids: the loop from its own workdir.
  assert len({r["train_ids_sha1"] for r in rows.values()}) == 1
  jax_row = rows["jax_S2_dense"]
  log_every = training_loop.log_interval(warmup, steps)
  assert len(jax_row["logged_tok_per_s"]) == steps // log_every
  if has_torch:
    torch_row = rows["torch_1t"]  # the quick run's one torch row
    # The fastest torch row's time over this row's: above 1 beats torch.
    assert jax_row["ratio_to_torch"] == pytest.approx(
        torch_row["seconds"] / jax_row["seconds"], rel=1e-12)
    assert result["torch"].startswith("torch ")
  else:
    assert jax_row["ratio_to_torch"] is None and result["torch"] is None
    assert any("torch not installed" in n for n in result["notes"])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
