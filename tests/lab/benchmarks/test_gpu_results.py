"""The GPU report's JSON and page are rewritten whole after every row."""

import json
import os

from lab.benchmarks import gpu_results
from tests.helpers import REPO


def test_results_rewrite_json_and_page_after_every_row(tmp_path):
  results = gpu_results.Results(str(tmp_path))
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


def test_calls_fit_the_node():
  """Every stage in exactly one call; each call's stage budgets plus its
  overhead within the call budget (under the node's 600 s a command), on
  the GPU and in the dry run the rehearsal times on a CPU; every call from
  a cold start within the node's session."""
  flat = [s for call in gpu_results.CALLS for s in call]
  assert sorted(flat) == sorted(gpu_results.STAGES)
  assert flat[0] == "smoke"  # the kernel compiles before anything else
  assert gpu_results.CALL_BUDGET_S <= 540
  for call in gpu_results.CALLS:
    for budgets in (gpu_results.STAGE_BUDGET_S, gpu_results.DRY_BUDGET_S):
      assert (sum(budgets[s] for s in call) + gpu_results.CALL_OVERHEAD_S
              <= gpu_results.CALL_BUDGET_S)
  assert len(gpu_results.CALLS) * (
      gpu_results.START_UP_S + gpu_results.CALL_BUDGET_S) <= (
          gpu_results.SESSION_S)


def test_docs_and_script_give_the_sequence():
  """docs/gpu-results.md holds the sequence the code runs (commands,
  budgets, the carry), and gpu_report.sh's help names the same calls."""
  docs = open(os.path.join(REPO, "docs", "gpu-results.md")).read()
  assert "\n".join(gpu_results.sequence_lines()) in docs
  script = open(os.path.join(REPO, "launch", "gpu_report.sh")).read()
  for call in gpu_results.CALLS:
    assert f"#   {gpu_results.call_command(call)}\n" in script


def test_page_shows_errors_versions_and_the_sequence(tmp_path):
  results = gpu_results.Results(str(tmp_path))
  results.data.update(
      versions={"installed": {"jax": "0.11.2", "flax": "0.11.0"},
                "outside": ["flax 0.11.0 (pyproject.toml: >=0.12.8,<0.14)"]},
      smoke={"backend": "triton", "rows": [
          {"name": "tiny_dot_float32", "status": "ok", "seconds": 1.5,
           "max_abs_err": 1e-6, "dot_precision": ["ieee"]},
          {"name": "stripe_kernel_float32", "status": "error",
           "seconds": 2.0, "error": "RuntimeError: ptxas error"}]},
      bench={"pallas": [{"name": "pallas_core_S8", "stripes": 8,
                         "dtype": "float32", "kernel": "error",
                         "error": "RuntimeError: ptxas error"}]},
      wt103={"pallas": {"kernel": "error", "error": "ValueError: no"}})
  results.save()
  page = (tmp_path / "gpu-results.md").read_text()
  assert "- versions outside pyproject.toml: flax 0.11.0" in page
  assert ("- smoke (triton): 1/2 Pallas kernels ran; stripe_kernel_float32:"
          " RuntimeError: ptxas error") in page
  assert "| tiny_dot_float32 | ok | 1.5 | 1.00e-06 | ieee x1 |" in page
  assert "| pallas_core_S8 | float32 | - | - | - | - | error: " in page
  assert "\n".join(gpu_results.sequence_lines()) in page
