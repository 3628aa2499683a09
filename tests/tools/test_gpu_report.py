"""gpu_report's dry run: every stage runs end to end on the CPU at tiny
shapes, so the one-command GPU report cannot rot between GPU sessions; and
a stage killed midway keeps the rows it finished.

bench.py's own rows are left out here (bench_rows=False): they take minutes
even at bench's quick shape, and tests/tools/test_bench.py runs them.
"""

import json
import os
import signal
import subprocess
import sys
import time

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


def test_results_rewrite_json_and_page_after_every_row(tmp_path):
  results = gpu_report.Results(str(tmp_path))
  results.data["dry_run"] = True
  results.update("scaling", {"stripes": 4, "per_device_batch": 4,
                             "seq_len": 8, "hidden": 32}, rows=0)
  results.append("scaling", "rows", [{
      "devices": 1, "global_batch": 4, "tokens_per_s": 10.0,
      "ms_per_step": 1.0, "efficiency": 1.0}])
  saved = json.loads((tmp_path / "gpu-results.json").read_text())
  assert saved["stages"]["scaling"]["rows"] == 1
  assert "| 1 | 10 | 1.0 | 100% |" in (tmp_path / "gpu-results.md").read_text()
  assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
  for stage in gpu_report.STAGES:  # in this process: what each child runs
    gpu_report.run_stage(stage, str(tmp_path), dry=True, bench_rows=False)
  report = json.loads((tmp_path / "gpu-results.json").read_text())
  assert set(gpu_report.STAGES) <= set(report)
  assert report["machine"]["platform"] == jax.devices()[0].platform

  quick = report["quick"]
  assert quick["peak"]["best_measured_matmul_tflops"] > 0
  assert quick["peak"]["datasheet"] == "unknown"  # a CPU
  names = [r["name"] for r in quick["rows"]]
  assert names[0] == "core_S1" and "core_S4" in names
  assert any(n.startswith("torch_core") for n in names)

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


def test_pallas_rows_never_name_the_scan_pallas(monkeypatch):
  monkeypatch.setattr(gpu_report.pallas_recurrence, "plan",
                      lambda *a, **k: (None, "U_s over budget"))
  rows = gpu_report.pallas_rows(dict(gpu_report.bench.SHAPES["quick"]), 4, 1)
  assert [r["name"] for r in rows] == ["scan_core_S4", "scan_fallback_core_S4"]
  assert rows[1]["kernel"] == "scan (kernel did not fit: U_s over budget)"


def _stage_child_pid(stage, out):
  """The pid of the child process running `stage` into `out`, or None."""
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    except OSError:
      continue
    if f"--stage_child={stage}" in args and f"--out={out}" in args:
      return int(pid)
  return None


@pytest.mark.slow
def test_a_stage_killed_midway_keeps_its_rows(tmp_path):
  # The real command line: the driver starts the quick stage's process; it
  # is killed once its first row (the matmul peak) is on disk.
  out = str(tmp_path)
  path = tmp_path / "gpu-results.json"
  driver = subprocess.Popen(
      [sys.executable, "-m", "zebra_jax.tools.gpu_report", "--stages=quick",
       "--dry_run", f"--out={out}"], stdout=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    try:
      rows = json.loads(path.read_text())["stages"]["quick"]["rows"]
    except (OSError, ValueError, KeyError):
      rows = 0
    if rows >= 1:
      break
    time.sleep(0.2)
  os.kill(_stage_child_pid("quick", out), signal.SIGKILL)
  stdout, _ = driver.communicate(timeout=60)
  assert driver.returncode == 0

  report = json.loads(path.read_text())
  status = report["stages"]["quick"]
  assert status["status"] == (
      f"stopped by SIGKILL after {status['rows']} rows")
  assert report["quick"]["peak"]["best_measured_matmul_tflops"] > 0
  assert status["rows"] == 1 + len(report["quick"].get("rows", []))
  page = (tmp_path / "gpu-results.md").read_text()
  assert "## Best measured matmul" in page
  assert "stage quick: stopped by SIGKILL" in page
  assert "stage quick: stopped by SIGKILL" in stdout  # the printed summary

  # A stage past its budget: its process group is killed, the report says so.
  gpu_report.drive(["scaling"], out, dry=True, budgets={"scaling": 2})
  report = json.loads(path.read_text())
  assert report["stages"]["scaling"]["status"].startswith(
      "stopped at its budget after")
  assert report["quick"]["peak"]  # the earlier stage's rows stay
