"""The GPU report's stages, each run in its own process by lab/gpu_report.py:
smoke, quick, bench, wt103, precision, infer, scaling (what each measures:
that tool's docstring). Every stage writes each row as it lands; every
Pallas row is guarded, so a Triton or ptxas error becomes a row that says
so and the stage goes on.
"""

import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from lab.benchmarks import traces
from lab.benchmarks.flops import step_flops
from lab.benchmarks.gpu_results import (  # pylint: disable=unused-import
    DRY_BUDGET_S, STAGE_BUDGET_S, STAGES, Results)
from lab.benchmarks.memory import memory_rows
from lab.benchmarks.shapes import SHAPES, model_config, zipf_probs
from lab.benchmarks.speed import row_specs, time_group
from lab.benchmarks.steps import core_runner, train_batch, train_step
from lab.benchmarks.timing import (PEAK_CALL_SECONDS, datasheet,
                                         matmul_peak, time_interleaved)
from lab.benchmarks.torch_reference import torch_runners
from zebra_jax.model import lm
from zebra_jax.model.recurrence import pallas as pallas_recurrence
from zebra_jax.model.recurrence import scan as recurrence
from zebra_jax.runtime import profiling


def machine() -> dict:
  """GPU names and driver from nvidia-smi; JAX's versions, devices and
  cuDNN; torch's version and cuDNN."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": sys.version.split()[0],
          "platform": jax.devices()[0].platform,
          "devices": [d.device_kind for d in jax.devices()],
          "cudnn_jax": None, "torch": None, "cudnn_torch": None}
  try:  # jax's CUDA plugin reports the cuDNN it loaded
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
    if cuda_versions is not None:
      info["cudnn_jax"] = cuda_versions.cudnn_get_version()
  except (ImportError, AttributeError, RuntimeError):
    pass
  try:
    import torch  # pylint: disable=g-import-not-at-top
    info["torch"] = torch.__version__
    info["cudnn_torch"] = torch.backends.cudnn.version()
  except ImportError:
    pass
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
         "--format=csv,noheader"], capture_output=True, text=True,
        timeout=30, check=True).stdout
    info["gpus"] = [dict(zip(("name", "driver", "memory"),
                             (f.strip() for f in line.split(","))))
                    for line in out.strip().splitlines()]
  except (OSError, subprocess.SubprocessError):
    info["gpus"] = []
    info["note"] = "nvidia-smi not found: no NVIDIA GPU on this machine"
  return info


def first_error_line(exc: BaseException) -> str:
  """The line of an exception that names the error (Triton's, ptxas' or
  XLA's first line saying error), else its first line; with its type."""
  lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
  named = [l for l in lines if re.search(r"error", l, re.IGNORECASE)]
  line = (named or lines or [""])[0]
  return f"{type(exc).__name__}: {line}"[:400]


@contextlib.contextmanager
def triton_ir():
  """Collects the Triton IR text of every Pallas kernel lowered inside the
  block (jax's own lowering function, wrapped; the list stays empty on a
  jax that lowers elsewhere)."""
  texts = []
  try:
    from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=g-import-not-at-top
    lower = reg.lowering.lower_jaxpr_to_triton_module
  except (ImportError, AttributeError):
    yield texts
    return

  def spy(*args, **kwargs):
    result = lower(*args, **kwargs)
    texts.append(result.module.operation.get_asm())
    return result

  reg.lowering.lower_jaxpr_to_triton_module = spy
  try:
    yield texts
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = lower


def dot_precisions(text: str) -> list[str]:
  """The inputPrecision of every tt.dot in Triton IR text: ieee where the
  attribute is absent (Triton's default, not printed)."""
  found = []
  for line in text.splitlines():
    if re.search(r"\btt\.dot\b", line):
      named = re.search(r"inputPrecision = (\w+)", line)
      found.append(named.group(1) if named else "ieee")
  return found


def _tiny_dot(dtype, interpret: bool):
  """x @ w + 1 as one Pallas program of 16 x 16 tiles, Precision.HIGHEST
  as the stripe kernel asks."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...],
                         precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32) + 1.0

  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    params = pltriton.CompilerParams(num_warps=4, num_stages=1)
  rng = np.random.default_rng(0)
  x, w = (jnp.asarray(rng.standard_normal((16, 16)), dtype)
          for _ in range(2))
  fn = jax.jit(pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
      interpret=interpret, compiler_params=params, name="zebra_smoke_dot"))
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + 1.0
  return lambda: float(np.max(np.abs(np.asarray(fn(x, w)) - want)))


def _tiny_stripes(dtype, interpret: bool):
  """The stripe kernel's forward and backward at one 16-row block (S=2,
  T=3, G=16) against the scan: the largest difference of the loss and
  every gradient."""
  s, t, b, g, n = 2, 3, 16, 16, 32
  rng = np.random.default_rng(0)

  def arr(shape, scale, dt=jnp.float32):
    return jnp.asarray(scale * rng.standard_normal(shape), dt)
  args = (arr((t, b, n), 1.0, dtype), arr((n, s, 4 * g), 0.3, dtype),
          arr((s, 4 * g), 0.2), arr((s, b, g), 0.5), arr((s, b, g), 0.5),
          arr((s, g, 4 * g), 0.2, dtype))

  def loss(layer):
    def fn(*a):
      ys, h, c = layer(*a)
      return jnp.sum(ys.astype(jnp.float32) ** 2) + jnp.sum(h) + jnp.sum(c)
    return jax.jit(jax.value_and_grad(fn, argnums=tuple(range(6))))

  kernel = loss(lambda *a: pallas_recurrence.zebra_layer(
      *a, 1, False, interpret=interpret))
  scan = loss(lambda *a: recurrence.zebra_layer(*a, 1, False))

  def run():
    got, want = kernel(*args), scan(*args)
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32)
                                     - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  return run


SMOKE_ROWS = (("tiny_dot_float32", _tiny_dot, jnp.float32),
              ("tiny_dot_bfloat16", _tiny_dot, jnp.bfloat16),
              ("stripe_kernel_float32", _tiny_stripes, jnp.float32),
              ("stripe_kernel_bfloat16", _tiny_stripes, jnp.bfloat16))


def stage_smoke(results: Results, dry: bool) -> None:
  """Tiny Pallas kernels compiled and run on this device before anything
  else: a 16 x 16 dot in float32 and bfloat16, then the stripe kernel's
  forward and backward against the scan. Each row records ok (with its
  error against the reference and the precision of its lowered tt.dots)
  or the first error line (Triton, ptxas, XLA), and the next row runs."""
  del dry  # the same tiny shapes either way
  interpret = jax.devices()[0].platform != "gpu"
  results.update("smoke", {
      "backend": "interpret" if interpret else "triton",
      "triton_missing": pallas_recurrence.triton_missing() or None}, rows=0)
  for name, make, dtype in SMOKE_ROWS:
    start = time.perf_counter()
    row = {"name": name}
    try:
      with triton_ir() as texts:
        err = make(dtype, interpret)()
      row.update(status="ok", max_abs_err=err, dot_precision=[
          p for text in texts for p in dot_precisions(text)])
    except Exception as e:  # pylint: disable=broad-except
      row.update(status="error", error=first_error_line(e))
    row["seconds"] = time.perf_counter() - start
    results.append("smoke", "rows", [row])


def _shape(dry: bool) -> dict:
  return dict(SHAPES["quick" if dry else "gpu"])


def _rounds(dry: bool) -> int:
  return 2 if dry else 5


def quick_rows(shape) -> tuple[str, ...]:
  """The core rows the quick stage measures: the first and last S."""
  return (f"core_S{shape['stripes'][0]}", f"core_S{shape['stripes'][-1]}")


def stage_quick(results: Results, dry: bool) -> None:
  """The best measured matmul, then core S=1 and S=8 against torch, each S
  timed interleaved with torch's core step and written as it lands."""
  shape, rounds = _shape(dry), _rounds(dry)
  kind = jax.devices()[0].device_kind
  peak, by_shape = matmul_peak(shape, rounds)
  sheet, sheet_name = datasheet(kind)
  results.update("quick", {"peak": {
      "device_kind": kind, "dtype": shape["dtype"],
      "best_measured_matmul_tflops": peak / 1e12,
      "by_shape_gflops": by_shape,
      "datasheet_bf16_tflops": sheet and sheet / 1e12,
      "datasheet": sheet_name,
      # dry: the quick shape's loops are capped (matmul_peak)
      "seconds_per_call_at_least": None if dry else PEAK_CALL_SECONDS}})
  torch_fns, note = torch_runners(shape, groups=("core",))
  results.update("quick", {"torch": note}, rows=0)
  specs = row_specs(shape)["core"]
  for name in quick_rows(shape):
    rows, _ = time_group(shape, "core", {name: specs[name]}, torch_fns,
                               rounds, peak)
    results.append("quick", "rows", rows)


