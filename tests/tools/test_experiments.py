"""The striped-vs-classic comparison end to end (its parts:
tests/benchmarks/test_stripes_*.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


def _compare_cli(out):
  """The CLI in a subprocess on 1 CPU device.

  conftest's 8 emulated devices would have every step all-reduce across 8
  threads; on 2 busy cores XLA's CPU rendezvous can time out and abort.
  """
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  subprocess.run(
      [sys.executable, "-m", "zebra_jax.tools.experiments",
       f"--config={REPO}/configs/demo.py:tiny", f"--out={out}",
       "--budget_minutes=0.02", "--seeds=0", "--stripes=1", "--grouped=2", "--no_classic",
       "--eval_points=2", "--curve_eval_batches=2"],
      check=True, env=env, cwd=os.path.dirname(out),  # any directory
      stdout=subprocess.DEVNULL)
  with open(os.path.join(out, "results.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_tiny_comparison_end_to_end(tmp_path):
  out = str(tmp_path / "compare")
  results = _compare_cli(out)
  for name in ("results.md", "results.json", "valid_ppl_vs_time.png"):
    assert os.path.getsize(os.path.join(out, name)) > 0
  rows = results["table"]
  assert [(r["num_stripes"], r["stripe_input"]) for r in rows] == [
      (1, "dense"), (2, "grouped")]
  for r in rows:
    assert r["params"] > 0 and r["steps"] >= 1 and r["tok_per_s"] > 0
    assert r["tokens_seen"] == r["steps"] * 8 * 16  # tiny: batch 8 x seq 16
    assert 1.0 < r["valid_ppl"] < 200 and 1.0 < r["test_ppl"] < 200
  assert rows[0]["params"] > rows[1]["params"]  # grouped shrinks W_x and U
  with open(os.path.join(out, "results.md")) as f:
    assert f.read().startswith("| stripes | hidden | params |")
  # Rerunning resumes: finished runs are read back, not trained again.
  assert _compare_cli(out)["runs"] == results["runs"]
