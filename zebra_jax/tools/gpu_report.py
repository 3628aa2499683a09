"""Every GPU figure in one command: docs/gpu-results.md and its JSON.

  python -m zebra_jax.tools.gpu_report --out=docs                  # every stage
  python -m zebra_jax.tools.gpu_report --stages=quick,bench --out=docs
  python -m zebra_jax.tools.gpu_report --dry_run --out=/tmp/r      # CPU, tiny

Every stage runs in its own process, under its own time budget
(STAGE_BUDGET_S, each under 10 minutes on one H100); a stage past its budget
is killed and the report says after how many rows. Stages write each row to
OUT/gpu-results.json as soon as it is measured (the whole file written, then
renamed over the old one) and rewrite OUT/gpu-results.md from it, so a killed
stage loses only the row it was measuring. Stages:
  quick      the machine (GPU, driver, jax/jaxlib, cuDNN of jax and torch),
             the best measured matmul beside the datasheet figure, and the
             core train step at S=1 and S=8 against cuDNN nn.LSTM: the first
             figures, on disk within minutes
  bench      the rest of zebra_jax.tools.bench --shape=gpu (core, LM, eval,
             word-level and generation rows against torch, bf16), group by
             group, then pallas rows (the fused stripe kernel,
             model.recurrence=pallas, beside the scan in bf16 and fp32; a
             shape the kernel does not fit is a scan_fallback_* row) and the
             memory rows
  wt103      configs/wt103.py's model (hidden 2048, S=8, the 267,735-word
             adaptive softmax, batch 128 x 128) trained on synthetic Zipf ids:
             tok/s, ms/step, memory, and the share of the step spent in the
             LSTM layers, the head and the optimizer from a jax.profiler trace
  precision  the demo corpus in float32, bfloat16 and float16 (dynamic loss
             scaling), a few hundred steps each: loss curves and skipped steps
  infer      infer_bench latency percentiles at batch 1..64 (the precision
             stage's float32 run, or a short demo run, is the checkpoint)
  scaling    data-parallel weak scaling over 1, 2, 4, ... GPUs of this machine

Child processes start with XLA_PYTHON_CLIENT_PREALLOCATE=false and the parent
never starts a JAX backend, so no process holds memory another one needs.

--dry_run: tiny shapes on whatever device there is, with smaller budgets (the
tests run it so that the script cannot rot). Its figures mean nothing.
"""

import datetime
import json
import os
import re
import signal
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

STAGES = ("quick", "bench", "wt103", "precision", "infer", "scaling")
# Seconds each stage may run, its process's start included. On one H100 the
# stages fit; their sum stays under 30 minutes.
STAGE_BUDGET_S = {"quick": 170, "bench": 540, "wt103": 300, "precision": 300,
                  "infer": 240, "scaling": 150}
# --dry_run: four times or more each stage's seconds on a loaded 2-core CPU
# (quick 22, bench 74 with bench.py's rows and 15 without, wt103 11,
# precision 18, infer 10, scaling 10).
DRY_BUDGET_S = {"quick": 90, "bench": 300, "wt103": 60, "precision": 90,
                "infer": 60, "scaling": 60}

_STAGES = flags.DEFINE_list("stages", "all", "Comma-separated stages to run "
                            f"({', '.join(STAGES)}), or all.")
flags.DEFINE_alias("stage", "stages")
_OUT = flags.DEFINE_string("out", "docs", "Folder for gpu-results.md/.json.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Tiny shapes, seconds: checks "
                             "that every stage runs, measures nothing.")
_WT103_SECONDS = flags.DEFINE_float("wt103_seconds", 120.0,
                                    "wt103: seconds of timed training.")
_PRECISION_STEPS = flags.DEFINE_integer("precision_steps", 300,
                                        "precision: steps per dtype.")
_BENCH_ROWS = flags.DEFINE_bool("bench_rows", True, "bench: run bench.py's "
                                "rows too (else only pallas and memory).")
