"""The GPU report's stages, each run in its own process by lab/gpu_report.py
(what each measures: that tool's docstring), in gpu_budget.STAGES' order.
Every stage writes each row as it lands; every row that needs a kernel, a
library or a device that may be missing is guarded, so an error becomes a
row that says so and the stage goes on.
"""

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from lab.benchmarks import gpu_kernel, gpu_profile
from lab.benchmarks.gpu_results import Results, first_error_line
from lab.benchmarks.gpu_smoke import stage_smoke
from lab.benchmarks.shapes import SHAPES, model_config, zipf_probs
from lab.benchmarks.steps import train_batch, train_step
from lab.benchmarks.timing import time_interleaved
from zebra_jax.model import lm
from zebra_jax.model.recurrence import pallas as pallas_recurrence
from zebra_jax.runtime import profiling

# Before its deadline the kernel stage stops building FlashRNN rows, to time
# what it built and write its rows.
KERNEL_TIMING_S = 10


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


def _shape(dry: bool) -> dict:
  return dict(SHAPES["quick" if dry else "gpu"])


def _rounds(dry: bool) -> int:
  return 2 if dry else 5


def stage_kernel(results: Results, dry: bool, flashrnn_cuda: bool = True,
                 deadline: float | None = None) -> None:
  """The headline rows (gpu_kernel.py), group by group, each group written
  as soon as it is timed; then FlashRNN's rows, whose builds take minutes,
  last, each built only until deadline (time.time(), the stage's end less
  the time to time a row): the widest S first (heads of H/S units, the
  shape FlashRNN is made for; its Triton build of one 1024-unit head at
  S = 1 was still running after 200 s on an H100), its Triton backend
  before its CUDA one."""
  shape, rounds = _shape(dry), _rounds(dry)
  results.update("kernel", {"shape": {k: shape[k] for k in (
      "hidden", "batch", "seq_len", "layers")}, "ratios": {}}, rows=0)
  dtypes = ("bfloat16", "float32")
  groups = [(d, s) for d in dtypes for s in gpu_kernel.group_stripes(shape)]
  later = []
  for dtype, stripes in groups:
    cands = gpu_kernel.candidates(shape, dtype, stripes)
    later += [(dtype, stripes, c) for c in cands if c[0].startswith("flashrnn")]
    rows = gpu_kernel.time_group(
        shape, dtype, stripes,
        [c for c in cands if not c[0].startswith("flashrnn")], rounds)
    _add_kernel_rows(results, rows)
  if flashrnn_cuda:
    later += [(dtype, stripes, ("flashrnn_cuda", gpu_kernel.flashrnn_builder(
        {**shape, "dtype": dtype}, stripes, gpu_kernel.SHORT[dtype], "cuda")))
              for dtype, stripes in groups]
  later.sort(key=lambda row: (-row[1], row[2][0] != "flashrnn_triton"))
  for dtype, stripes, cand in later:
    _add_kernel_rows(results, gpu_kernel.time_group(
        shape, dtype, stripes, [cand], rounds,
        deadline=deadline and deadline - KERNEL_TIMING_S))


def _add_kernel_rows(results: Results, rows: list[dict]) -> None:
  """Appends rows and recomputes every dtype's ratios from all rows so far
  (one process: every row of a dtype is comparable)."""
  section = results.section("kernel")
  all_rows = section.get("rows", []) + rows
  section["ratios"] = {d: gpu_kernel.ratios(
      [r for r in all_rows if r["dtype"] == d])
                       for d in sorted({r["dtype"] for r in all_rows})}
  results.append("kernel", "rows", rows)


def wt103_config(dry: bool):
  """The wt103 recipe's config (dry: its tiny variant), with the
  vocabulary's size set as the stages use it (no data is read)."""
  cfg = _config("wt103", "tiny" if dry else "")
  cfg.model.vocab_size = 64 if dry else 267_735
  return cfg


