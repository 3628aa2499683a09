"""The stripes experiment's table: mean and spread over seeds."""

import pytest

from zebra_jax.benchmarks import stripes_report


def test_table_mean_and_std_over_seeds():
  runs = [dict(setting="s8_h256", num_stripes=8, stripe_input="dense",
               hidden_size=256, classic_matched=False, params=620656, seed=seed,
               planned_steps=120,
               tok_per_s=tps, tokens_seen=1e6, steps=100, valid_ppl=v,
               test_ppl=v + 1) for seed, tps, v in ((0, 100, 4.0),
                                                    (1, 200, 6.0))]
  (row,) = stripes_report.table(runs)
  assert row["seeds"] == 2 and row["valid_ppl"] == 5.0
  assert row["valid_ppl_std"] == pytest.approx(2 ** 0.5)
  assert row["tok_per_s"] == 150.0 and row["budget_bound"] == 2
  assert "| 8 | 256 | 620,656 |" in stripes_report.markdown([row])