_STAGE_CHILD = flags.DEFINE_string("stage_child", None, "Internal: run this "
                                   "one stage in this process.")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


# ---------------------------------------------------------- the results


class Results:
  """OUT/gpu-results.json and the .md rendered from it, both rewritten
  after every change: written to a temporary file, then renamed over the
  old one, so a process killed at any moment leaves a whole file."""

  def __init__(self, out: str):
    self.out = out
    self.json_path = os.path.join(out, "gpu-results.json")
    self.md_path = os.path.join(out, "gpu-results.md")
    self.data = {}
    if os.path.exists(self.json_path):
      with open(self.json_path) as f:
        self.data = json.load(f)

  def save(self) -> None:
    os.makedirs(self.out, exist_ok=True)
    for path, text in ((self.json_path,
                        json.dumps(self.data, indent=1, default=str)),
                       (self.md_path, render(self.data))):
      tmp = f"{path}.tmp{os.getpid()}"
      with open(tmp, "w") as f:
        f.write(text)
      os.replace(tmp, path)

  def section(self, stage: str) -> dict:
    return self.data.setdefault(stage, {})

  def update(self, stage: str, values: dict, rows: int = 1) -> None:
    """Sets keys of the stage's section; counts `rows` measured rows."""
    self.section(stage).update(values)
    self._count(stage, rows)

  def append(self, stage: str, key: str, rows: list) -> None:
    """Adds rows to the list section[key]."""
    self.section(stage).setdefault(key, []).extend(rows)
    self._count(stage, len(rows))

  def _count(self, stage: str, rows: int) -> None:
    status = self.data.setdefault("stages", {}).setdefault(stage, {})
    status["rows"] = status.get("rows", 0) + rows
    self.save()


# ------------------------------------------------------------ the machine


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


def _shape(dry: bool) -> dict:
  return dict(bench.SHAPES["quick" if dry else "gpu"])


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
  peak, by_shape = bench.matmul_peak(shape, rounds)
  sheet, sheet_name = bench.datasheet(kind)
  results.update("quick", {"peak": {
      "device_kind": kind, "dtype": shape["dtype"],
      "best_measured_matmul_tflops": peak / 1e12,
      "by_shape_gflops": by_shape,
      "datasheet_bf16_tflops": sheet and sheet / 1e12,
      "datasheet": sheet_name,
      # dry: the quick shape's loops are capped (bench.matmul_peak)
      "seconds_per_call_at_least": None if dry else bench.PEAK_CALL_SECONDS}})
  torch_fns, note = bench.torch_runners(shape, groups=("core",))
  results.update("quick", {"torch": note}, rows=0)
  specs = bench.row_specs(shape)["core"]
  for name in quick_rows(shape):
    rows, _ = bench.time_group(shape, "core", {name: specs[name]}, torch_fns,
                               rounds, peak)
    results.append("quick", "rows", rows)


def _peak(results: Results, shape, dry: bool) -> float:
  """The quick stage's best measured matmul when it ran on this device and
  dtype, else one measured here."""
  peak = results.data.get("quick", {}).get("peak", {})
  if (peak.get("device_kind") == jax.devices()[0].device_kind
      and peak.get("dtype") == shape["dtype"]):
    return peak["best_measured_matmul_tflops"] * 1e12
  return bench.matmul_peak(shape, _rounds(dry))[0]


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
  return run, b * t


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
  fns, tokens = {}, 0
  for kernel in names:
    fns[kernel], tokens = _layers_step(shape, stripes, kernel)
  sec = bench.time_interleaved(fns, rounds)
  flops = bench.step_flops(shape, stripes, input_grad=False)
  return [{"name": names[k], "stripes": stripes, "width": g,
           "dtype": shape["dtype"], "tokens_per_s": tokens / sec[k],
           "ms_per_step": 1e3 * sec[k], "vs_scan": sec["scan"] / sec[k],
           "model_tflops": flops * tokens / sec[k] / 1e12,
           "kernel": labels[k],
           "batch_block": block if k == "pallas" else None}
          for k in names]