def _peak(results: Results, shape, dry: bool) -> float:
  """The quick stage's best measured matmul when it ran on this device and
  dtype, else one measured here."""
  peak = results.data.get("quick", {}).get("peak", {})
  if (peak.get("device_kind") == jax.devices()[0].device_kind
      and peak.get("dtype") == shape["dtype"]):
    return peak["best_measured_matmul_tflops"] * 1e12
  return matmul_peak(shape, _rounds(dry))[0]


def pallas_rows(shape, stripes: int, rounds: int) -> list[dict]:
  """Core train-step rows at one stripe count, timed interleaved: the scan,
  and model.recurrence=pallas: `pallas_core_S*` where the fused kernel
  runs, `scan_fallback_core_S*` where plan() finds no fit and the scan
  stands in."""
  triton = jax.devices()[0].platform == "gpu"
  dt = lm.compute_dtype(shape["dtype"])
  g = shape["hidden"] // stripes
  block, why = pallas_recurrence.plan(shape["batch"], g, dt, triton=triton)
  names = {"scan": f"scan_core_S{stripes}",
           "pallas": (f"pallas_core_S{stripes}" if block
                      else f"scan_fallback_core_S{stripes}")}
  labels = {"scan": "lax.scan",
            "pallas": "fused" if block else f"scan (kernel did not fit: {why})"}
  fns = {"scan": core_runner(shape, stripes)}
  error = None
  try:  # compiled and run once here: a Triton or ptxas error is a row
    fns["pallas"] = core_runner(shape, stripes, kernel="pallas")
    fns["pallas"]()
  except Exception as e:  # pylint: disable=broad-except
    fns.pop("pallas", None)
    error = first_error_line(e)
  tokens = shape["batch"] * shape["seq_len"]
  sec = time_interleaved(fns, rounds)
  flops = step_flops(shape, stripes, input_grad=False)
  rows = [{"name": names[k], "stripes": stripes, "width": g,
           "dtype": shape["dtype"], "tokens_per_s": tokens / sec[k],
           "ms_per_step": 1e3 * sec[k], "vs_scan": sec["scan"] / sec[k],
           "model_tflops": flops * tokens / sec[k] / 1e12,
           "kernel": labels[k],
           "batch_block": block if k == "pallas" else None}
          for k in fns]
  if error:
    rows.append(pallas_error_row(names["pallas"], shape, stripes, error))
  return rows


