"""gpu_report's dry run: every stage runs end to end on the CPU at tiny
shapes, so the one-command GPU report cannot rot between GPU sessions.

bench.py's own rows are left out here (--nobench_rows): they take minutes
even at bench's quick shape, and tests/tools/test_bench.py runs them.
"""

import json

import jax
import pytest

from zebra_jax.tools import gpu_report


def test_scope_categories_from_named_scopes():
  c = gpu_report._scope_category  # pylint: disable=protected-access
  assert c("jit(step)/transpose(jvp(zebra_lstm_1))/dot_general") \
      == "lstm_layers"
  assert c("jit(step)/transpose(jvp(head))/dot_general") == "head"
  assert c("jit(step)/jvp(loss)/reduce_sum") == "head"
  assert c("jit(step)/optimizer/add") == "optimizer"
  assert c("jit(step)/embedding/gather") == "embedding"
  assert c("jit(step)/broadcast_in_dim") == "other"
  text = ('%fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%f, '
          'metadata={op_name="jit(step)/jvp(zebra_lstm_0)/tanh" '
          'source_file="x.py"}\n'
          '  %dot.1 = f32[8]{0} dot(%a, %b), metadata={op_name='
          '"jit(step)/optimizer/mul"}')
  assert gpu_report.hlo_op_scopes(text) == {
      "fusion.3": "jit(step)/jvp(zebra_lstm_0)/tanh",
      "dot.1": "jit(step)/optimizer/mul"}


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
  report = gpu_report.run(gpu_report.STAGES, str(tmp_path), dry=True,
                          bench_rows=False)
  saved = json.loads((tmp_path / "gpu-results.json").read_text())
  assert saved["dry_run"] is True
  assert set(gpu_report.STAGES) <= set(saved)
  assert saved["machine"]["platform"] == jax.devices()[0].platform

  # pallas rows: the kernel (interpret mode here) beside the scan, per S.
  rows = report["bench"]["pallas"]["bfloat16"]
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
  assert "DRY RUN" in page
  for heading in ("pallas: the fused stripe kernel", "WikiText-103 recipe",
                  "infer_bench", "precision:", "weak scaling"):
    assert heading in page
  assert "| pallas_core_S4 |" in page
