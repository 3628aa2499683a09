"""The GPU report's stages at dry-run shapes, in this process: every stage
runs end to end on the CPU, so the one-command GPU report cannot rot between
GPU sessions; the smoke stage's backend detection against jax's own
lowering; the kernel stage going on past rows that fail.
"""

import json

import jax
import jax.numpy as jnp
import pytest

from lab.benchmarks import (gpu_budget, gpu_kernel, gpu_results,
                            gpu_smoke, gpu_stages)
from tests.helpers import pallas_layer_grad, triton_target


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
  work = str(tmp_path / "work")  # precision's runs, which infer reads
  out = tmp_path / "out"
  for stage in gpu_budget.STAGES:  # in this process: what each child runs
    gpu_stages.run_stage(stage, str(out), dry=True, work=work)
  report = json.loads((out / "gpu-results.json").read_text())
  assert set(gpu_budget.STAGES) <= set(report)
  assert report["machine"]["platform"] == jax.devices()[0].platform
  assert {s["device"] for s in report["stages"].values()} == {
      jax.devices()[0].device_kind}

  # smoke: tiny kernels in interpret mode here, against NumPy and the scan;
  # the stripe kernel lowered for CUDA through Triton
  smoke = report["smoke"]
  assert smoke["backend"] == "interpret"
  assert smoke["lowered_for_cuda"]["backend"] == "triton"
  assert [r["name"] for r in smoke["rows"]] == [
      n for n, _, _ in gpu_smoke.SMOKE_ROWS]
  assert all(r["status"] == "ok" for r in smoke["rows"]), smoke
  assert all(r["max_abs_err"] < 1e-4 for r in smoke["rows"])

  # kernel: every group's rows in order, ours timed, jax's cuDNN rows
  # error rows off CUDA, then FlashRNN's rows, the widest S first
  rows = report["kernel"]["rows"]
  stripes = gpu_kernel.group_stripes(gpu_stages.SHAPES["quick"])
  groups = [(d, s) for d in ("bfloat16", "float32") for s in stripes]
  heads = [(r["dtype"], r["stripes"]) for r in rows
           if r["impl"] == "zebra_scan"]
  assert heads == groups + [("bfloat16", 1)]  # the last: the wide group
  wide = [r for r in rows if r.get("group") == "1 at H=64"]
  assert [r["name"] for r in wide] == ["zebra_scan_S1_h64",
                                       "zebra_pallas_stream_S1_h64"]
  assert [(r["impl"], r["stripes"]) for r in rows[-8:]] == [
      (f"flashrnn_{b}", s) for s in stripes[::-1]
      for b in ("triton", "cuda") for _ in ("bfloat16", "float32")]
  for r in rows:
    if r["impl"].startswith("zebra"):
      assert r["tokens_per_s"] > 0, r
    if r["impl"].startswith("jax_cudnn"):
      assert "\n" not in r["error"]
  ratios = report["kernel"]["ratios"]["float32"]
  assert set(ratios) == {f"{k}_S{s}" for k in gpu_kernel.OURS
                         for s in stripes
                         if s == 1 or k != "zebra_pallas_stream"}

  wt = report["wt103"]
  # compiled, then the candidates built and every build timed interleaved
  # on the same fresh batches: the fused kernel and a chunk size compute the
  # recipe's function, so their losses agree with its
  variants = {v["name"]: v for v in wt["variants"]}
  assert list(variants) == [n for n, _ in gpu_stages.dry_variants()]
  fused = variants["recurrence=pallas"]
  assert fused["plan"].startswith("fused") and fused["tokens_per_s"] > 0
  for v in variants.values():
    assert v["x_recipe"] == pytest.approx(
        v["tokens_per_s"] / wt["tokens_per_s"])
    assert v["loss_last"] == pytest.approx(wt["loss_last"], rel=1e-5)
    assert v["loss_diff"] < 1e-4 and v["rounds"] == wt["rounds"] == 2
  assert wt["tokens_per_s"] > 0 and wt["model"]["head"] == "adaptive"
  assert wt["compile_s"] > 0 and wt["params"] > 0
  assert wt["projected_hours"] == pytest.approx(
      wt["recipe_tokens"] / wt["tokens_per_s"] / 3600)
  # fresh batches of Zipf ids: a loss above their entropy, never memorised
  assert wt["loss_last"] > wt["zipf_entropy"] > 0
  assert wt["min_ms"] <= wt["ms_per_step"] <= wt["max_ms"]

  curves = report["precision"]["curves"]
  assert set(curves) == {"float32", "bfloat16", "float16"}
  assert curves["float16"]["loss_scale"] is not None  # dynamic scaling on
  assert curves["float32"]["max_abs_diff_vs_fp32"] == 0.0

  # infer: the demo run, then the tiny recipe with random weights, through
  # the engine as configured; the one-slot demo token split host/device
  infer = report["infer"]["results"]
  assert [r["name"] for r in infer] == [
      f"{m}_slots{n}" for m in ("demo", "wt103")
      for n in gpu_stages.DRY_INFER_SLOTS]
  assert all(r["tokens"] == r["requests"] * r["new_tokens"] > 0
             for r in infer)
  # 1 and 2 slots: the small batch's calls, 4 blocks of 4
  assert {r["decode_block"] for r in infer} == {16}
  for r in infer:
    assert r["us_per_token_per_slot"] == pytest.approx(
        1e6 * r["slots"] / r["tokens_per_s"])
  assert report["infer"]["step"] == report["precision"]["steps"]
  assert report["infer"]["wt103_model"]["variant"] == "tiny"
  split, = report["infer"]["split"]
  assert split["name"] == "demo_slots1_host_device" and split["steps"] > 0
  assert split["cadence_us"] == pytest.approx(sum(
      split[f"{p}_us"] for p in gpu_results.INFER_SPLIT_PARTS))
  scaling = report["scaling"]["rows"]
  assert [r["devices"] for r in scaling] == sorted({1, jax.device_count()})

  # profile: the trace packed into OUT; no dump (XLA_FLAGS was not set
  # before this process started: the driver sets it for the stage's own)
  profile = report["profile"]
  assert (out / profile["trace_archive"]).stat().st_size == (
      profile["trace_bytes"])
  share = profile["share"]
  assert abs(sum(share.values()) - 1.0) < 1e-6 and share["lstm_layers"] > 0
  assert profile["dump_error"].startswith("no XLA dump")

  page = (out / "gpu-results.md").read_text()
  summary = page.split("## Summary")[1].split("\n## ")[0].strip()
  assert len(summary.splitlines()) <= 25
  for heading in ("smoke: tiny Pallas kernels", "kernel: core train step",
                  "WikiText-103 recipe step", "inference: the serving engine",
                  "precision:", "weak scaling", "profile: three"):
    assert heading in page