def stage_bench(results: Results, dry: bool, bench_rows: bool = True) -> None:
  """bench.py's groups (the quick stage's rows left out when it has them),
  then the pallas rows, then the memory rows: each written as it lands.
  bench_rows=False: pallas and memory only (bench.py's rows take minutes
  even at its quick shape; tests/tools/test_bench.py covers them)."""
  shape, rounds = _shape(dry), _rounds(dry)
  if bench_rows:
    peak = _peak(results, shape, dry)
    torch_fns, note = bench.torch_runners(shape)
    results.update("bench", {"torch": note,
                             "best_measured_matmul_tflops": peak / 1e12},
                   rows=0)
    done = {r["name"] for r in results.data.get("quick", {}).get("rows", [])}
    for group, specs in bench.row_specs(shape).items():
      specs = {n: spec for n, spec in specs.items() if n not in done}
      rows, _ = bench.time_group(shape, group, specs, torch_fns, rounds, peak)
      results.append("bench", "rows", rows)
  for dtype in (shape["dtype"],) if dry else ("bfloat16", "float32"):
    for s in shape["stripes"]:
      results.append("bench", "pallas",
                     pallas_rows({**shape, "dtype": dtype}, s, rounds))
  if not dry:
    memory, fit = bench.memory_rows("gpu", fresh_processes=True)
    results.update("bench", {"memory": memory, "max_window": fit},
                   rows=len(memory))


def _wt103_config(dry: bool):
  cfg = _config("wt103", "tiny" if dry else "")
  cfg.model.vocab_size = 64 if dry else 267_735
  return cfg