def pallas_error_row(name, shape, stripes, error) -> dict:
  """A pallas row that raised: its name, shape and first error line."""
  return {"name": name, "stripes": stripes,
          "width": shape["hidden"] // stripes, "dtype": shape["dtype"],
          "kernel": "error", "error": error}


def stage_bench(results: Results, dry: bool, bench_rows: bool = True) -> None:
  """The pallas rows, then the memory rows, then the speed table's groups
  (speed.py; the quick stage's rows left out when it has them), each
  written as it lands: a stage stopped at its budget loses speed rows
  first. A pallas row that raises becomes an error row and the stage goes
  on. bench_rows=False: pallas and memory only (the speed rows take
  minutes even at the quick shape; tests/lab/test_bench.py covers
  them)."""
  shape, rounds = _shape(dry), _rounds(dry)
  for dtype in (shape["dtype"],) if dry else ("bfloat16", "float32"):
    for s in shape["stripes"]:
      sized = {**shape, "dtype": dtype}
      try:
        rows = pallas_rows(sized, s, rounds)
      except Exception as e:  # pylint: disable=broad-except
        rows = [pallas_error_row(f"pallas_core_S{s}", sized, s,
                                 first_error_line(e))]
      results.append("bench", "pallas", rows)
  if not dry:
    try:
      memory, fit = memory_rows("gpu", fresh_processes=True)
      results.update("bench", {"memory": memory, "max_window": fit},
                     rows=len(memory))
    except Exception as e:  # pylint: disable=broad-except
      results.update("bench", {"memory_error": first_error_line(e)}, rows=0)
  if bench_rows:
    peak = _peak(results, shape, dry)
    torch_fns, note = torch_runners(shape)
    results.update("bench", {"torch": note,
                             "best_measured_matmul_tflops": peak / 1e12},
                   rows=0)
    done = {r["name"] for r in results.data.get("quick", {}).get("rows", [])}
    for group, specs in row_specs(shape).items():
      specs = {n: spec for n, spec in specs.items() if n not in done}
      rows, _ = time_group(shape, group, specs, torch_fns, rounds, peak)
      results.append("bench", "rows", rows)


