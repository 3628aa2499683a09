"""The stripes experiment's table, time to perplexity and claims."""

import pytest

from lab.benchmarks import stripes_report


def _run(setting, seed, valid, curve, num_stripes=8, role="", hidden=256):
  return dict(setting=setting, num_stripes=num_stripes, stripe_input="dense",
              role=role, hidden_size=hidden, params=620656, seed=seed,
              planned_steps=120, tok_per_s=100 + 100 * seed, tokens_seen=1e6,
              steps=100, valid_ppl=valid, test_ppl=valid + 1, startup_s=5.0,
              train_s=180.0,
              curve=[{"step": 10 * i, "train_s": t, "ppl": p}
                     for i, (t, p) in enumerate(curve)])


def test_table_mean_and_std_over_seeds():
  runs = [_run("s8_h256", seed, v, [(10, 9.0)]) for seed, v in ((0, 4.0),
                                                                (1, 6.0))]
  (row,) = stripes_report.table(runs)
  assert row["seeds"] == 2 and row["valid_ppl"] == 5.0
  assert row["valid_ppl_std"] == pytest.approx(2 ** 0.5)
  assert row["tok_per_s"] == 150.0 and row["budget_bound"] == 2
  assert "| dense S=8 | 256 | 620,656 |" in stripes_report.markdown([row])


def test_time_to_target_interpolates_log_perplexity():
  curve = [{"train_s": 10.0, "ppl": 16.0}, {"train_s": 20.0, "ppl": 4.0}]
  assert stripes_report.time_to(curve, 8.0) == pytest.approx(15.0)  # sqrt
  assert stripes_report.time_to(curve, 20.0) == 10.0  # reached at once
  assert stripes_report.time_to(curve, 3.0) is None   # never reached


def test_claims_only_where_the_seeds_separate():
  classic = [_run("s1_h256", s, 6.0 + 0.1 * s, [(60, 8.0), (120, 5.0 + s / 10)],
                  num_stripes=1) for s in range(3)]
  fast = [_run("s8_h256", s, 5.0 + 0.1 * s, [(30, 8.0), (60, 5.0)])
          for s in range(3)]
  close = [_run("s4_h256", s, 6.05 + 0.1 * s,
                [(60, 8.0), (118 + s, 5.0 + s / 10)], num_stripes=4)
           for s in range(3)]
  runs = classic + fast + close
  assert stripes_report.auto_targets(runs) == [6.5, 5.2]  # the worst classic seed ends at 5.2
  classic_row = stripes_report.table(runs, stripes_report.auto_targets(runs))[0]
  assert [e["reached"] for e in classic_row["to_target"]] == [3, 3]
  rows = stripes_report.table(runs, [8.0])
  said = stripes_report.claims(rows)
  assert ("dense S=8 (hidden 256) reaches valid ppl 8 in 50% of the training "
          "time of the classic LSTM at hidden 256") in said[0]
  assert "dense S=8 (hidden 256) ends at a lower test ppl" in said[1]
  assert ("dense S=4 (hidden 256) and the classic LSTM at hidden 256 reach "
          "valid ppl 8 in overlapping times: no claim.") in said[2]
  assert "overlapping test ppl: no claim" in said[3]
  assert len(said) == 4


def test_claims_against_the_best_classic_of_any_width():
  classic = [_run("s1_h256", s, 6.0 + 0.1 * s, [(60, 8.0), (120, 5.0)],
                  num_stripes=1) for s in range(2)]
  narrow = [_run("s1_h74_matched", s, 5.5 + 0.1 * s, [(40, 8.0), (90, 5.0)],
                 num_stripes=1, role="matched", hidden=74) for s in range(2)]
  striped = [_run("s8_h256", s, 5.0 + 0.1 * s, [(30, 8.0), (60, 5.0)])
             for s in range(2)]
  rows = stripes_report.table(classic + narrow + striped, [8.0])
  best = stripes_report.best_classic(rows)
  assert best["setting"] == "s1_h74_matched"
  said = stripes_report.claims(rows, best)
  assert len(said) == 2  # the striped setting only: time, then final ppl
  assert ("dense S=8 (hidden 256) reaches valid ppl 8 in 75% of the training "
          "time of the classic LSTM at hidden 74") in said[0]
  assert "ends at a lower test ppl than the classic LSTM at hidden 74" in said[1]


def test_between_striped_settings_only_what_separates():
  classic = [_run("s1_h256", s, 7.0 + 0.1 * s, [(60, 8.0), (120, 6.0)],
                  num_stripes=1) for s in range(2)]
  dense = [_run("s8_h256", s, 5.0 + 0.1 * s, [(30, 8.0), (60, 5.0)])
           for s in range(2)]
  dense4 = [_run("s4_h256", s, 5.05 + 0.1 * s, [(29 + s, 8.0), (60, 5.0)],
                 num_stripes=4) for s in range(2)]
  wide = [dict(_run("s8_grouped_h520_eqtime", s, 4.0 + 0.1 * s,
                    [(40 + s, 8.0), (120, 4.0)], role="equal_time",
                    hidden=520), stripe_input="grouped") for s in range(2)]
  rows = stripes_report.table(classic + dense + dense4 + wide, [8.0])
  said = stripes_report.between_striped(rows)
  assert not any("classic LSTM" in line for line in said)  # striped only
  assert said[0] == ("- dense S=4 (hidden 256) and dense S=8 (hidden 256): "
                     "no column separates, no claim.")
  assert said[1].startswith(
      "- grouped S=8, = classic step time (hidden 520) reaches valid ppl 8 "
      "in 135% of the training time of dense S=8 (hidden 256) (40 s against "
      "30 s")
  assert said[2].startswith("- grouped S=8, = classic step time (hidden 520) "
                            "ends at a lower test ppl than dense S=8")
  assert len(said) == 5  # and the same two lines against dense S=4


def test_every_setting_of_the_plot_has_its_own_line():
  colors = ["C0", "C1", "C2"]
  looks = [stripes_report.line_style(i, colors) for i in range(12)]
  assert len(set(looks)) == 12
  assert looks[0] == ("C0", "-") and looks[3] == ("C0", "--")


def test_a_setting_timed_off_its_calibration_is_named():
  # 2,048 tokens a step: 10,240 tok/s is 5 steps/s.
  run = lambda name, tok_per_s: {"setting": name, "steps": 100,
                                 "tokens_seen": 204_800, "tok_per_s": tok_per_s}
  records = [run("close", 10_240), run("close", 10_000),
             run("off", 10_240), run("off", 10_500)]
  misses = stripes_report.calibration_misses(
      records, {"close": 5.2, "off": 4.0})
  assert len(misses) == 1 and misses[0].startswith("- off: calibrated at 4.00")
  assert "(1.27x)" in misses[0]