def wt103_step(cfg, dry: bool, seconds: float, on_compiled=None):
  """The product's train step for the recipe, compiled and timed on
  synthetic Zipf ids: {compile_s, sec_per_step, steps, loss, params,
  compiled, run(i)}. on_compiled(compile_s, params) is called as soon as
  the step is compiled, before any step runs."""
  m, d = cfg.model, cfg.data
  step, state, mesh = train_step(m, d.batch_size)
  probs = zipf_probs(m.vocab_size)
  rng = np.random.default_rng(0)
  batches = [train_batch(mesh, rng.choice(m.vocab_size,
                                          (d.batch_size, d.seq_len + 1),
                                          p=probs)) for _ in range(4)]
  start = time.perf_counter()
  compiled = step.lower(state, batches[0]).compile()
  compile_s = time.perf_counter() - start
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  if on_compiled:
    on_compiled(compile_s, params)
  live = [state]

  def run(i):
    live[0], sums = compiled(live[0], batches[i % len(batches)])
    return sums["loss_sum"] / sums["count"]

  jax.block_until_ready(run(0))  # untimed: allocation, autotuning
  steps, start = 0, time.perf_counter()
  while True:
    loss = run(steps)
    steps += 1
    if steps >= 3 and (time.perf_counter() - start >= seconds or dry):
      break
  jax.block_until_ready(loss)
  return {"compile_s": compile_s,
          "sec_per_step": (time.perf_counter() - start) / steps,
          "steps": steps, "loss": float(loss), "params": params,
          "compiled": compiled, "run": run}


def wt103_step_runner(cfg, recurrence: str, dry: bool):
  """The recipe's step with model.recurrence=recurrence, compiled (under
  whatever the caller has in force): a callable that runs one step and
  waits for it, for `gpu_kernel.time_group`."""
  variant = cfg.copy_and_resolve_references()
  variant.model.recurrence = recurrence
  got = wt103_step(variant, dry, 0)
  calls = [0]

  def step():
    calls[0] += 1
    jax.block_until_ready(got["run"](calls[0]))
  return step


def stage_wt103(results: Results, dry: bool, seconds: float) -> None:
  """The recipe's model and batch (hidden 2048, S=8, the 267,735-word
  adaptive softmax, bfloat16) through the product's train step on
  synthetic ids of its real vocabulary: compile time (written as soon as
  it is known), tok/s, peak device memory, and the hours its token budget
  (train.num_steps x batch x window) would take on one GPU."""
  cfg = wt103_config(dry)
  m, d = cfg.model, cfg.data
  results.update("wt103", {
      "model": {k: m[k] for k in ("hidden_size", "num_layers", "num_stripes",
                                  "vocab_size", "head", "dtype",
                                  "recurrence")},
      "batch": d.batch_size, "seq_len": d.seq_len}, rows=0)
  got = wt103_step(cfg, dry, seconds, on_compiled=lambda sec, n: (
      results.update("wt103", {"compile_s": sec, "params": n})))
  tokens = d.batch_size * d.seq_len
  tok_s = tokens / got["sec_per_step"]
  recipe_tokens = _config("wt103").train.num_steps * tokens
  peak, source = profiling.peak_memory()
  results.update("wt103", {
      "steps_timed": got["steps"],
      "ms_per_step": 1e3 * got["sec_per_step"], "tokens_per_s": tok_s,
      "recipe_tokens": recipe_tokens,
      "projected_hours": recipe_tokens / tok_s / 3600,
      "peak_bytes": peak, "peak_source": source,
      "xla_bytes": profiling.compiled_bytes(got["compiled"]),
      "final_loss": got["loss"]})
  del got
  stage_wt103_pallas(results, cfg, dry, seconds / 2, tok_s)


def stage_wt103_pallas(results: Results, cfg, dry: bool, seconds: float,
                       scan_tok_s: float) -> None:
  """The same step with model.recurrence=pallas, after the scan's figures
  are written: the recipe keeps the scan until this row says the fused
  kernel is faster at its stripes (G=256, bfloat16, whose U_s streams from
  L2 every step). Off a GPU the kernel runs in interpret mode: the row
  then checks the code path, not the speed."""
  m, d = cfg.model, cfg.data
  launch = pallas_recurrence.launch_plan(
      d.batch_size, m.hidden_size // m.num_stripes,
      lm.compute_dtype(m.dtype), triton=jax.default_backend() == "gpu")
  row = {"plan": pallas_recurrence.describe(launch)}
  if launch.rows is None:
    results.update("wt103", {"pallas": row})
    return
  variant = cfg.copy_and_resolve_references()
  variant.model.recurrence = "pallas"
  try:
    got = wt103_step(variant, dry, seconds)
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = first_error_line(e)
    results.update("wt103", {"pallas": row})
    return
  tokens = d.batch_size * d.seq_len
  tok_s = tokens / got["sec_per_step"]
  row.update(compile_s=got["compile_s"], steps_timed=got["steps"],
             ms_per_step=1e3 * got["sec_per_step"], tokens_per_s=tok_s,
             x_scan=tok_s / scan_tok_s, final_loss=got["loss"])
  results.update("wt103", {"pallas": row})


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
    curves = results.section("precision")["curves"]
    curves[dtype] = {
        "loss": pts, "final_loss": pts[-1][1] if pts else None,
        "max_abs_diff_vs_fp32": max(diffs) if diffs else None,
        "skipped_after_warmup": (max(skipped) - min(skipped)
                                 if skipped else None),
        "loss_scale": curve[-1].get("loss_scale") if curve else None}
    results.update("precision", {"curves": curves})


