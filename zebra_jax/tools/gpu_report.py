"""Every GPU figure in one command: docs/gpu-results.md and its JSON.

  python -m zebra_jax.tools.gpu_report --stage=all --out=docs
  python -m zebra_jax.tools.gpu_report --stage=wt103 --out=docs   # one stage
  python -m zebra_jax.tools.gpu_report --dry_run --out=/tmp/r       # CPU, tiny

Stages (each fits in 10 minutes on one H100; run them one at a time when a
machine gives commands no more than that; every stage adds its section to
OUT/gpu-results.json and rewrites OUT/gpu-results.md from all of them):
  bench      zebra_jax.tools.bench --shape=gpu (core/LM/eval/generation rows
             against cuDNN nn.LSTM, bf16, with the matmul peak and memory),
             the same core rows in fp32, and pallas rows: the fused stripe
             kernel (model.recurrence=pallas) beside the scan
  wt103      configs/wt103.py's model (hidden 2048, S=8, the 267,735-word
             adaptive softmax, batch 128 x 128) trained on synthetic Zipf ids:
             tok/s, ms/step, memory, and the share of the step spent in the
             LSTM layers, the head and the optimizer from a jax.profiler trace
  infer      infer_bench latency percentiles at batch 1..64 (a short demo run
             provides the checkpoint)
  precision  the demo corpus in float32, bfloat16 and float16 (dynamic loss
             scaling), a few hundred steps each: loss curves and skipped steps
  scaling    data-parallel weak scaling over 1, 2, 4, ... GPUs of this machine

--dry_run: tiny shapes on whatever device there is (seconds; the tests run
it so that the script cannot rot). Its figures mean nothing.
"""

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
import optax
from absl import app, flags
from flax import nnx

from zebra_jax.model import lm, pallas_recurrence
from zebra_jax.runtime import profiling
from zebra_jax.tools import bench

STAGES = ("bench", "wt103", "precision", "infer", "scaling")
_STAGE = flags.DEFINE_enum("stage", "all", ("all",) + STAGES,
                           "Which measurements to run.")
_OUT = flags.DEFINE_string("out", "docs", "Folder for gpu-results.md/.json.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Tiny shapes, seconds: checks "
                             "that every stage runs, measures nothing.")
_WT103_SECONDS = flags.DEFINE_float("wt103_seconds", 120.0,
                                    "wt103: seconds of timed training.")
_PRECISION_STEPS = flags.DEFINE_integer("precision_steps", 300,
                                        "precision: steps per dtype.")
_BENCH_ROWS = flags.DEFINE_bool("bench_rows", True, "bench: run bench.py's "
                                "rows too (else only the pallas rows).")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


# ------------------------------------------------------------ the machine


def machine() -> dict:
  """GPU names and driver from nvidia-smi, and what JAX sees."""
  info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"),
          "jax": jax.__version__, "python": sys.version.split()[0],
          "platform": jax.devices()[0].platform,
          "devices": [d.device_kind for d in jax.devices()]}
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


# --------------------------------------------------------- trace summary


def _scope_category(op_name: str) -> str:
  """An HLO op's named-scope path (e.g. "jit(step)/transpose(jvp(head))/dot")
  -> the part of the step it belongs to."""
  words = set(re.findall(r"\w+", op_name))
  if "optimizer" in words:
    return "optimizer"
  if any(w.startswith("zebra_lstm") for w in words):
    return "lstm_layers"
  if words & {"head", "loss", "accuracy"}:
    return "head"
  if "embedding" in words:
    return "embedding"
  return "other"


def hlo_op_scopes(hlo_text: str) -> dict:
  """{HLO instruction name: its op_name metadata} from compiled HLO text."""
  scopes = {}
  for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"",
                       hlo_text):
    scopes[m.group(1)] = m.group(2)
  return scopes