def _wt103_config(dry: bool):
  cfg = _config("wt103", "tiny" if dry else "")
  cfg.model.vocab_size = 64 if dry else 267_735
  return cfg


def _wt103_step(cfg, dry: bool, seconds: float):
  """The product's train step for the recipe, compiled and timed on synthetic
  Zipf ids: (seconds per step, steps timed, last loss, compiled, run(i))."""
  m, d = cfg.model, cfg.data
  step, state, mesh = train_step(m, d.batch_size)
  probs = zipf_probs(m.vocab_size)
  rng = np.random.default_rng(0)
  batches = [train_batch(mesh, rng.choice(m.vocab_size,
                                          (d.batch_size, d.seq_len + 1),
                                          p=probs)) for _ in range(4)]
  compiled = step.lower(state, batches[0]).compile()
  live = [state]

  def run(i):
    live[0], sums = compiled(live[0], batches[i % len(batches)])
    return sums["loss_sum"] / sums["count"]

  jax.block_until_ready(run(0))  # untimed: allocation, autotuning
  steps, start = 0, time.perf_counter()
  while True:
    loss = run(steps)
    steps += 1
    if steps >= (3 if dry else 5) and (time.perf_counter() - start >= seconds
                                        or dry):
      break
  jax.block_until_ready(loss)
  return (time.perf_counter() - start) / steps, steps, loss, compiled, run


