"""The striped-vs-classic comparison: parameter matching, table, end to end."""

import json
import os
import subprocess
import sys

import pytest

from configs import demo
from zebra_jax.tools import experiments, experiments_report
from tests.helpers import REPO

_VOCAB = 112  # the embedded corpus' character vocabulary


def _tiny(vocab_size=_VOCAB):
  cfg = demo.get_config("tiny")
  cfg.model.vocab_size = vocab_size
  return cfg


def test_param_count_matches_the_lstm_formula():
  cfg = _tiny()  # E = H = 32 (tied), 2 layers
  for s in (1, 4):
    h = 32
    layer = 32 * 4 * h + s * (h // s) * 4 * (h // s) + 4 * h  # W_x, U, b
    expected = _VOCAB * 32 + _VOCAB + 2 * layer  # tied embedding, head bias
    assert experiments.param_count(cfg, experiments.Setting(s, h, 32)) == expected


def test_matched_classic_is_the_nearest_width():
  cfg = _tiny()
  settings = experiments.make_settings(cfg, [1, 4], classic=True)
  assert [s.name for s in settings] == ["s1_h32", "s4_h32", "s1_h26_matched"]
  target = experiments.param_count(cfg, settings[1])
  matched = settings[2]
  assert matched.num_stripes == 1 and matched.embed_size == matched.hidden_size
  gap = lambda h: abs(experiments.param_count(
      cfg, experiments.Setting(1, h, h)) - target)
  assert gap(matched.hidden_size) <= min(gap(matched.hidden_size - 1),
                                         gap(matched.hidden_size + 1))


def test_grouped_settings_count_block_diagonal_weights_and_get_a_classic():
  cfg = _tiny()  # E = H = 32 (tied), 2 layers
  settings = experiments.make_settings(cfg, [1], classic=True, grouped=[4])
  assert [s.name for s in settings] == ["s1_h32", "s4_grouped_h32",
                                        "s1_h19_matched"]
  g = 32 // 4  # stripe width: W_x [S, I/S, 4G] and U [S, G, 4G]
  layer = 4 * (32 // 4) * 4 * g + 4 * g * 4 * g + 4 * 32
  assert experiments.param_count(cfg, settings[1]) == (
      _VOCAB * 32 + _VOCAB + 2 * layer)
  target = experiments.param_count(cfg, settings[1])
  gap = lambda h: abs(experiments.param_count(
      cfg, experiments.Setting(1, h, h)) - target)
  h = settings[2].hidden_size
  assert gap(h) <= min(gap(h - 1), gap(h + 1))


def test_table_mean_and_std_over_seeds():
  runs = [dict(setting="s8_h256", num_stripes=8, stripe_input="dense",
               hidden_size=256, classic_matched=False, params=620656, seed=seed,
               planned_steps=120,
               tok_per_s=tps, tokens_seen=1e6, steps=100, valid_ppl=v,
               test_ppl=v + 1) for seed, tps, v in ((0, 100, 4.0),
                                                    (1, 200, 6.0))]
  (row,) = experiments_report.table(runs)
  assert row["seeds"] == 2 and row["valid_ppl"] == 5.0
  assert row["valid_ppl_std"] == pytest.approx(2 ** 0.5)
  assert row["tok_per_s"] == 150.0 and row["budget_bound"] == 2
  assert "| 8 | 256 | 620,656 |" in experiments_report.markdown([row])


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