def summarise_trace(trace_dir: str, hlo_text: str) -> dict:
  """Device time per part of the step from a jax.profiler trace.

  Reads the trace's .trace.json.gz (written with create_perfetto_trace):
  every op event names its HLO instruction (args.hlo_op); the compiled
  HLO's metadata gives that instruction's named-scope path. Returns
  {category: share of the attributed time} and the seconds behind it.
  """
  events = profiling.trace_op_events(trace_dir)
  if events is None:
    return {"error": f"no .trace.json.gz under {trace_dir}"}
  scopes = hlo_op_scopes(hlo_text)
  seconds = {}
  for e in events:
    op = e.get("args", {}).get("hlo_op")
    if not op:
      continue
    category = _scope_category(scopes.get(op, ""))
    seconds[category] = seconds.get(category, 0.0) + e.get("dur", 0) / 1e6
  total = sum(seconds.values())
  return {"seconds": seconds,
          "share": {k: v / total for k, v in seconds.items()} if total else {},
          "trace_dir": trace_dir}


# ---------------------------------------------------------------- stages


def _layers_step(shape, stripes, kernel):
  """A train step of stacked ZebraLSTMLayers (bench's core rows) with the
  given recurrence kernel: (step(), tokens per call)."""
  b, t, h = shape["batch"], shape["seq_len"], shape["hidden"]
  dt = lm.compute_dtype(shape["dtype"])
  graphdef, params = nnx.split(nnx.List([
      lm.ZebraLSTMLayer(h, h, stripes, rngs=nnx.Rngs(i), dtype=dt,
                        kernel=kernel) for i in range(shape["layers"])]))
  x = jax.random.normal(jax.random.key(0), (b, t, h), dt)
  zeros = jnp.zeros((b, h), jnp.float32)
  tx = optax.adam(1e-3)

  def loss_fn(params):
    y = x
    for layer in nnx.merge(graphdef, params):
      y, _ = layer(y, (zeros, zeros))
    return jnp.sum(jnp.square(y.astype(jnp.float32))) / y.size

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  state = [params, tx.init(params)]

  def run():
    state[0], state[1], loss = step(*state)
    jax.block_until_ready(loss)
  run()  # compiles
  return run, b * t


def pallas_rows(shape, rounds) -> list[dict]:
  """Core train-step rows, scan vs pallas, per stripe count, timed
  interleaved; each says whether the kernel ran or the scan stood in."""
  rows = []
  triton = jax.devices()[0].platform == "gpu"
  dt = lm.compute_dtype(shape["dtype"])
  for s in shape["stripes"]:
    g = shape["hidden"] // s
    block, why = pallas_recurrence.plan(shape["batch"], g, dt, triton=triton)
    fns, tokens = {}, 0
    for kernel in ("scan", "pallas"):
      fns[kernel], tokens = _layers_step(shape, s, kernel)
    sec = bench.time_interleaved(fns, rounds)
    flops = bench.step_flops(shape, s, input_grad=False)
    for kernel in ("scan", "pallas"):
      rows.append({
          "name": f"{kernel}_core_S{s}", "stripes": s, "width": g,
          "dtype": shape["dtype"], "tokens_per_s": tokens / sec[kernel],
          "ms_per_step": 1e3 * sec[kernel],
          "vs_scan": sec["scan"] / sec[kernel],
          "tflops": flops * tokens / sec[kernel] / 1e12,
          "kernel": ("fused" if block else f"scan fallback: {why}")
                    if kernel == "pallas" else "lax.scan",
          "batch_block": block if kernel == "pallas" else None})
  return rows