def stage_wt103(results: Results, dry: bool, seconds: float) -> None:
  """The recipe's model and batch on synthetic ids of its real vocabulary:
  the timed figures first, then the profile of a 3-step trace, then the
  same step with model.recurrence=pallas (the fused kernel, streamed U_s at
  the recipe's G=256), or the reason it falls back to the scan."""
  cfg = _wt103_config(dry)
  m, d = cfg.model, cfg.data
  sec, steps, loss, compiled, run = _wt103_step(cfg, dry, seconds)
  tokens = d.batch_size * d.seq_len
  peak, source = profiling.peak_memory()
  results.update("wt103", {
      "model": {k: m[k] for k in ("hidden_size", "num_layers", "num_stripes",
                                  "vocab_size", "head", "dtype",
                                  "recurrence")},
      "batch": d.batch_size, "seq_len": d.seq_len, "steps_timed": steps,
      "ms_per_step": 1e3 * sec, "tokens_per_s": tokens / sec,
      "epoch_minutes_103M": 103e6 / (tokens / sec) / 60,
      "peak_bytes": peak, "peak_source": source,
      "xla_bytes": profiling.compiled_bytes(compiled),
      "final_loss": float(loss)})
  trace_dir = tempfile.mkdtemp(prefix="zebra_wt103_trace_")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for i in range(3):
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        jax.block_until_ready(run(i))
  results.update("wt103", {"profile": traces.summarise_trace(trace_dir,
                                                      compiled.as_text())})
  del compiled, run  # the scan's buffers go before the kernel's step

  block, why = pallas_recurrence.plan(
      d.batch_size, m.hidden_size // m.num_stripes, lm.compute_dtype(m.dtype),
      triton=jax.devices()[0].platform == "gpu")
  if not block:
    results.update("wt103", {"pallas": {
        "kernel": f"scan (kernel did not fit: {why})"}})
    return
  cfg.model.recurrence = "pallas"
  try:
    p_sec, p_steps, p_loss, _, _ = _wt103_step(cfg, dry, seconds)
  except Exception as e:  # pylint: disable=broad-except
    results.update("wt103", {"pallas": {"kernel": "error",
                                        "error": first_error_line(e)}})
    return
  results.update("wt103", {"pallas": {
      "kernel": "fused", "steps_timed": p_steps, "ms_per_step": 1e3 * p_sec,
      "tokens_per_s": tokens / p_sec, "vs_scan": sec / p_sec,
      "final_loss": float(p_loss)}})


def _config(name: str, variant: str = ""):
  """The shipped config NAME (zebra_jax/configs/NAME.py)."""
  module = __import__(f"zebra_jax.configs.{name}", fromlist=["get_config"])
  return module.get_config(variant)


def _train_demo(workdir, dry, steps, dtype="float32"):
  """A demo-corpus run in this process (the train loop, checkpoints and
  metrics.jsonl as --mode=train writes them, without the end report)."""
  from zebra_jax.training import loop  # pylint: disable=g-import-not-at-top
  cfg = _config("demo", "tiny" if dry else "")
  # dry: no validation pass (its compile would double the run's time)
  cfg.train.update(num_steps=steps, log_every=1 if dry else 10,
                   eval_every=steps + 1 if dry else steps,
                   time_budget_minutes=0.0,
                   report_at_end=False, sample_at_eval=False)
  cfg.model.dtype = dtype
  loop.run(cfg, workdir)
  return cfg


def _metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def stage_precision(results: Results, dry: bool, work: str,
                    steps: int) -> None:
  """The same run in three compute dtypes, float32 first: each dtype's loss
  curve against float32's and its steps skipped by the loss scale after
  warm-up, written as each run ends."""
  steps = 6 if dry else steps
  warm = steps // 5
  results.update("precision", {"steps": steps, "warmup_steps_ignored": warm,
                               "curves": {}}, rows=0)
  ref = {}
  for dtype in ("float32", "bfloat16", "float16"):
    workdir = os.path.join(work, f"precision_{dtype}")
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
      _train_demo(workdir, dry, steps, dtype)
    curve = [m for m in _metrics(workdir) if m["kind"] == "train"]
    pts = [(m["step"], m["loss"]) for m in curve]
    ref = ref or dict(pts)
    diffs = [abs(loss - ref[s]) for s, loss in pts if s in ref and s >= warm]
    skipped = [m.get("skipped", 0) for m in curve if m["step"] >= warm]
    results.section("precision")["curves"][dtype] = {
        "loss": pts, "final_loss": pts[-1][1] if pts else None,
        "max_abs_diff_vs_fp32": max(diffs) if diffs else None,
        "skipped_after_warmup": (max(skipped) - min(skipped)
                                 if skipped else None),
        "loss_scale": curve[-1].get("loss_scale") if curve else None}
    results.update("precision", {})


