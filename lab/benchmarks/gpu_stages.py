"""The GPU report's stages, each run in its own process by lab/gpu_report.py
(what each measures: that tool's docstring), in gpu_budget.STAGES' order.
Every stage writes each row as it lands; every row that needs a kernel, a
library or a device that may be missing is guarded, so an error becomes a
row that says so and the stage goes on.
"""

import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from lab.benchmarks import gpu_infer, gpu_kernel, gpu_profile
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
  wide = gpu_kernel.wide_group(shape)
  if wide:
    wide_shape, label, cands = wide
    _add_kernel_rows(results, gpu_kernel.time_group(
        wide_shape, wide_shape["dtype"], 1, cands, rounds, label=label))
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


# The recipe row's synthetic corpus: ids for this many steps of each
# variant at most, so no batch repeats within a call (a run past them
# wraps, and its row counts the epochs it read).
WT103_MAX_STEPS = 1200
# The candidates timed beside the recipe's step, interleaved, in order of
# value: (name, {model field: value}). Each computes the recipe's function
# (the CPU suite holds the kernel to the scan, every chunk size to a
# float64 reference, and the head's switches to the default loss:
# tests/model/test_head_switches.py); the winner becomes the recipe's
# default. On an H200 (2026-11-28) larger chunks than the GPU's 1,024 rows
# lost (4,096: 0.81x; 16,384: 0.46x) and the kernel won 1.05x. The head
# is about 38% of the step: its three loss switches come first, then the
# kernel, the kernel with all of them, and one smaller chunk (512; 256
# waits for its result). Six builds fit the stage's 130 s: the recipe and
# four variants took 83 s on the H200, 5-11 s of compile each; a variant
# the budget leaves out is a row that says so.
WT103_VARIANTS = (
    ("head_logits_dtype=compute", {"head_logits_dtype": "compute"}),
    ("head_fused_xent", {"head_fused_xent": True}),
    ("adaptive_tile=128", {"adaptive_tile": 128}),
    ("recurrence=pallas", {"recurrence": "pallas"}),
    ("recurrence=pallas, head_logits_dtype=compute, head_fused_xent, "
     "adaptive_tile=128",
     {"recurrence": "pallas", "head_logits_dtype": "compute",
      "head_fused_xent": True, "adaptive_tile": 128}),
    ("adaptive_chunk_rows=512", {"adaptive_chunk_rows": 512}),
)
# A variant is built only while this much of the stage is left for it and
# for timing every variant built; a dry run times one step a round, so
# needs less (its five builds took 58 s of the dry 90 s on a loaded
# 2-core CPU with 35 s kept back, leaving the fifth unbuilt).
WT103_BUILD_MARGIN_S = 35
WT103_DRY_BUILD_MARGIN_S = 15


def dry_variants(variants=WT103_VARIANTS) -> tuple:
  """What a dry run builds: each variant that sets a field no earlier one
  did, so every candidate's code path is built once and combinations of
  paths already built are not."""
  seen, chosen = set(), []
  for name, fields in variants:
    if set(fields) - seen:
      chosen.append((name, fields))
    seen |= set(fields)
  return tuple(chosen)


def zipf_entropy(vocab: int) -> float:
  """Entropy in nats of `zipf_probs(vocab)`: the loss of a model that knows
  the law and nothing more, below which no model of these i.i.d. ids
  goes."""
  p = zipf_probs(vocab)
  return float(-(p * np.log(p)).sum())


def wt103_ids(cfg, dry: bool) -> np.ndarray:
  """The synthetic corpus: Zipf-distributed ids of the recipe's vocabulary,
  enough for WT103_MAX_STEPS batches (drawn once per shape: every build of
  a stage or a tool reads the same, read-only array)."""
  m, d = cfg.model, cfg.data
  return _zipf_ids(m.vocab_size, d.batch_size * (
      d.seq_len * (8 if dry else WT103_MAX_STEPS) + 1))


@functools.lru_cache(maxsize=2)
def _zipf_ids(vocab: int, count: int) -> np.ndarray:
  ids = np.random.default_rng(0).choice(vocab, count, p=zipf_probs(vocab))
  ids = ids.astype(np.int32)
  ids.flags.writeable = False
  return ids


