"""`python -m zebra_jax.tools.train_bench --quick`: the real training loop and
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

import ml_collections
import pytest

from zebra_jax.config import files
from zebra_jax.errors import UserError
from zebra_jax.tools import train_bench
from tests.helpers import REPO


def _base() -> ml_collections.ConfigDict:
  return files.load_file(os.path.join(REPO, "configs", "base.py"))


def test_quick_run_times_both_loops_over_the_same_tokens(tmp_path):
  path = tmp_path / "train_bench.json"
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
  out = subprocess.run(
      [sys.executable, "-m", "zebra_jax.tools.train_bench", "--quick",
       "--stripes=2", f"--json={path}"],
      capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "tok/s" in out.stdout  # the table
  assert "first step (compiling included)" in out.stderr  # the loop's log
  result = json.loads(path.read_text())

  shape = train_bench.SHAPES["quick"]
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
  log_every = train_bench.log_interval(warmup, steps)
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


def test_missing_torch_is_reported_not_faked(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
  cfg = train_bench.train_config(_base(), train_bench.SHAPES["quick"], 1,
                                 "dense", 6, 4)
  rows, note = train_bench.torch_rows(cfg, 107, None, 4, 6)
  assert rows == [] and "torch not installed" in note


@pytest.mark.parametrize("warmup,steps", [(2, 6), (4, 6), (20, 60), (9, 12),
                                          (7, 5)])
def test_log_lines_bound_the_timed_part(warmup, steps):
  every = train_bench.log_interval(warmup, steps)
  assert warmup % every == 0 and steps % every == 0
  assert warmup // every >= 2
  # No longer interval has both properties.
  assert all(warmup % d or steps % d or warmup // d < 2
             for d in range(every + 1, warmup + 1))


def test_too_short_warmup_is_a_user_error():
  with pytest.raises(UserError, match="--warmup=1"):
    train_bench.log_interval(1, 6)


def test_train_config_sets_the_rows_stripes_and_schedule():
  shape = train_bench.SHAPES["quick"]
  cfg = train_bench.train_config(_base(), shape, 2, "grouped", 6, 4)
  assert cfg.model.stripe_input == "grouped" and cfg.model.num_stripes == 2
  assert cfg.train.num_steps == 10 and cfg.train.eval_every > 10
  assert cfg.checkpoint.every_steps > 10


def test_word_shape_reads_a_16k_word_vocabulary():
  cfg = train_bench.train_config(_base(), train_bench.SHAPES["word"], 1,
                                 "dense", 60, 20)
  vocab_size, ids = train_bench.train_ids(cfg)
  assert vocab_size == 16384
  assert ids.min() >= 0 and ids.max() < vocab_size
  assert (cfg.model.hidden_size, cfg.data.tokenizer) == (256, "word")


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