def stage_wt103(results: Results, dry: bool, seconds: float) -> None:
  """The recipe's model and batch on synthetic ids of its real vocabulary:
  the timed figures first, then the profile of a 3-step trace."""
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

  jax.block_until_ready(run(0))  # untimed: allocation, autotuning
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
  g = m.hidden_size // m.num_stripes
  block, why = pallas_recurrence.plan(
      d.batch_size, g, lm.compute_dtype(m.dtype),
      triton=jax.devices()[0].platform == "gpu")
  results.update("wt103", {
      "model": {k: m[k] for k in ("hidden_size", "num_layers", "num_stripes",
                                  "vocab_size", "head", "dtype")},
      "batch": d.batch_size, "seq_len": d.seq_len, "steps_timed": steps,
      "ms_per_step": 1e3 * sec, "tokens_per_s": tokens / sec,
      "epoch_minutes_103M": 103e6 / (tokens / sec) / 60,
      "peak_bytes": peak, "peak_source": source,
      "xla_bytes": profiling.compiled_bytes(compiled),
      "final_loss": float(loss),
      "pallas": ("fits: the fused kernel would run" if block else
                 f"model.recurrence=pallas runs the scan here: {why}")})
  trace_dir = tempfile.mkdtemp(prefix="zebra_wt103_trace_")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for i in range(3):
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        jax.block_until_ready(run(i))
  results.update("wt103", {"profile": summarise_trace(trace_dir,
                                                      compiled.as_text())})


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
  from zebra_jax.tools import infer_bench
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
    results.append("infer", "results", [infer_bench.bench_batch(
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
  cfg = bench.model_config(shape, shape["stripes"][-1])
  results.update("scaling", {
      "stripes": shape["stripes"][-1], "per_device_batch": shape["batch"],
      "seq_len": shape["seq_len"], "hidden": shape["hidden"],
      "note": None if len(devices) > 1 else (
          f"1 {devices[0].platform.upper()} device: weak scaling not "
          "measured")}, rows=0)
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
    sec = bench.time_interleaved({"step": run}, 2 if dry else 10)["step"]
    rows = results.section("scaling").get("rows", [])
    tok_s = b * shape["seq_len"] / sec
    base = rows[0]["tokens_per_s"] if rows else tok_s
    results.append("scaling", "rows", [{
        "devices": n, "global_batch": b, "tokens_per_s": tok_s,
        "ms_per_step": 1e3 * sec, "efficiency": tok_s / (n * base)}])


# ---------------------------------------------------------------- report


def _fmt(x, spec=",.0f"):
  return "-" if x is None else format(x, spec)


def _mib(x):
  return _fmt(x and x / 2 ** 20)


def summary(report: dict) -> list[str]:
  """At most about 25 lines: the machine, the peak, the headline rows and
  each stage's status."""
  mach = report.get("machine", {})
  gpus = mach.get("gpus") or []
  quick, bench_ = report.get("quick", {}), report.get("bench", {})
  lines = [
      f"- machine: {', '.join(g['name'] for g in gpus) or 'no GPU'}"
      f" (driver {gpus[0]['driver'] if gpus else '-'}); jax "
      f"{mach.get('jax', '-')}, jaxlib {mach.get('jaxlib', '-')}, cuDNN "
      f"{_fmt(mach.get('cudnn_jax'), 'd')} (jax) / "
      f"{_fmt(mach.get('cudnn_torch'), 'd')} (torch {mach.get('torch')})"]
  peak = quick.get("peak")
  if peak:
    sheet = peak["datasheet_bf16_tflops"]
    lines.append(f"- best measured matmul: "
                 f"{peak['best_measured_matmul_tflops']:,.1f} TFLOP/s "
                 f"({peak['dtype']}); datasheet dense bf16: " +
                 (f"{sheet:,.0f} TFLOP/s ({peak['datasheet']})" if sheet
                  else "unknown"))
  for r in quick.get("rows", []):
    if not r["name"].startswith("torch"):
      lines.append(f"- {r['name']}: {r['tokens_per_s']:,.0f} tok/s, "
                   f"{_fmt(r['ratio_to_torch'], '.2f')} x torch, "
                   f"{100 * r['frac_of_peak']:.0f}% of the best matmul")
  pallas = bench_.get("pallas", [])
  widest = max((r["stripes"] for r in pallas), default=None)
  for r in pallas:
    if r["stripes"] == widest and not r["name"].startswith("scan_core"):
      lines.append(f"- {r['name']} ({r['dtype']}): {r['vs_scan']:.2f} x scan,"
                   f" {r['kernel']}")
  w = report.get("wt103", {})
  if "tokens_per_s" in w:
    lines.append(f"- wt103 recipe: {w['tokens_per_s']:,.0f} tok/s, "
                 f"{w['epoch_minutes_103M']:.1f} min per 103M-token epoch")
  curves = report.get("precision", {}).get("curves", {})
  if curves:
    lines.append("- precision, max |loss - fp32| after warm-up: " + ", ".join(
        f"{d} {_fmt(c['max_abs_diff_vs_fp32'], '.3f')}"
        for d, c in curves.items()))
  infer = report.get("infer", {}).get("results", [])
  if infer:
    lines.append(f"- infer: batch 1 token p50 "
                 f"{infer[0]['token_latency_ms']['p50']:.2f} ms; batch "
                 f"{infer[-1]['batch_size']} {infer[-1]['tokens_per_s']:,.0f}"
                 " tok/s")
  scaling = report.get("scaling", {})
  if scaling.get("rows"):
    last = scaling["rows"][-1]
    lines.append(f"- scaling: {last['devices']} devices at "
                 f"{100 * last['efficiency']:.0f}% efficiency"
                 + (f" ({scaling['note']})" if scaling.get("note") else ""))
  for stage, st in report.get("stages", {}).items():
    lines.append(f"- stage {stage}: {st.get('status', '-')}, "
                 f"{st.get('rows', 0)} rows, {_fmt(st.get('seconds'))} s of "
                 f"{st.get('budget_s', '-')} s")
  return lines


def _bench_table(rows) -> list[str]:
  lines = ["| row | tok/s | ms/step | x torch | model TFLOP/s | % best matmul"
           " | XLA plan MB |", "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['ms_per_step']:.1f} | {_fmt(r['ratio_to_torch'], '.2f')}"
                 f" | {r['gflops'] / 1e3:.2f} | "
                 f"{100 * r['frac_of_peak']:.0f}% | {_mib(r['xla_bytes'])} |")
  return lines


def render(report: dict) -> str:
  """The markdown page, from whatever the JSON holds (a stage stopped
  midway shows the rows it finished)."""
  lines = ["# GPU results", "",
           "Measured by `python -m zebra_jax.tools.gpu_report` "
           "(`bash launch/gpu_report.sh`); the JSON beside this page holds "
           "every number.", ""]
  if report.get("dry_run"):
    lines += ["**DRY RUN: tiny shapes, figures mean nothing.**", ""]
  lines += ["## Summary", ""] + summary(report) + [""]
  quick, b = report.get("quick", {}), report.get("bench", {})
  if quick.get("peak"):
    p = quick["peak"]
    call = p["seconds_per_call_at_least"]
    lines += ["## Best measured matmul", "",
              f"{p['device_kind']}, {p['dtype']}"
              + (f", every timed call at least {1e3 * call:.0f} ms of work at"
                 " the datasheet's rate" if call else "")
              + "; GFLOP/s by shape: " + ", ".join(
                  f"{k} {v:,.0f}" for k, v in p["by_shape_gflops"].items()),
              "", "Model TFLOP/s below count the matmuls a step needs "
              "(recomputation not counted).", ""]
  if quick.get("rows"):
    lines += ["## Core train step against torch (first figures)", "",
              quick.get("torch", ""), ""] + _bench_table(quick["rows"]) + [""]
  if b.get("rows"):
    lines += ["## bench --shape=gpu", "", b.get("torch", ""), ""]
    lines += _bench_table(b["rows"]) + [""]
  for m in b.get("memory") or []:
    lines.append(f"- peak memory, LM S=1, window {m['seq_len']}, remat "
                 f"{m['remat']}: {_mib(m['peak_bytes'])} MB "
                 f"({m['peak_source']}); XLA plan {_mib(m['xla_bytes'])} MB")
  if b.get("pallas"):
    lines += ["", "### pallas: the fused stripe kernel vs the scan "
              "(core train step)", "",
              "| row | dtype | tok/s | ms/step | x scan | model TFLOP/s | "
              "kernel |", "|---|---|---:|---:|---:|---:|---|"]
    for r in b["pallas"]:
      lines.append(f"| {r['name']} | {r['dtype']} | "
                   f"{r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                   f"{r['vs_scan']:.2f} | {r['model_tflops']:.2f} | "
                   f"{r['kernel']} |")
    lines.append("")
  w = report.get("wt103", {})
  if "tokens_per_s" in w:
    profile = w.get("profile", {})
    share = profile.get("share", {})
    lines += ["## WikiText-103 recipe shapes (synthetic ids)", "",
              f"model {w['model']}, batch {w['batch']} x {w['seq_len']}, "
              f"{w['steps_timed']} timed steps", "",
              f"- {w['tokens_per_s']:,.0f} tok/s, {w['ms_per_step']:.1f} "
              f"ms/step: {w['epoch_minutes_103M']:.1f} minutes per "
              "103M-token epoch",
              f"- peak memory {_mib(w['peak_bytes'])} MB "
              f"({w['peak_source']}); XLA plan {_mib(w['xla_bytes'])} MB",
              "- step time by part (device ops in a 3-step trace): " + (
                  ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                            sorted(share.items(), key=lambda kv: -kv[1]))
                  or profile.get("error", "not traced")),
              f"- {w['pallas']}", ""]
  if report.get("infer", {}).get("results"):
    lines += ["## infer_bench (demo model)", "",
              "| batch | tok/s | token p50 ms | p90 | p99 | request p50 ms |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in report["infer"]["results"]:
      t, q = r["token_latency_ms"], r["request_latency_ms"]
      lines.append(f"| {r['batch_size']} | {r['tokens_per_s']:,.0f} | "
                   f"{t['p50']:.2f} | {t['p90']:.2f} | {t['p99']:.2f} | "
                   f"{q['p50']:.1f} |")
    lines.append("")
  p = report.get("precision", {})
  if p.get("curves"):
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
  s = report.get("scaling", {})
  if s.get("rows"):
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


# ---------------------------------------------------------------- driver


def run_stage(stage: str, out: str, dry: bool, wt103_seconds: float = 120.0,
              precision_steps: int = 300, bench_rows: bool = True) -> None:
  """One stage in this process (what a stage's child process runs)."""
  results = Results(out)
  results.data["machine"] = machine()
  results.save()
  work = os.path.join(out, "gpu-report-work")
  if stage == "quick":
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


def _status(returncode, rows: int) -> str:
  if returncode == 0:
    return "done"
  if returncode is None:
    return f"stopped at its budget after {rows} rows"
  if returncode < 0:
    return (f"stopped by {signal.Signals(-returncode).name} after {rows} "
            "rows")
  return f"failed (exit {returncode}) after {rows} rows"


def drive(stages, out: str, dry: bool, budgets: dict | None = None,
          child_args=()) -> dict:
  """Runs each stage in a child process under its budget, the process
  group killed at the budget; records each stage's status; prints the
  summary. The parent never starts a JAX backend."""
  budgets = budgets or (DRY_BUDGET_S if dry else STAGE_BUDGET_S)
  results = Results(out)
  if results.data.get("dry_run", dry) != dry:
    results.data = {}  # never mix dry-run figures with real ones
  results.data["dry_run"] = dry
  env = {**os.environ, **bench.NO_PREALLOCATE,
         "PYTHONPATH": os.pathsep.join(
             p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
  for stage in stages:
    results.data.pop(stage, None)
    results.data.setdefault("stages", {})[stage] = {
        "status": "running", "rows": 0, "budget_s": budgets[stage]}
    results.save()
    print(f"| stage {stage} (budget {budgets[stage]} s)", flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "zebra_jax.tools.gpu_report",
         f"--stage_child={stage}", f"--out={out}",
         "--dry_run" if dry else "--nodry_run", *child_args],
        env=env, start_new_session=True)
    try:
      returncode = child.wait(timeout=budgets[stage])
    except subprocess.TimeoutExpired:
      os.killpg(child.pid, signal.SIGKILL)  # its own processes too
      child.wait()
      returncode = None
    results = Results(out)
    status = results.data["stages"][stage]
    status.update(seconds=round(time.perf_counter() - start, 1),
                  status=_status(returncode, status["rows"]))
    results.save()
    print(f"| stage {stage}: {status['status']}, {status['seconds']} s",
          flush=True)
  print("\n".join(["", "GPU report summary"] + summary(results.data)))
  return results.data


def main(argv):
  del argv
  if _STAGE_CHILD.value:
    run_stage(_STAGE_CHILD.value, _OUT.value, _DRY_RUN.value,
              _WT103_SECONDS.value, _PRECISION_STEPS.value, _BENCH_ROWS.value)
    return
  # Before anything could start a JAX backend here: children see the GPU
  # whole.
  for key, value in bench.NO_PREALLOCATE.items():
    os.environ.setdefault(key, value)
  stages = STAGES if _STAGES.value == ["all"] else tuple(_STAGES.value)
  unknown = set(stages) - set(STAGES)
  if unknown:
    raise app.UsageError(f"unknown stages {sorted(unknown)}: choose from "
                         f"{', '.join(STAGES)}")
  drive(stages, _OUT.value, _DRY_RUN.value, child_args=(
      f"--wt103_seconds={_WT103_SECONDS.value}",
      f"--precision_steps={_PRECISION_STEPS.value}",
      "--bench_rows" if _BENCH_ROWS.value else "--nobench_rows"))


if __name__ == "__main__":
  app.run(main)