def stage_bench(dry: bool, out: str, bench_rows: bool = True) -> dict:
  """bench_rows=False: only the pallas rows (bench.run's own rows take
  minutes even at its quick shape; tests/tools/test_bench.py covers them)."""
  results = {}
  shape_name = "gpu"
  if bench_rows:
    results["bf16"] = bench.run(
        quick=dry, shape_name=shape_name,
        json_path=os.path.join(out, "bench-gpu.json"),
        rounds=2 if dry else 0, memory=not dry)
  shape = dict(bench.SHAPES["quick" if dry else shape_name])
  rounds = 2 if dry else 5
  results["pallas"] = {"bfloat16": pallas_rows(shape, rounds)}
  if not dry:  # the same core comparison in fp32
    results["pallas"]["float32"] = pallas_rows(
        {**shape, "dtype": "float32"}, rounds)
  return results


def _wt103_config(dry: bool):
  cfg = _config("wt103", "tiny" if dry else "")
  cfg.model.vocab_size = 64 if dry else 267_735
  return cfg


def stage_wt103(dry: bool, seconds: float) -> dict:
  """The recipe's model and batch on synthetic ids of its real vocabulary."""
  cfg = _wt103_config(dry)
  m, d = cfg.model, cfg.data
  graphdef, params = lm.create(m, seed=0)
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)
  probs = bench.zipf_probs(m.vocab_size)
  rng = np.random.default_rng(0)
  batches = [jnp.asarray(rng.choice(m.vocab_size, (d.batch_size,
                                                   d.seq_len + 1), p=probs),
                         jnp.int32) for _ in range(4)]
  carry = lm.init_carry(m, d.batch_size)

  def step(params, opt_state, tokens, carry, key):
    def loss_fn(params):
      sums, new_carry = lm.token_sums(graphdef, params, tokens[:, :-1],
                                      tokens[:, 1:], carry, key,
                                      with_accuracy=False)
      return sums["loss_sum"] / sums["count"], new_carry
    (loss, new_carry), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params)
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, jax.lax.stop_gradient(new_carry), loss

  key = jax.random.key(0)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, opt_state, batches[0], carry, key).compile()
  state = [params, opt_state, carry]

  def run(i):
    state[0], state[1], state[2], loss = compiled(
        state[0], state[1], batches[i % len(batches)], state[2], key)
    return loss

  jax.block_until_ready(run(0))
  steps, start = 0, time.perf_counter()
  while True:
    loss = run(steps)
    steps += 1
    if steps >= (3 if dry else 5) and (time.perf_counter() - start >= seconds
                                        or dry):
      break
  jax.block_until_ready(loss)
  sec = (time.perf_counter() - start) / steps
  tokens = d.batch_size * d.seq_len
  peak, source = profiling.peak_memory()
  trace_dir = tempfile.mkdtemp(prefix="zebra_wt103_trace_")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for i in range(3):
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        jax.block_until_ready(run(i))
  g = m.hidden_size // m.num_stripes
  block, why = pallas_recurrence.plan(
      d.batch_size, g, lm.compute_dtype(m.dtype),
      triton=jax.devices()[0].platform == "gpu")
  return {"model": {k: m[k] for k in ("hidden_size", "num_layers",
                                       "num_stripes", "vocab_size", "head",
                                       "dtype")},
          "batch": d.batch_size, "seq_len": d.seq_len, "steps_timed": steps,
          "ms_per_step": 1e3 * sec, "tokens_per_s": tokens / sec,
          "epoch_minutes_103M": 103e6 / (tokens / sec) / 60,
          "peak_bytes": peak, "peak_source": source,
          "xla_bytes": profiling.compiled_bytes(compiled),
          "final_loss": float(loss),
          "profile": summarise_trace(trace_dir, compiled.as_text()),
          "pallas": ("fits: the fused kernel would run" if block else
                     f"model.recurrence=pallas runs the scan here: {why}")}


def _config(name: str, variant: str = ""):
  """configs/NAME.py's config, loaded by path like --config does."""
  sys.path.insert(0, REPO)
  module = __import__(f"configs.{name}", fromlist=["get_config"])
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


