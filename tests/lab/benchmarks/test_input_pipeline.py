"""The input-pipeline benchmark runs at small sizes and reports rates."""

from lab.benchmarks import input_pipeline


def test_data_bench_quick_smoke(capsys):
  results = input_pipeline.run(num_tokens=200_000, batch_size=16, seq_len=32,
                               num_batches=20, vocab_size=1000,
                               step_tokens_per_s=1000.0)
  assert set(results) == {"batcher", "batcher+device_put"}
  assert all(r["tokens_per_s"] > 0 for r in results.values())
  assert "x the step" in capsys.readouterr().out