def engine_tokens_per_s(generator, prompt_ids, slots: int,
                        new_tokens: int, rounds: int) -> dict:
  """The serving engine with `slots` slots, every slot busy: `slots`
  requests of new_tokens tokens each, submitted at once, `rounds` times
  after one untimed round (its programs compile); generated tokens/s."""
  from zebra_jax.inference import engine as engines  # pylint: disable=g-import-not-at-top
  params = engines.SamplingParams(max_new_tokens=new_tokens, seed=0)
  engine = generator.engine

  def one_round():
    requests = engine.submit_many(
        [engines.Row("", params, prompt_ids, i) for i in range(slots)],
        block=True)
    for r in requests:
      r.result(timeout=600)
    return sum(r.completion_tokens for r in requests)

  one_round()
  start, tokens = time.perf_counter(), 0
  for _ in range(rounds):
    tokens += one_round()
  sec = time.perf_counter() - start
  return {"slots": slots, "requests": slots * rounds,
          "prompt_len": len(prompt_ids), "new_tokens": new_tokens,
          "tokens": tokens, "seconds": sec, "tokens_per_s": tokens / sec}


def stage_infer(results: Results, dry: bool, work: str) -> None:
  """The serving engine's generation tokens/s at 1, 16 and 64 slots, each
  written as it lands, on the precision stage's float32 run (a short demo
  run when it is not there)."""
  # pylint: disable=g-import-not-at-top
  from zebra_jax.inference import loading, sample
  workdir = os.path.join(work, "precision_float32")
  cfg = _config("demo", "tiny" if dry else "")
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    cfg = _train_demo(workdir, dry, 4 if dry else 50)
  loaded = loading.load_for_inference(cfg, workdir)
  prompt = np.asarray(loaded.splits["valid"])[:4 if dry else 32]
  results.update("infer", {"step": int(loaded.step),
                           "dtype": loaded.cfg.model.dtype}, rows=0)
  for slots in (1, 2) if dry else (1, 16, 64):
    generator = sample.Generator(loaded, slots=slots)
    try:
      row = engine_tokens_per_s(generator, prompt.astype(np.int32), slots,
                                new_tokens=4 if dry else 64,
                                rounds=1 if dry else 3)
    finally:
      generator.close()
    results.append("infer", "results", [row])


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


def run_stage(stage: str, out: str, dry: bool, wt103_seconds: float = 10.0,
              precision_steps: int = 150, flashrnn_cuda: bool = True,
              work: str | None = None, deadline: float | None = None) -> None:
  """One stage in this process (what a stage's child process runs). work:
  the folder of the precision stage's runs, which infer reads (None: a new
  temporary folder); never under out, whose files a node sends back.
  deadline: time.time() at which the driver kills the stage, if known."""
  results = Results(out)
  results.data["machine"] = machine()
  gpus = results.data["machine"]["gpus"]
  results.data.setdefault("stages", {}).setdefault(stage, {})["device"] = (
      ", ".join(g["name"] for g in gpus) if gpus
      else results.data["machine"]["devices"][0])
  results.save()
  work = work or tempfile.mkdtemp(prefix="zebra_gpu_report_work_")
  if stage == "smoke":
    stage_smoke(results)  # the same tiny shapes either way
  elif stage == "kernel":
    stage_kernel(results, dry, flashrnn_cuda, deadline)
    if gpu_kernel.left_behind():
      # Every row is on disk; a build thread left in CUDA code could hold
      # the interpreter's exit until the driver kills the stage.
      sys.stdout.flush()
      os._exit(0)  # pylint: disable=protected-access
  elif stage == "wt103":
    stage_wt103(results, dry, wt103_seconds)
  elif stage == "precision":
    stage_precision(results, dry, work, precision_steps)
  elif stage == "infer":
    stage_infer(results, dry, work)
  elif stage == "scaling":
    stage_scaling(results, dry)
  elif stage == "profile":
    gpu_profile.stage_profile(results, out, work,
                              lambda: wt103_step(wt103_config(dry), dry, 0))