def test_a_shape_the_kernel_does_not_fit_is_a_row_that_says_so(monkeypatch):
  monkeypatch.setattr(gpu_kernel.pallas_recurrence, "plan",
                      lambda *a, **k: (None, "U_s over budget"))
  shape = dict(gpu_stages.SHAPES["quick"])
  cands = [c for c in gpu_kernel.candidates(shape, "float32", 4)
           if c[0] in gpu_kernel.OURS]
  rows = gpu_kernel.time_group(shape, "float32", 4, cands, rounds=1)
  assert [r["name"] for r in rows] == ["zebra_scan_S4", "zebra_pallas_S4"]
  assert rows[0]["tokens_per_s"] > 0
  assert rows[1]["error"] == ("the kernel does not fit this shape: U_s over "
                              "budget")


_PTXAS = ("Triton compilation failed for zebra_stripe_forward\n"
          "ptxas /tmp/k.ptx, line 412; error   : Entry function uses too much "
          "shared data\nptxas fatal   : Ptx assembly aborted")


def test_first_error_line():
  assert gpu_results.first_error_line(RuntimeError(_PTXAS)) == (
      "RuntimeError: ptxas /tmp/k.ptx, line 412; error   : Entry function "
      "uses too much shared data")
  assert gpu_results.first_error_line(ValueError("\nno fit\nat all")) == (
      "ValueError: no fit")
  # Triton's CompilationError: a place, the source, then the cause
  compile_error = type("CompilationError", (Exception,), {})(
      "at 251:27:\n    acc = tl.dot(a, b)\n          ^\n"
      "Unsupported dtype fp8 in tl.dot")
  assert gpu_results.first_error_line(compile_error) == (
      "CompilationError: at 251:27: ... Unsupported dtype fp8 in tl.dot")