def stage_infer(dry: bool, work: str) -> dict:
  """infer_bench on a short demo run (the precision stage's float32 run when
  it is there)."""
  from zebra_jax.tools import infer_bench  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(work, "precision_float32")
  cfg = _config("demo", "tiny" if dry else "")
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    cfg = _train_demo(workdir, dry, 4 if dry else 50)
  sizes = (1, 2) if dry else (1, 2, 4, 8, 16, 32, 64)
  return infer_bench.run(cfg, workdir, sizes, new_tokens=4 if dry else 64,
                         prompt_len=4 if dry else 32,
                         requests=2 if dry else 5,
                         json_path=os.path.join(work, "infer_bench.json"))


def stage_precision(dry: bool, work: str, steps: int) -> dict:
  """The same run in three compute dtypes: loss curves against float32's
  and steps skipped by the loss scale after warm-up."""
  steps = 6 if dry else steps
  curves = {}
  for dtype in ("float32", "bfloat16", "float16"):
    workdir = os.path.join(work, f"precision_{dtype}")
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
      _train_demo(workdir, dry, steps, dtype)
    curves[dtype] = [m for m in _metrics(workdir) if m["kind"] == "train"]
  ref = {m["step"]: m["loss"] for m in curves["float32"]}
  warm = steps // 5
  result = {"steps": steps, "warmup_steps_ignored": warm, "curves": {}}
  for dtype, curve in curves.items():
    pts = [(m["step"], m["loss"]) for m in curve]
    diffs = [abs(loss - ref[s]) for s, loss in pts if s in ref and s >= warm]
    skipped = [m.get("skipped", 0) for m in curve if m["step"] >= warm]
    result["curves"][dtype] = {
        "loss": pts, "final_loss": pts[-1][1] if pts else None,
        "max_abs_diff_vs_fp32": max(diffs) if diffs else None,
        "skipped_after_warmup": (max(skipped) - min(skipped)
                                 if skipped else None),
        "loss_scale": curve[-1].get("loss_scale") if curve else None}
  return result


