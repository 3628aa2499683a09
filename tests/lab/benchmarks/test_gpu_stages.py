"""The GPU report's stages at dry-run shapes, in this process: every stage
runs end to end on the CPU, so the one-command GPU report cannot rot between
GPU sessions.

The speed table's rows are left out here (bench_rows=False): they take minutes
even at bench's quick shape, and tests/lab/test_bench.py runs them.
"""

import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from lab.benchmarks import gpu_results, gpu_stages
from tests.helpers import pallas_layer_grad, triton_target


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
  work = str(tmp_path / "work")  # precision's runs, which infer reads
  for stage in gpu_stages.STAGES:  # in this process: what each child runs
    gpu_stages.run_stage(stage, str(tmp_path), dry=True, bench_rows=False,
                         work=work)
  report = json.loads((tmp_path / "gpu-results.json").read_text())
  assert set(gpu_stages.STAGES) <= set(report)
  assert report["machine"]["platform"] == jax.devices()[0].platform
  assert {s["device"] for s in report["stages"].values()} == {
      jax.devices()[0].device_kind}

  # smoke: tiny kernels in interpret mode here, against NumPy and the scan
  smoke = report["smoke"]
  assert smoke["backend"] == "interpret"
  assert [r["name"] for r in smoke["rows"]] == [
      n for n, _, _ in gpu_stages.SMOKE_ROWS]
  assert all(r["status"] == "ok" for r in smoke["rows"]), smoke
  assert all(r["max_abs_err"] < 1e-4 for r in smoke["rows"])

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
  # infer read precision's float32 run: the same step, not a run of its own
  assert report["infer"]["step"] == report["precision"]["steps"]
  scaling = report["scaling"]["rows"]
  assert [r["devices"] for r in scaling] == sorted({1, jax.device_count()})
  assert scaling[0]["efficiency"] == 1.0

  page = (tmp_path / "gpu-results.md").read_text()
  summary = page.split("## Summary")[1].split("\n## ")[0].strip()
  assert len(summary.splitlines()) <= 25
  for heading in ("smoke: tiny Pallas kernels", "Best measured matmul",
                  "Core train step against torch",
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


_PTXAS = ("Triton compilation failed for zebra_stripe_forward\n"
          "ptxas /tmp/k.ptx, line 412; error   : Entry function uses too much "
          "shared data\nptxas fatal   : Ptx assembly aborted")


def test_first_error_line():
  assert gpu_stages.first_error_line(RuntimeError(_PTXAS)) == (
      "RuntimeError: ptxas /tmp/k.ptx, line 412; error   : Entry function "
      "uses too much shared data")
  assert gpu_stages.first_error_line(ValueError("\nno fit\nat all")) == (
      "ValueError: no fit")


def test_a_pallas_row_that_raises_is_an_error_row(monkeypatch):
  """The kernel's step raises at its first call: the scan row is timed,
  the pallas row says why."""
  real = gpu_stages.core_runner

  def runner(shape, stripes, kernel="scan"):
    if kernel == "pallas":
      def fail():
        raise RuntimeError(_PTXAS)
      return fail
    return real(shape, stripes, kernel=kernel)
  monkeypatch.setattr(gpu_stages, "core_runner", runner)
  rows = gpu_stages.pallas_rows(dict(gpu_stages.SHAPES["quick"]), 4, 1)
  assert [r["name"] for r in rows] == ["scan_core_S4", "pallas_core_S4"]
  assert rows[0]["tokens_per_s"] > 0
  assert rows[1]["kernel"] == "error" and "tokens_per_s" not in rows[1]
  assert rows[1]["error"].startswith("RuntimeError: ptxas /tmp/k.ptx")


def test_bench_goes_on_past_pallas_errors(tmp_path, monkeypatch):
  """Every pallas row raising (bf16 and fp32, each S): error rows, then
  the memory rows still land, and the page renders."""
  def fail(shape, stripes, rounds):
    raise RuntimeError(_PTXAS)
  memory = [{"seq_len": 64, "remat": False, "peak_bytes": 2 ** 30,
             "peak_source": "test", "xla_bytes": 2 ** 29}]
  monkeypatch.setattr(gpu_stages, "_shape",
                      lambda dry: dict(gpu_stages.SHAPES["quick"]))
  monkeypatch.setattr(gpu_stages, "pallas_rows", fail)
  monkeypatch.setattr(gpu_stages, "memory_rows",
                      lambda *a, **k: (memory, {"budget_gb": 1}))
  results = gpu_results.Results(str(tmp_path))
  gpu_stages.stage_bench(results, dry=False, bench_rows=False)
  bench = json.loads((tmp_path / "gpu-results.json").read_text())["bench"]
  assert [(r["name"], r["dtype"]) for r in bench["pallas"]] == [
      (f"pallas_core_S{s}", d) for d in ("bfloat16", "float32")
      for s in (1, 4)]
  assert all(r["error"].startswith("RuntimeError: ptxas")
             for r in bench["pallas"])
  assert bench["memory"] == memory
  page = (tmp_path / "gpu-results.md").read_text()
  assert "| pallas_core_S4 | float32 | - |" in page
  assert "- pallas_core_S4 (float32): error: RuntimeError: ptxas" in page


def _lowered_dots(fn, *specs):
  """The tt.dot input precisions of every Triton kernel fn lowers to."""
  with gpu_stages.triton_ir() as texts, triton_target():
    jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
  return [gpu_stages.dot_precisions(t) for t in texts]


@pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype,want", [(jnp.float32, "ieee"),
                                        (jnp.bfloat16, "ieee")])
def test_stripe_kernel_dots_are_at_their_precision(dtype, want):
  """float32 rows measure IEEE float32 products, not TF32: every tt.dot of
  the forward and backward kernels, lowered for CUDA, is inputPrecision
  ieee (bf16 operands: the attribute only matters for float32)."""
  fn, specs = pallas_layer_grad(s=2, t=2, b=16, g=16, n_in=32, dtype=dtype)
  dots = _lowered_dots(fn, *specs)
  assert dots == [[want] * 4] * 2  # forward, backward: one dot per gate


@pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_a_default_precision_float32_dot_reads_tf32():
  """The control: without Precision.HIGHEST a float32 Pallas dot lowers as
  tf32, and dot_precisions says so."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...],
                         preferred_element_type=jnp.float32)
  sds = jax.ShapeDtypeStruct((16, 16), jnp.float32)
  fn = pl.pallas_call(kernel, out_shape=sds, compiler_params=(
      pltriton.CompilerParams(num_warps=4, num_stages=1)))
  assert _lowered_dots(fn, sds, sds) == [["tf32"]]
