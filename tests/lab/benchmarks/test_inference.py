"""The generation benchmark of a trained workdir (python -m lab.infer_bench):
throughput, latency percentiles, and a bad --batch_sizes as a UserError."""

import json

import pytest

from lab.benchmarks import inference
from zebra_jax.errors import UserError


def test_infer_bench_reports_throughput_and_latency_percentiles(char_run,
                                                                tmp_path):
  cfg, workdir = char_run
  path = str(tmp_path / "bench.json")
  report = inference.run(cfg, workdir, ["1", "2"], new_tokens=3,
                         prompt_len=4, requests=2, json_path=path)
  assert json.load(open(path)) == report
  assert [r["batch_size"] for r in report["results"]] == [1, 2]
  assert report["engine"]["decode_block"] == 1
  for r in report["results"]:
    assert r["tokens_per_s"] > 0
    for stats in (r["token_latency_ms"], r["request_latency_ms"]):
      assert 0 < stats["p50"] <= stats["p90"] <= stats["p95"] <= stats["p99"]
  stats = inference.latency_stats([0.001, 0.002, 0.003, 0.004])
  assert stats["avg"] == pytest.approx(2.5) and stats["p50"] == pytest.approx(2.5)
  with pytest.raises(UserError, match="--batch_sizes"):
    inference.run(cfg, workdir, ["one"])
  with pytest.raises(UserError, match="--new_tokens=1 must be at least 2"):
    inference.run(cfg, workdir, ["1"], new_tokens=1)
