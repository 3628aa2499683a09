"""The GPU report's JSON and page are rewritten whole after every row."""

import json
import os

from lab.benchmarks import gpu_budget, gpu_results
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


def test_docs_and_script_give_the_sequence():
  """lab/notes/gpu-results.md and gpu-report.md hold the sequence the code runs
  (the three steps, the budget file's table and ledger), and
  gpu_report.sh's help names the same call and timeout."""
  for page in ("gpu-results.md", "gpu-report.md"):
    docs = open(os.path.join(REPO, "lab", "notes", page)).read()
    assert "\n".join(gpu_results.sequence_lines()) in docs, page
  script = open(os.path.join(REPO, "launch", "gpu_report.sh")).read()
  assert f"#   {gpu_results.call_command()}\n" in script
  assert f"with a {gpu_budget.CALL_BUDGET_S} s timeout" in script
  assert " ".join(gpu_budget.STAGES) in script


def test_page_shows_errors_versions_and_the_sequence(tmp_path):
  results = gpu_results.Results(str(tmp_path))
  results.data.update(
      versions={"installed": {"jax": "0.11.2", "flax": "0.11.0"},
                "outside": ["flax 0.11.0 (pyproject.toml: >=0.12.8,<0.14)"]},
      smoke={"backend": "triton", "lowered_for_cuda": {
          "backend": "triton", "jax": "0.11.2",
          "custom_calls": ["__gpu$xla.gpu.triton"],
          "warning": "The Pallas Triton backend is deprecated and will be "
                     "removed in a future JAX version."}, "rows": [
          {"name": "tiny_dot_float32", "status": "ok", "seconds": 1.5,
           "max_abs_err": 1e-6, "dot_precision": ["ieee"]},
          {"name": "stripe_kernel_float32", "status": "error",
           "seconds": 2.0, "error": "RuntimeError: ptxas error"}]},
      kernel={"shape": {"hidden": 1024, "batch": 64, "seq_len": 64,
                        "layers": 2},
              "rows": [
                  {"name": "zebra_pallas_S8", "impl": "zebra_pallas",
                   "stripes": 8, "dtype": "bfloat16",
                   "error": "RuntimeError: ptxas error"},
                  {"name": "zebra_scan_S8", "impl": "zebra_scan",
                   "stripes": 8, "group": 8, "dtype": "bfloat16",
                   "tokens_per_s": 2e6, "ms_per_step": 2.048, "min_ms": 2.0,
                   "max_ms": 2.1, "rounds": 5, "wall_ms_per_step": 2.2,
                   "timer": "back-to-back wall", "busy_ms": 1.8,
                   "span_ms": 2.5, "tflops": 41.25,
                   "math": "bf16", "peak_fraction": 0.0417, "build_s": 3.0},
                  {"name": "torch_cudnn_bf16_S1", "impl": "torch_cudnn_bf16",
                   "stripes": 1, "group": 8, "dtype": "bfloat16",
                   "tokens_per_s": 1e6, "ms_per_step": 4.096, "min_ms": 4.0,
                   "max_ms": 4.2, "rounds": 5, "wall_ms_per_step": 4.5,
                   "timer": "CUDA events", "tflops": 165.0, "math": "bf16",
                   "peak_fraction": 0.1668, "build_s": 1.0},
                  {"name": "torch_cudnn_bf16_loop_S8",
                   "impl": "torch_cudnn_bf16_loop", "stripes": 8,
                   "group": 8, "dtype": "bfloat16", "tokens_per_s": 2e5,
                   "ms_per_step": 20.48, "build_s": 0.1}],
              "ratios": {"bfloat16": {"zebra_scan_S8": {
                  "torch_cudnn_bf16_loop_S8": 10.0,
                  "torch_cudnn_bf16_S1": 2.0}}}})
  results.save()
  page = (tmp_path / "gpu-results.md").read_text()
  assert "- versions outside pyproject.toml: flax 0.11.0" in page
  assert ("- Pallas GPU backend: triton (jax 0.11.2; jax warns: the Triton "
          "backend is deprecated)") in page
  assert ("- smoke (triton): 1/2 Pallas kernels ran; stripe_kernel_float32:"
          " RuntimeError: ptxas error") in page
  assert "| tiny_dot_float32 | ok | 1.5 | 1.00e-06 | ieee x1 |" in page
  assert "calls __gpu$xla.gpu.triton: backend triton; jax warned" in page
  assert ("- zebra_pallas_S8 (bfloat16): error: RuntimeError: ptxas error"
          in page)
  # the same-function ratio leads, the per-stripe loop's follows, labelled
  assert ("- zebra_scan_S8 (bfloat16): 2,000,000 tok/s, 2.05 ms/step "
          "(back-to-back wall, median of 5: 2.00-2.10), 41.2 TFLOP/s = "
          "4.2% of the bf16 peak; same function: 2.00 x torch_cudnn_bf16_S1;"
          " per-stripe loop (one cuDNN call a stripe, launch-bound): 10.00 x "
          "torch_cudnn_bf16_loop_S8") in page
  assert ("| S=8 | zebra_pallas_S8 | ours | - | - | - | - | - | - | - | "
          "RuntimeError: ptxas error |") in page
  assert ("| S=8 | torch_cudnn_bf16_S1 | same function | 1,000,000 | 4.10 | "
          "4.00-4.20 | 4.50 | - | 165.0 | 16.7 (bf16) | CUDA events; built in "
          "1.0 s |") in page
  assert ("- clocks: torch rows' CUDA events within 9.0% of their rounds' "
          "wall time (1 rows); JAX rows timed by back-to-back wall time, the "
          "GPU busy 82-82% of it; the profiler's span 1.14-1.14 x it") in page
  assert "\n".join(gpu_results.sequence_lines()) in page


def test_a_wt103_stage_stopped_after_its_compile_says_so(tmp_path):
  """The compile's figures land before any step runs: a stage killed in
  its timing still shows them."""
  results = gpu_results.Results(str(tmp_path))
  results.update("wt103", {"compile_s": 61.4, "params": 113_250_000})
  page = (tmp_path / "gpu-results.md").read_text()
  assert "- wt103 recipe (113M parameters): compiled in 61 s, no step timed" \
      in page