def wt103_build(cfg, ids: np.ndarray, on_compiled=None) -> dict:
  """The product's train step for cfg, compiled, fed as the train loop
  feeds it: the data config's batcher over `ids`, a fresh window every
  step, made and sent to the device on the host while the last step runs.
  Returns {compile_s, params, compiled, run(i=None) -> loss (the next
  batch, or batch i), epochs() -> epochs of ids read}, one step run.
  on_compiled(compile_s, params) is called as soon as it is compiled."""
  # pylint: disable=g-import-not-at-top
  from zebra_jax.data import pipeline
  from zebra_jax.runtime import parallel
  m, d = cfg.model, cfg.data
  step, state, mesh = train_step(m, d.batch_size)
  batcher = pipeline.make_batcher(d, ids, cfg.seed)

  def batch(i):
    index = i % batcher.batches_per_epoch
    inputs, targets = batcher.get(index, i // batcher.batches_per_epoch)
    return {"inputs": parallel.global_batch(mesh, inputs),
            "targets": parallel.global_batch(mesh, targets),
            "reset": np.asarray(batcher.starts_fresh(index))}

  start = time.perf_counter()
  compiled = step.lower(state, batch(0)).compile()
  compile_s = time.perf_counter() - start
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  if on_compiled:
    on_compiled(compile_s, params)
  live, done = [state], [0]

  def run(i=None):
    live[0], sums = compiled(live[0], batch(done[0] if i is None else i))
    done[0] += 1
    return sums["loss_sum"] / sums["count"]

  jax.block_until_ready(run())  # untimed: allocation, autotuning
  return {"compile_s": compile_s, "params": params, "compiled": compiled,
          "run": run, "epochs": lambda: done[0] / batcher.batches_per_epoch}


def wt103_rounds(runs: dict, seconds: float, dry: bool) -> dict:
  """{name: {ms_per_step, min_ms, max_ms, rounds, steps_timed, loss_first,
  loss_last, epochs}}: every build's steps in rounds, the builds
  interleaved, each round as many steps as share `seconds` out for the
  first build (at least five rounds; two in a dry run); a round's host
  wall time over its steps, the input pipeline included. Every build runs
  the same batches in the same order, so their losses compare."""
  rounds = 2 if dry else 5
  per_step = None
  for got in runs.values():  # every build one more step: the same batches
    start = time.perf_counter()
    jax.block_until_ready(got["run"]())
    per_step = per_step or time.perf_counter() - start
  per_round = 1 if dry else max(
      1, int(seconds / len(runs) / rounds / per_step))
  times = {name: [] for name in runs}
  losses = {name: [] for name in runs}
  for _ in range(rounds):
    for name, got in runs.items():
      start = time.perf_counter()
      got_losses = [got["run"]() for _ in range(per_round)]
      jax.block_until_ready(got_losses)
      times[name].append((time.perf_counter() - start) / per_round)
      losses[name] += got_losses
  return {name: {"ms_per_step": 1e3 * float(np.median(times[name])),
                 "min_ms": 1e3 * min(times[name]),
                 "max_ms": 1e3 * max(times[name]), "rounds": rounds,
                 "steps_timed": rounds * per_round,
                 "loss_first": float(losses[name][0]),
                 "loss_last": float(losses[name][-1]),
                 "epochs": runs[name]["epochs"]()}
          for name in runs}


def wt103_step_runner(cfg, recurrence: str, dry: bool):
  """The recipe's step with model.recurrence=recurrence, compiled (under
  whatever the caller has in force): a callable that runs one step and
  waits for it, for `gpu_kernel.time_group`."""
  variant = cfg.copy_and_resolve_references()
  variant.model.recurrence = recurrence
  got = wt103_build(variant, wt103_ids(variant, dry))
  return lambda: jax.block_until_ready(got["run"]())


def stage_wt103(results: Results, dry: bool, seconds: float,
                deadline: float | None = None) -> None:
  """The recipe's model and batch (hidden 2048, S=8, the 267,735-word
  adaptive softmax, bfloat16) through the product's train step, fed a
  synthetic corpus of its real vocabulary through the input pipeline:
  compile time (written as soon as it is known), then each candidate of
  WT103_VARIANTS built while the stage's deadline (time.time()) allows,
  then all of them timed interleaved: tok/s, the loss (above the ids'
  entropy: nothing memorised), peak device memory, and the hours the
  recipe's token budget would take on one GPU. Off a GPU the fused kernel
  runs in interpret mode: its row checks the code path, not the speed. A
  dry run builds each candidate's code path once (`dry_variants`) in the
  tiny recipe's float32, where head_logits_dtype=compute is the float32
  path (its bf16 one: tests/model/test_head_switches.py)."""
  cfg = wt103_config(dry)
  m, d = cfg.model, cfg.data
  results.update("wt103", {
      "model": {k: m[k] for k in ("hidden_size", "num_layers", "num_stripes",
                                  "vocab_size", "head", "dtype",
                                  "recurrence", "adaptive_chunk_rows",
                                  "head_logits_dtype", "head_fused_xent",
                                  "adaptive_tile")},
      "batch": d.batch_size, "seq_len": d.seq_len,
      "zipf_entropy": zipf_entropy(m.vocab_size)}, rows=0)
  ids = wt103_ids(cfg, dry)
  runs = {"recipe": wt103_build(cfg, ids, on_compiled=lambda sec, n: (
      results.update("wt103", {"compile_s": sec, "params": n})))}
  results.update("wt103", {
      "xla_bytes": profiling.compiled_bytes(runs["recipe"]["compiled"])})
  variants = []
  for name, fields in dry_variants() if dry else WT103_VARIANTS:
    row = {"name": name, "fields": fields}
    variants.append(row)
    margin = WT103_DRY_BUILD_MARGIN_S if dry else WT103_BUILD_MARGIN_S
    if deadline is not None and deadline - time.time() < margin:
      row["error"] = "not built: the stage's budget was spent"
      continue
    variant = cfg.copy_and_resolve_references()
    variant.model.update(fields)
    if fields.get("recurrence") == "pallas":
      row["plan"] = pallas_recurrence.describe(pallas_recurrence.launch_plan(
          d.batch_size, m.hidden_size // m.num_stripes,
          lm.compute_dtype(m.dtype), triton=jax.default_backend() == "gpu"))
    try:
      runs[name] = wt103_build(variant, ids)
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = first_error_line(e)
      continue
    row.update(compile_s=runs[name]["compile_s"], xla_bytes=(
        profiling.compiled_bytes(runs[name]["compiled"])))
  timed = wt103_rounds(runs, seconds, dry)
  tokens = d.batch_size * d.seq_len
  recipe = timed["recipe"]
  tok_s = tokens / recipe["ms_per_step"] * 1e3
  recipe_tokens = _config("wt103").train.num_steps * tokens
  peak, source = profiling.peak_memory()
  for row in variants:
    if row["name"] in timed:
      got = timed[row["name"]]
      row.update(got, tokens_per_s=tokens / got["ms_per_step"] * 1e3,
                 x_recipe=recipe["ms_per_step"] / got["ms_per_step"],
                 loss_diff=abs(got["loss_last"] - recipe["loss_last"]))
  results.update("wt103", {
      **recipe, "tokens_per_s": tok_s, "recipe_tokens": recipe_tokens,
      "projected_hours": recipe_tokens / tok_s / 3600,
      "peak_bytes": peak, "peak_source": source, "variants": variants})


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


# The infer stage's slot counts (a dry run's), and the new tokens and timed
# rounds of each row.
INFER_SLOTS, DRY_INFER_SLOTS = (1, 16, 64), (1, 2)
# A row is started only while this much of the stage is left: the recipe's
# model compiles its engine's programs (decode, prefill, restore) afresh at
# every slot count; a row the budget leaves out says so.
INFER_ROW_MARGIN_S, DRY_INFER_ROW_MARGIN_S = 12, 5


def stage_infer(results: Results, dry: bool, work: str,
                deadline: float | None = None) -> None:
  """The serving engine's generation at 1, 16 and 64 slots, each row
  written as it lands: the demo model (the precision stage's float32 run,
  or a short demo run when it is not there), then the one-slot decode's
  time split between host and device on the same engine, then the
  wt103 recipe's model with random weights (dry: its tiny variant). A row
  that cannot run (memory, the stage's budget) is its one-line error."""
  from zebra_jax.inference import loading, sample  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(work, "precision_float32")
  cfg = _config("demo", "tiny" if dry else "")
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    cfg = _train_demo(workdir, dry, 4 if dry else 50)
  loaded = loading.load_for_inference(cfg, workdir)
  prompt = np.asarray(loaded.splits["valid"])[:4 if dry else 32]
  wt103 = wt103_config(dry)
  results.update("infer", {
      "step": int(loaded.step), "dtype": loaded.cfg.model.dtype,
      "wt103_model": {"variant": "tiny" if dry else "recipe",
                      "dtype": wt103.model.dtype,
                      "vocab": wt103.model.vocab_size,
                      "weights": "random"}}, rows=0)
  row = functools.partial(
      gpu_infer.serve_row, results, new_tokens=4 if dry else 64,
      rounds=1 if dry else 3, deadline=deadline,
      margin=DRY_INFER_ROW_MARGIN_S if dry else INFER_ROW_MARGIN_S)
  for slots in DRY_INFER_SLOTS if dry else INFER_SLOTS:
    row("demo", slots, lambda n: sample.Generator(loaded, slots=n), prompt,
        split=slots == 1)
  wt103_prompt = np.random.default_rng(0).integers(
      0, wt103.model.vocab_size, len(prompt))
  make = gpu_infer.random_generators(wt103)
  for slots in DRY_INFER_SLOTS if dry else INFER_SLOTS:
    row("wt103", slots, make, wt103_prompt)


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
    stage_wt103(results, dry, wt103_seconds, deadline)
  elif stage == "precision":
    stage_precision(results, dry, work, precision_steps)
  elif stage == "infer":
    stage_infer(results, dry, work, deadline)
  elif stage == "scaling":
    stage_scaling(results, dry)
  elif stage == "profile":
    gpu_profile.stage_profile(results, out, work, lambda: wt103_build(
        wt103_config(dry), wt103_ids(wt103_config(dry), dry)))
