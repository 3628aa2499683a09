"""The GPU report's stages at dry-run shapes, in this process: every stage
runs end to end on the CPU, so the one-command GPU report cannot rot between
GPU sessions.

The speed table's rows are left out here (bench_rows=False): they take minutes
even at bench's quick shape, and tests/tools/test_bench.py runs them.
"""

import importlib.util
import json

import jax
import pytest

from zebra_jax.benchmarks import gpu_stages


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
  for stage in gpu_stages.STAGES:  # in this process: what each child runs
    gpu_stages.run_stage(stage, str(tmp_path), dry=True, bench_rows=False)
  report = json.loads((tmp_path / "gpu-results.json").read_text())
  assert set(gpu_stages.STAGES) <= set(report)
  assert report["machine"]["platform"] == jax.devices()[0].platform

  quick = report["quick"]
  assert quick["peak"]["best_measured_matmul_tflops"] > 0
  assert quick["peak"]["datasheet"] == "unknown"  # a CPU
  names = [r["name"] for r in quick["rows"]]
  assert names[0] == "core_S1" and "core_S4" in names
  if importlib.util.find_spec("torch") is not None:
    assert any(n.startswith("torch_core") for n in names)
  else:  # torch is optional: its rows are left out and the report says so
    assert not any(n.startswith("torch") for n in names)
    assert "torch not installed" in quick["torch"]

  # pallas rows: the kernel (interpret mode here) beside the scan, per S.
  rows = report["bench"]["pallas"]
  assert [r["name"] for r in rows] == [
      f"{k}_core_S{s}" for s in (1, 4) for k in ("scan", "pallas")]
  assert all(r["tokens_per_s"] > 0 for r in rows)
  assert {r["kernel"] for r in rows} == {"lax.scan", "fused"}

  wt = report["wt103"]
  assert wt["tokens_per_s"] > 0 and wt["model"]["head"] == "adaptive"
  share = wt["profile"]["share"]  # parsed from the trace, by named scope
  assert abs(sum(share.values()) - 1.0) < 1e-6
  assert share["lstm_layers"] > 0 and share["head"] > 0
  assert share["optimizer"] > 0
  # the recipe's step again with the fused kernel (interpret mode here)
  assert wt["pallas"]["kernel"] == "fused" and wt["pallas"]["tokens_per_s"] > 0
  assert wt["pallas"]["final_loss"] == pytest.approx(wt["final_loss"],
                                                     rel=1e-3)

  curves = report["precision"]["curves"]
  assert set(curves) == {"float32", "bfloat16", "float16"}
  assert curves["float16"]["loss_scale"] is not None  # dynamic scaling on
  assert curves["float32"]["max_abs_diff_vs_fp32"] == 0.0
  for c in curves.values():
    assert c["final_loss"] > 0 and c["skipped_after_warmup"] == 0

  assert [r["batch_size"] for r in report["infer"]["results"]] == [1, 2]
  scaling = report["scaling"]["rows"]
  assert [r["devices"] for r in scaling] == sorted({1, jax.device_count()})
  assert scaling[0]["efficiency"] == 1.0

  page = (tmp_path / "gpu-results.md").read_text()
  summary = page.split("## Summary")[1].split("\n## ")[0].strip()
  assert len(summary.splitlines()) <= 25
  for heading in ("Best measured matmul", "Core train step against torch",
                  "pallas: the fused stripe kernel", "WikiText-103 recipe",
                  "infer_bench", "precision:", "weak scaling"):
    assert heading in page
  assert "| pallas_core_S4 |" in page
  assert "model.recurrence=pallas (fused kernel)" in page


def test_pallas_rows_never_name_the_scan_pallas(monkeypatch):
  monkeypatch.setattr(gpu_stages.pallas_recurrence, "plan",
                      lambda *a, **k: (None, "U_s over budget"))
  rows = gpu_stages.pallas_rows(dict(gpu_stages.SHAPES["quick"]), 4, 1)
  assert [r["name"] for r in rows] == ["scan_core_S4", "scan_fallback_core_S4"]
  assert rows[1]["kernel"] == "scan (kernel did not fit: U_s over budget)"