def stage_infer(results: Results, dry: bool, work: str) -> None:
  """infer_bench's rows, one batch size at a time, on the precision stage's
  float32 run (a short demo run when it is not there)."""
  # pylint: disable=g-import-not-at-top
  from zebra_jax.inference import loading, sample
  from lab.benchmarks import inference
  workdir = os.path.join(work, "precision_float32")
  cfg = _config("demo", "tiny" if dry else "")
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    cfg = _train_demo(workdir, dry, 4 if dry else 50)
  loaded = loading.load_for_inference(cfg, workdir)
  prompt_len = 4 if dry else 32
  prompt = np.asarray(loaded.splits["valid"])[:prompt_len].astype(np.int32)
  generator = sample.Generator(loaded)
  results.update("infer", {"step": int(loaded.step),
                           "dtype": loaded.cfg.model.dtype}, rows=0)
  for size in (1, 2) if dry else (1, 2, 4, 8, 16, 32, 64):
    results.append("infer", "results", [inference.bench_batch(
        generator, prompt, size, new_tokens=4 if dry else 64,
        requests=2 if dry else 5)])


def stage_scaling(results: Results, dry: bool) -> None:
  """Weak scaling: the per-device batch stays fixed as devices are added;
  efficiency = tok/s(n) / (n x tok/s(1)), each count written as it lands."""
  devices = jax.devices()
  shape = _shape(dry)
  counts = [n for n in (1, 2, 4, 8, 16) if n <= len(devices)]
  if dry:  # one compile per count: the smallest and largest are enough
    counts = sorted({counts[0], counts[-1]})
  cfg = model_config(shape, shape["stripes"][-1])
  results.update("scaling", {
      "stripes": shape["stripes"][-1], "per_device_batch": shape["batch"],
      "seq_len": shape["seq_len"], "hidden": shape["hidden"],
      "note": None if len(devices) > 1 else (
          f"1 {devices[0].platform.upper()} device: weak scaling not "
          "measured")}, rows=0)
  for n in counts:
    b = shape["batch"] * n
    step, state, mesh = train_step(cfg, b, devices[:n])
    batch = train_batch(mesh, np.random.default_rng(0).integers(
        0, shape["vocab"], (b, shape["seq_len"] + 1)))
    live = [state]

    def run():
      live[0], sums = step(live[0], batch)
      jax.block_until_ready(sums)
    sec = time_interleaved({"step": run}, 2 if dry else 10)["step"]
    rows = results.section("scaling").get("rows", [])
    tok_s = b * shape["seq_len"] / sec
    base = rows[0]["tokens_per_s"] if rows else tok_s
    results.append("scaling", "rows", [{
        "devices": n, "global_batch": b, "tokens_per_s": tok_s,
        "ms_per_step": 1e3 * sec, "efficiency": tok_s / (n * base)}])


def run_stage(stage: str, out: str, dry: bool, wt103_seconds: float = 30.0,
              precision_steps: int = 300, bench_rows: bool = True,
              work: str | None = None) -> None:
  """One stage in this process (what a stage's child process runs). work:
  the folder of the precision stage's runs, which infer reads (None: a new
  temporary folder); never under out, whose files a node sends back."""
  results = Results(out)
  results.data["machine"] = machine()
  gpus = results.data["machine"]["gpus"]
  results.data.setdefault("stages", {}).setdefault(stage, {})["device"] = (
      ", ".join(g["name"] for g in gpus) if gpus
      else results.data["machine"]["devices"][0])
  results.save()
  work = work or tempfile.mkdtemp(prefix="zebra_gpu_report_work_")
  if stage == "smoke":
    stage_smoke(results, dry)
  elif stage == "quick":
    stage_quick(results, dry)
  elif stage == "bench":
    stage_bench(results, dry, bench_rows)
  elif stage == "wt103":
    stage_wt103(results, dry, wt103_seconds)
  elif stage == "precision":
    stage_precision(results, dry, work, precision_steps)
  elif stage == "infer":
    stage_infer(results, dry, work)
  elif stage == "scaling":
    stage_scaling(results, dry)
