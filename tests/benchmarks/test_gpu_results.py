"""The GPU report's JSON and page are rewritten whole after every row."""

import json
import os

from zebra_jax.benchmarks import gpu_results


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