def test_the_kernel_stage_goes_on_past_errors(tmp_path, monkeypatch):
  """Every candidate of every group raising but one: error rows, group
  after group, then FlashRNN's rows (here: why they cannot run), the
  widest S first, Triton before CUDA; the ratios count the rows that ran;
  the page renders."""
  def fail():
    raise RuntimeError(_PTXAS)
  monkeypatch.setattr(gpu_kernel, "candidates", lambda shape, d, s: [
      ("zebra_pallas", lambda: fail), ("torch_cudnn_bf16", fail),
      ("zebra_scan", lambda: lambda: None),
      ("flashrnn_triton", "flashrnn not installed: why")])
  monkeypatch.setattr(gpu_kernel, "flashrnn_builder",
                      lambda *a: "flashrnn not installed: why")
  monkeypatch.setattr(gpu_kernel, "wide_group", lambda shape: (
      {**shape, "hidden": 64, "dtype": "bfloat16"}, "1 at H=64",
      [("zebra_pallas_stream", lambda: fail, 1)]))
  results = gpu_results.Results(str(tmp_path))
  gpu_stages.stage_kernel(results, dry=True)
  kernel = json.loads((tmp_path / "gpu-results.json").read_text())["kernel"]
  names = [(r["name"], r["dtype"]) for r in kernel["rows"]]
  assert names == [(f"{k}_S{s}", d) for d in ("bfloat16", "float32")
                   for s in (1, 4)
                   for k in ("zebra_pallas", "torch_cudnn_bf16",
                             "zebra_scan")] + [
      ("zebra_pallas_stream_S1_h64", "bfloat16")] + [
      (f"flashrnn_{b}_S{s}", d) for s in (4, 1) for b in ("triton", "cuda")
      for d in ("bfloat16", "float32")]
  assert [r["error"] for r in kernel["rows"][:2]] == [
      "RuntimeError: ptxas /tmp/k.ptx, line 412; error   : Entry function "
      "uses too much shared data"] * 2
  assert kernel["rows"][-1]["error"] == "flashrnn not installed: why"
  assert kernel["ratios"]["float32"] == {"zebra_scan_S1": {},
                                         "zebra_scan_S4": {}}
  page = (tmp_path / "gpu-results.md").read_text()
  assert ("| S=4 | zebra_pallas_S4 | ours | - | - | - | - | - | - | - | "
          "RuntimeError: ptxas") in page
  assert "- zebra_scan_S4 (float32): " in page
  # S=1 and S=4, bf16 and fp32
  assert page.count(" TFLOP/s; no baseline ran") == 4


def test_smoke_names_the_backend_jax_lowers_the_kernel_to():
  """The stripe kernel (Triton compiler params) lowered for CUDA: Triton's
  custom call, on every jax this project runs."""
  found = gpu_smoke.kernel_backend()
  assert found["backend"] == "triton", found
  assert found["custom_calls"] == ["__gpu$xla.gpu.triton"]
  assert found["jax"] == jax.__version__


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_backend_of_reads_the_lowered_program():
  """The control: a pallas_call without compiler params. Where jax has
  the jax_pallas_use_mosaic_gpu flag (0.10, 0.11.0) it lowers to Mosaic
  GPU; where the flag is gone (0.11.2, 0.12) pallas_call lowers through
  Triton only."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  sds = jax.ShapeDtypeStruct((128,), jnp.float32)
  with gpu_smoke.cuda_target():
    text = jax.jit(pl.pallas_call(kernel, out_shape=sds)).trace(sds).lower(
        lowering_platforms=("cuda",)).as_text()
  mosaic_default = getattr(jax.config, "jax_pallas_use_mosaic_gpu", False)
  assert gpu_smoke.backend_of(text) == (
      "mosaic_gpu" if mosaic_default else "triton")
  assert gpu_smoke.backend_of("stablehlo.add %0, %1") == "none"


def _lowered_dots(fn, *specs):
  """The tt.dot input precisions of every Triton kernel fn lowers to."""
  with gpu_smoke.triton_ir() as texts, triton_target():
    jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
  return [gpu_smoke.dot_precisions(t) for t in texts]


@pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("default,want", [(None, "tf32"),
                                          ("highest", "ieee")])
def test_stripe_kernel_dots_follow_the_default_matmul_precision(
    dtype, default, want):
  """Every tt.dot of the forward and backward kernels, lowered for CUDA,
  takes jax's default matmul precision, as the scan's XLA matmuls do: TF32
  by default, IEEE float32 under jax_default_matmul_precision=highest (the
  attribute only matters for float32 operands)."""
  fn, specs = pallas_layer_grad(s=2, t=2, b=16, g=16, n_in=32, dtype=dtype)
  with jax.default_matmul_precision(default):
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


def test_a_dry_run_builds_every_candidates_code_path_once():
  dry = gpu_stages.dry_variants()
  fields = lambda variants: [f for _, fs in variants for f in fs]
  assert set(fields(dry)) == set(fields(gpu_stages.WT103_VARIANTS))
  assert all(len(fs) == 1 for _, fs in dry)  # here: no combination built
  assert gpu_stages.dry_variants([("a", {"x": 1}), ("a+b", {"x": 1, "y": 2}),
                                  ("b", {"y": 3})]) == (
      ("a", {"x": 1}), ("a+b", {"x": 1, "y": 2}))


def test_every_candidate_is_a_valid_recipe_config():
  from zebra_jax.runtime import config_checks  # pylint: disable=g-import-not-at-top
  for _, fields in gpu_stages.WT103_VARIANTS:
    cfg = gpu_stages.wt103_config(dry=False)
    cfg.data.path = "/wikitext-103"  # never read: the checks want one
    cfg.model.update(fields)
    config_checks.validate(cfg)