def stage_scaling(dry: bool) -> dict:
  """Weak scaling: the per-device batch stays fixed as devices are added;
  efficiency = tok/s(n) / (n x tok/s(1))."""
  devices = jax.devices()
  shape = dict(bench.SHAPES["quick" if dry else "gpu"])
  counts = [n for n in (1, 2, 4, 8, 16) if n <= len(devices)]
  if dry:  # one compile per count: the smallest and largest are enough
    counts = sorted({counts[0], counts[-1]})
  cfg = bench.model_config(shape, shape["stripes"][-1])
  rows = []
  for n in counts:
    mesh = jax.sharding.Mesh(np.asarray(devices[:n]), ("data",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    dat = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    graphdef, params = lm.create(cfg, seed=0)
    tx = optax.adam(1e-3)
    params = jax.device_put(params, rep)
    opt_state = jax.device_put(tx.init(params), rep)
    b = shape["batch"] * n
    tokens = jax.device_put(jax.random.randint(
        jax.random.key(0), (b, shape["seq_len"] + 1), 0, shape["vocab"]), dat)
    carry = jax.device_put(lm.init_carry(cfg, b), dat)

    def step(params, opt_state, tokens, carry):
      def loss_fn(params):
        sums, _ = lm.token_sums(graphdef, params, tokens[:, :-1],
                                tokens[:, 1:], carry, with_accuracy=False)
        return sums["loss_sum"] / sums["count"]
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, donate_argnums=(0, 1))
    state = [params, opt_state]

    def run():
      state[0], state[1], loss = jitted(state[0], state[1], tokens, carry)
      jax.block_until_ready(loss)
    run()
    sec = bench.time_interleaved({"step": run}, 2 if dry else 10)["step"]
    rows.append({"devices": n, "global_batch": b,
                 "tokens_per_s": b * shape["seq_len"] / sec,
                 "ms_per_step": 1e3 * sec})
  for r in rows:
    r["efficiency"] = r["tokens_per_s"] / (r["devices"]
                                           * rows[0]["tokens_per_s"])
  note = None if len(devices) > 1 else (
      f"1 {devices[0].platform.upper()} device: weak scaling not measured")
  return {"stripes": shape["stripes"][-1], "per_device_batch": shape["batch"],
          "seq_len": shape["seq_len"], "hidden": shape["hidden"],
          "rows": rows, "note": note}


# ---------------------------------------------------------------- report


def _fmt(x, spec=",.0f"):
  return "-" if x is None else format(x, spec)


def render(report: dict) -> str:
  """The markdown page, from whatever stages the JSON holds."""
  mach = report.get("machine", {})
  gpus = mach.get("gpus") or []
  lines = ["# GPU results", "",
           "Measured by `python -m zebra_jax.tools.gpu_report` "
           "(`bash launch/gpu_report.sh`); the JSON beside this page holds "
           "every number.", ""]
  if report.get("dry_run"):
    lines += ["**DRY RUN: tiny shapes, figures mean nothing.**", ""]
  lines += [f"- date: {mach.get('date', '-')}",
            f"- GPU: {', '.join(g['name'] for g in gpus) or 'none'}"
            f" (driver {gpus[0]['driver'] if gpus else '-'})",
            f"- JAX {mach.get('jax', '-')}, Python {mach.get('python', '-')},"
            f" devices: {len(mach.get('devices', []))} x "
            f"{(mach.get('devices') or ['-'])[0]}", ""]
  if "bench" in report and "bf16" in report["bench"]:
    b = report["bench"]["bf16"]
    lines += ["## bench --shape=gpu", "",
              f"{b['device']}; matmul peak {b['matmul_peak_gflops']:,.0f} "
              f"GFLOP/s; {b['torch']}", "",
              "| row | tok/s | ms/step | x torch | TFLOP/s | % peak | "
              "XLA plan MB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in b["rows"]:
      ratio = _fmt(r["ratio_to_torch"], ".2f")
      plan = _fmt(r["xla_bytes"] and r["xla_bytes"] / 2 ** 20)
      lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['ms_per_step']:.1f} | {ratio} | "
                   f"{r['gflops'] / 1e3:.2f} | "
                   f"{100 * r['frac_of_peak']:.0f}% | {plan} |")
    for m in b.get("memory") or []:
      lines.append(f"\npeak memory, LM S=1, window {m['seq_len']}, remat "
                   f"{m['remat']}: {_fmt(m['peak_bytes'] / 2 ** 20)} MB "
                   f"({m['peak_source']})")
  if "bench" in report:
    lines += ["", "### pallas: the fused stripe kernel vs the scan "
              "(core train step)", "",
              "| row | dtype | tok/s | ms/step | x scan | TFLOP/s | kernel |",
              "|---|---|---:|---:|---:|---:|---|"]
    for rows in report["bench"]["pallas"].values():
      for r in rows:
        lines.append(f"| {r['name']} | {r['dtype']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                     f"{r['vs_scan']:.2f} | {r['tflops']:.2f} | "
                     f"{r['kernel']} |")
    lines.append("")
  if "wt103" in report:
    w = report["wt103"]
    share = w["profile"].get("share", {})
    lines += ["## WikiText-103 recipe shapes (synthetic ids)", "",
              f"model {w['model']}, batch {w['batch']} x {w['seq_len']}, "
              f"{w['steps_timed']} timed steps", "",
              f"- {w['tokens_per_s']:,.0f} tok/s, {w['ms_per_step']:.1f} "
              f"ms/step: {w['epoch_minutes_103M']:.1f} minutes per "
              "103M-token epoch",
              f"- peak memory {_fmt(w['peak_bytes'] / 2 ** 20)} MB "
              f"({w['peak_source']}); XLA plan "
              f"{_fmt(w['xla_bytes'] and w['xla_bytes'] / 2 ** 20)} MB",
              "- step time by part (device ops in a 3-step trace): " + (
                  ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                            sorted(share.items(), key=lambda kv: -kv[1]))
                  or w["profile"].get("error", "-")),
              f"- {w['pallas']}", ""]
  if "infer" in report:
    lines += ["## infer_bench (demo model)", "",
              "| batch | tok/s | token p50 ms | p90 | p99 | request p50 ms |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in report["infer"]["results"]:
      t, q = r["token_latency_ms"], r["request_latency_ms"]
      lines.append(f"| {r['batch_size']} | {r['tokens_per_s']:,.0f} | "
                   f"{t['p50']:.2f} | {t['p90']:.2f} | {t['p99']:.2f} | "
                   f"{q['p50']:.1f} |")
    lines.append("")
  if "precision" in report:
    p = report["precision"]
    lines += [f"## precision: demo corpus, {p['steps']} steps per dtype", "",
              "| dtype | final loss | max abs diff vs fp32 (after warm-up) |"
              " skipped after warm-up | loss scale |",
              "|---|---:|---:|---:|---:|"]
    for dtype, c in p["curves"].items():
      lines.append(f"| {dtype} | {_fmt(c['final_loss'], '.4f')} | "
                   f"{_fmt(c['max_abs_diff_vs_fp32'], '.4f')} | "
                   f"{_fmt(c['skipped_after_warmup'], 'd')} | "
                   f"{_fmt(c['loss_scale'], '.0f')} |")
    lines.append("")
  if "scaling" in report:
    s = report["scaling"]
    lines += [f"## data-parallel weak scaling (LM S={s['stripes']}, hidden "
              f"{s['hidden']}, batch {s['per_device_batch']} x "
              f"{s['seq_len']} per device)", "",
              "| devices | tok/s | ms/step | efficiency |",
              "|---:|---:|---:|---:|"]
    for r in s["rows"]:
      lines.append(f"| {r['devices']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['ms_per_step']:.1f} | {100 * r['efficiency']:.0f}% |")
    if s.get("note"):
      lines += ["", s["note"]]
    lines.append("")
  return "\n".join(lines)


def run(stages, out: str, dry: bool, wt103_seconds: float = 120.0,
        precision_steps: int = 300, bench_rows: bool = True) -> dict:
  """Runs the stages, merging into OUT/gpu-results.json; rewrites the .md."""
  os.makedirs(out, exist_ok=True)
  json_path = os.path.join(out, "gpu-results.json")
  report = {}
  if os.path.exists(json_path):
    with open(json_path) as f:
      report = json.load(f)
  if report.get("dry_run", dry) != dry:
    report = {}  # never mix dry-run figures with real ones
  report.update(machine=machine(), dry_run=dry)
  work = os.path.join(out, "gpu-report-work")
  for stage in stages:
    start = time.perf_counter()
    print(f"| stage {stage}", flush=True)
    if stage == "bench":
      report["bench"] = stage_bench(dry, out, bench_rows)
    elif stage == "wt103":
      report["wt103"] = stage_wt103(dry, wt103_seconds)
    elif stage == "infer":
      report["infer"] = stage_infer(dry, work)
    elif stage == "precision":
      report["precision"] = stage_precision(dry, work, precision_steps)
    elif stage == "scaling":
      report["scaling"] = stage_scaling(dry)
    print(f"| stage {stage}: {time.perf_counter() - start:.0f} s", flush=True)
    with open(json_path, "w") as f:  # after every stage: partial runs count
      json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "gpu-results.md"), "w") as f:
      f.write(render(report))
  return report


def main(argv):
  del argv
  stages = STAGES if _STAGE.value == "all" else (_STAGE.value,)
  run(stages, _OUT.value, _DRY_RUN.value, _WT103_SECONDS.value,
      _PRECISION_STEPS.value, _BENCH_ROWS.value)


if __name__ == "__main__":
  app.run(main)
