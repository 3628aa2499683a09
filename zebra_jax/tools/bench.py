"""Speed and memory benchmark: ZebraLSTM next to PyTorch nn.LSTM, one process.

  python -m zebra_jax.tools.bench                      # shape A, CPU or GPU (minutes)
  python -m zebra_jax.tools.bench --shape=gpu          # bf16, hidden 1024, batch 64
  python -m zebra_jax.tools.bench --quick --json=/tmp/bench.json   # tiny, seconds

Rows (tokens/s, ms/step, ratio to torch, GFLOP/s and fraction of the matmul
peak measured in this run, XLA's planned bytes per step):
  core_S{s}   stacked ZebraLSTMLayers + Adam, sum-of-squares loss on outputs
  core_S{s}_autodiff  the same with JAX's autodiff of the scan instead of the
              hand-written backward pass (recurrence.py)
  lm_S{s}     embedding -> layers -> tied head -> cross-entropy, + Adam
  eval_S{s}   the LM forward with carry (evaluate.eval_step)
  gen_S{s}_b{b}  sampling.generate: one token at a time in a jitted scan
  torch_*_{n}t  nn.LSTM (+ nn.Embedding and a tied head) of the same shape on
              n threads; ratios are against the faster thread count
Timed functions run interleaved, round after round, and each row reports its
median: the machine's noise (other jobs) hits every row alike, so on shared
CPUs compare ratios, not absolute times. Memory: one fresh process per window
(peak RSS on CPU, peak_bytes_in_use on GPU) and XLA's buffer plan.

FLOPs are counted analytically per token: input projection 2*in*4H, recurrence
2*H*4H/S, head 2*H*V; x3 for a train step (forward + two backward matmuls).
"""

import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from zebra_jax.inference import sampling
from zebra_jax.model import lm, metrics
from zebra_jax.runtime import profiling
from zebra_jax.training import evaluate

_QUICK = flags.DEFINE_bool("quick", False,
                           "Tiny shapes: a smoke test in seconds.")
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")
_SHAPE = flags.DEFINE_enum("shape", "A", ["A", "gpu"], "A: hidden 512, batch "
                           "32, fp32. gpu: hidden 1024, batch 64, bf16.")
_ROUNDS = flags.DEFINE_integer("rounds", 0, "Timing rounds (0 = default).")
_MEMORY = flags.DEFINE_bool("memory", True, "Run the memory-per-window rows.")
_TRACE = flags.DEFINE_string("trace_dir", None, "jax.profiler trace of one "
                             "step of every JAX row, for TensorBoard/xprof.")
_MEMORY_ROW = flags.DEFINE_string("memory_row", None, "Internal: one "
                                  "'seq_len,remat' row in a fresh process.")

SHAPES = {  # hidden = embed (tied head); vocab 8192 for the LM rows.
    "A": dict(hidden=512, layers=2, batch=32, seq_len=64, vocab=8192,
              dtype="float32", stripes=(1, 2, 4, 8), lm_stripes=(1, 8),
              gen_tokens=256, windows=(64, 256, 1024), budget_gb=8.0),
    "gpu": dict(hidden=1024, layers=2, batch=64, seq_len=64, vocab=8192,
                dtype="bfloat16", stripes=(1, 2, 4, 8), lm_stripes=(1, 8),
                gen_tokens=256, windows=(64, 256, 1024), budget_gb=40.0),
    "quick": dict(hidden=32, layers=2, batch=4, seq_len=8, vocab=64,
                  dtype="float32", stripes=(1, 4), lm_stripes=(1,),
                  gen_tokens=8, windows=(8, 16), budget_gb=1.0),
}


def model_config(shape: dict, stripes: int, **overrides):
  c = dict(vocab_size=shape["vocab"], embed_size=shape["hidden"],
           hidden_size=shape["hidden"], num_layers=shape["layers"],
           num_stripes=stripes, dropout_embed=0.0, dropout_hidden=0.0,
           dropout_output=0.0, tie_embeddings=True, dtype=shape["dtype"],
           unroll=1, remat=False)
  c.update(overrides)
  return ml_collections.ConfigDict(c)


def flops_per_token(shape: dict, stripes: int, head: bool) -> float:
  """Forward multiply-adds x2 per token: dense input projection, striped
  recurrence (1/S of a dense one), tied head. Embedding lookups are free."""
  h, v = shape["hidden"], shape["vocab"]
  per_layer = 2 * h * 4 * h + 2 * h * 4 * h / stripes
  return shape["layers"] * per_layer + (2 * h * v if head else 0.0)


# ------------------------------------------------------------- JAX steps


def _adam_step(loss_fn, tx):
  """(params, opt_state, *args) -> (params, opt_state, loss); donates state."""
  def step(params, opt_state, *args):
    loss, grads = jax.value_and_grad(loss_fn)(params, *args)
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1))


def _random_split(build):
  """(graphdef, params) of build(), params drawn uniformly in +-0.1.

  Speed does not depend on the values, and the real initializers (orthogonal
  blocks need a QR) take seconds to compile per shape.
  """
  graphdef, shapes = nnx.split(nnx.eval_shape(build))
  leaves, treedef = jax.tree.flatten(shapes)

  @jax.jit
  def draw(key):
    keys = jax.random.split(key, len(leaves))
    return [jax.random.uniform(k, x.shape, x.dtype, -0.1, 0.1)
            for k, x in zip(keys, leaves)]
  return graphdef, jax.tree.unflatten(treedef, draw(jax.random.key(0)))


def _create(cfg):
  return _random_split(lambda: lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))


class _Runner:
  """A compiled step and its live arguments; calling it runs one step.

  feedback maps output positions to the argument they replace next call (the
  donated train state, or the eval carry).
  """

  def __init__(self, jitted, args, feedback: dict[int, int]):
    self.compiled = jitted.lower(*args).compile()
    self.args, self.feedback = list(args), feedback

  def __call__(self):
    out = self.compiled(*self.args)
    for out_index, arg_index in self.feedback.items():
      self.args[arg_index] = out[out_index]
    jax.block_until_ready(out)


def core_runner(shape, stripes, *, seq_len=None, remat=False, custom_vjp=True):
  """Stacked ZebraLSTMLayers (no embedding/softmax) + Adam on random inputs.

  custom_vjp=False differentiates the scan with plain autodiff: the row that
  shows what the hand-written backward pass (recurrence.py) buys."""
  b, t, h = shape["batch"], seq_len or shape["seq_len"], shape["hidden"]
  dt = lm.compute_dtype(shape["dtype"])
  graphdef, params = _random_split(lambda: nnx.List([
      lm.ZebraLSTMLayer(h, h, stripes, rngs=nnx.Rngs(i), dtype=dt,
                           remat=remat, custom_vjp=custom_vjp)
      for i in range(shape["layers"])]))
  x = jax.random.normal(jax.random.key(0), (b, t, h), dt)
  zeros = jnp.zeros((b, h), jnp.float32)

  def loss_fn(params, x):
    y = x
    for i, layer in enumerate(nnx.merge(graphdef, params)):
      with jax.named_scope(f"zebra_lstm_{i}"):
        y, _ = layer(y, (zeros, zeros))
    return jnp.sum(jnp.square(y.astype(jnp.float32))) / y.size

  tx = optax.adam(1e-3)
  return _Runner(_adam_step(loss_fn, tx), (params, tx.init(params), x),
                 {0: 0, 1: 1})


def _tokens(shape, seq_len=None, seed=0):
  t = seq_len or shape["seq_len"]
  return jax.random.randint(jax.random.key(seed), (shape["batch"], t + 1), 0,
                            shape["vocab"])


def lm_runner(shape, stripes, *, seq_len=None, remat=False):
  """The full LM train step: embedding, layers, tied head, mean CE, Adam."""
  cfg = model_config(shape, stripes, remat=remat)
  graphdef, params = _create(cfg)
  carry = lm.init_carry(cfg, shape["batch"])
  tokens = _tokens(shape, seq_len)

  def loss_fn(params, tokens, carry):
    logits, _ = lm.apply(graphdef, params, tokens[:, :-1], carry)
    with jax.named_scope("loss"):
      sums = metrics.token_sums(logits, tokens[:, 1:])
    return sums["loss_sum"] / sums["count"]

  tx = optax.adam(1e-3)
  return _Runner(_adam_step(loss_fn, tx),
                 (params, tx.init(params), tokens, carry), {0: 0, 1: 1})


def eval_runner(shape, stripes):
  cfg = model_config(shape, stripes)
  graphdef, params = _create(cfg)
  tokens = _tokens(shape)
  step = jax.jit(functools.partial(evaluate.eval_step, graphdef=graphdef),
                 donate_argnums=1)
  return _Runner(step, (params, lm.init_carry(cfg, shape["batch"]),
                        tokens[:, :-1], tokens[:, 1:]), {0: 1})


def gen_runner(shape, stripes, batch):
  cfg = model_config(shape, stripes)
  graphdef, params = _create(cfg)
  step_fn = functools.partial(lm.decode_step, graphdef=graphdef)
  carry = lm.init_carry(cfg, batch)
  logits = jnp.zeros((batch, shape["vocab"]), jnp.float32)
  run = functools.partial(
      sampling.generate, step_fn, params, carry, logits, jax.random.key(0),
      num_new_tokens=shape["gen_tokens"], temperature=1.0)
  jax.block_until_ready(run())  # compiles
  return lambda: jax.block_until_ready(run())


# ----------------------------------------------------------- torch steps


def torch_runners(shape) -> tuple[dict, str | None]:
  """nn.LSTM rows of the same shape; ({}, note) when torch is missing.

  {group: {threads: fn}}: on CPU torch runs with 1 thread and with every
  core, because on small shared machines one thread is often faster (its
  OpenMP threads spin and lose more than XLA's pool to other load)."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}, "torch not installed (pip install torch): torch rows skipped"
  cuda = torch.cuda.is_available() and jax.devices()[0].platform == "gpu"
  device = "cuda" if cuda else "cpu"
  threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
      else os.cpu_count()
  torch.set_num_threads(threads)
  dtype = torch.bfloat16 if shape["dtype"] == "bfloat16" else torch.float32
  b, t, h, v = shape["batch"], shape["seq_len"], shape["hidden"], shape["vocab"]
  torch.manual_seed(0)
  lstm = torch.nn.LSTM(h, h, shape["layers"], batch_first=True)
  lstm = lstm.to(device, dtype)
  embed = torch.nn.Embedding(v, h).to(device, dtype)
  head_b = torch.nn.Parameter(torch.zeros(v, device=device, dtype=dtype))
  x = torch.randn(b, t, h, device=device, dtype=dtype)
  tokens = torch.randint(0, v, (b, t + 1), device=device)
  sync = torch.cuda.synchronize if cuda else (lambda: None)

  def logits():
    y, _ = lstm(embed(tokens[:, :-1]))
    return (y @ embed.weight.T + head_b).float()  # tied head

  core_opt = torch.optim.Adam(lstm.parameters(), 1e-3)
  lm_opt = torch.optim.Adam([*lstm.parameters(), *embed.parameters(), head_b],
                            1e-3)

  def core():
    core_opt.zero_grad(set_to_none=True)
    y, _ = lstm(x)
    y.float().square().mean().backward()
    core_opt.step()
    sync()

  def lm():
    lm_opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(logits().reshape(-1, v),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    lm_opt.step()
    sync()

  def ev():
    with torch.no_grad():
      torch.nn.functional.cross_entropy(logits().reshape(-1, v),
                                        tokens[:, 1:].reshape(-1),
                                        reduction="sum")
    sync()

  def with_threads(fn, n):
    def run():
      torch.set_num_threads(n)
      fn()
    return run

  fns = {}
  for group, fn in {"core": core, "lm": lm, "eval": ev}.items():
    fn()
    fns[group] = {threads: with_threads(fn, threads)
                  for threads in ([threads] if cuda else sorted({1, threads}))}
  where = "cuDNN" if cuda else f"CPU, 1 and {threads} threads, the faster kept"
  note = f"torch {torch.__version__} ({where})"
  return fns, note


# ---------------------------------------------------------------- timing


def time_interleaved(fns: dict, rounds: int, calls: int = 1) -> dict:
  """Median seconds per call of each function, rounds interleaved so that
  load from other processes spreads over every row alike."""
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      for _ in range(calls):
        fn()
      times[name].append((time.perf_counter() - start) / calls)
  return {name: float(np.median(t)) for name, t in times.items()}


def matmul_peak(n: int, rounds: int) -> float:
  """FLOP/s of an n x n x n matmul in the compute dtype: the practical peak."""
  a = jnp.ones((n, n), jnp.float32)
  mm = jax.jit(lambda a: a @ a)
  jax.block_until_ready(mm(a))
  sec = time_interleaved({"mm": lambda: jax.block_until_ready(mm(a))},
                         rounds)["mm"]
  return 2 * n ** 3 / sec


def _trace_rows(trace_dir, runners):
  """One profiled call of every JAX row, each under its own step name."""
  jax.profiler.start_trace(trace_dir)
  for i, (name, fn) in enumerate(runners.items()):
    with jax.profiler.StepTraceAnnotation(name, step_num=i):
      fn()
  jax.profiler.stop_trace()


def speed_rows(shape, rounds, trace_dir=None):
  """Builds every timed row, times them interleaved per group."""
  b, t = shape["batch"], shape["seq_len"]
  torch_fns, torch_note = torch_runners(shape)
  groups = {  # group -> {row: (runner, tokens per call, flops per token)}
      "core": {
          **{f"core_S{s}": (core_runner(shape, s), b * t,
                            3 * flops_per_token(shape, s, head=False))
             for s in shape["stripes"]},
          **{f"core_S{s}_autodiff": (core_runner(shape, s, custom_vjp=False),
                                     b * t,
                                     3 * flops_per_token(shape, s, head=False))
             for s in (shape["stripes"][0], shape["stripes"][-1])}},
      "lm": {f"lm_S{s}": (lm_runner(shape, s), b * t,
                          3 * flops_per_token(shape, s, head=True))
             for s in shape["lm_stripes"]},
      "eval": {f"eval_S{s}": (eval_runner(shape, s), b * t,
                              flops_per_token(shape, s, head=True))
               for s in shape["lm_stripes"]},
      "gen": {f"gen_S{s}_b{gb}": (gen_runner(shape, s, gb),
                                  gb * shape["gen_tokens"],
                                  flops_per_token(shape, s, head=True))
              for s in shape["lm_stripes"] for gb in (1, shape["batch"])},
  }
  if trace_dir:
    _trace_rows(trace_dir, {n: r[0] for g in groups.values()
                            for n, r in g.items()})
  peak = matmul_peak(256 if shape is SHAPES["quick"] else 2048, rounds)
  rows = []
  for group, entries in groups.items():
    fns = {n: r[0] for n, r in entries.items()}
    torch_name = f"torch_{group}"
    for threads, fn in torch_fns.get(group, {}).items():
      fns[f"{torch_name}_{threads}t"] = fn
    sec = time_interleaved(fns, rounds)
    torch_secs = {n: v for n, v in sec.items() if n.startswith(torch_name)}
    base = min(torch_secs.values()) if torch_secs else None
    for name, (runner, tokens, flops) in entries.items():
      rows.append(_row(name, group, sec[name], tokens, flops, peak, base,
                       getattr(runner, "compiled", None)))
    if base is not None:  # nn.LSTM is the S = 1 model
      torch_flops = {"core": 3 * flops_per_token(shape, 1, head=False),
                     "lm": 3 * flops_per_token(shape, 1, head=True),
                     "eval": flops_per_token(shape, 1, head=True)}[group]
      for name, torch_sec in torch_secs.items():
        rows.append(_row(name, group, torch_sec, b * t, torch_flops, peak,
                         base))
  return rows, peak, torch_note


def _row(name, group, sec, tokens, flops, peak, torch_sec, compiled=None):
  gflops = flops * tokens / sec / 1e9
  return {"name": name, "group": group, "tokens_per_s": tokens / sec,
          "ms_per_step": 1e3 * sec,
          "ratio_to_torch": None if torch_sec is None else torch_sec / sec,
          "gflops": gflops, "frac_of_peak": gflops * 1e9 / peak,
          "xla_bytes": profiling.compiled_bytes(compiled) if compiled else None}


# ---------------------------------------------------------------- memory


def _memory_row(shape, seq_len, remat):
  """One LM train step at S=1 for this window: planned and measured peak."""
  runner = lm_runner(shape, 1, seq_len=seq_len, remat=remat)
  runner()
  peak, source = profiling.peak_memory()
  return {"seq_len": seq_len, "remat": remat, "peak_bytes": peak,
          "peak_source": source,
          "xla_bytes": profiling.compiled_bytes(runner.compiled)}


def memory_rows(shape_name, fresh_processes: bool):
  """Peak memory per window, with and without remat; the largest window that
  fits shape['budget_gb'], extrapolated from XLA's plan (linear in window)."""
  shape, rows = SHAPES[shape_name], []
  for remat in (False, True):
    for seq_len in shape["windows"]:
      if fresh_processes:  # peaks only grow: one process per row
        out = subprocess.run(
            [sys.executable, "-m", "zebra_jax.tools.bench",
             f"--shape={shape_name}", f"--memory_row={seq_len},{int(remat)}"],
            capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
      else:
        rows.append(_memory_row(shape, seq_len, remat))
  budget = shape["budget_gb"] * 2 ** 30
  fits = {}
  for remat in (False, True):
    pts = [(r["seq_len"], r["xla_bytes"]) for r in rows
           if r["remat"] == remat and r["xla_bytes"]]
    if len(pts) >= 2:
      (t0, b0), (t1, b1) = pts[0], pts[-1]
      per_token = (b1 - b0) / (t1 - t0)
      fits[f"remat={remat}"] = int((budget - b0) / per_token + t0) \
          if per_token > 0 else None
  return rows, {"budget_gb": shape["budget_gb"], "max_seq_len": fits}


# ------------------------------------------------------------ reporting


def _mb(x):
  return "-" if x is None else f"{x / 2 ** 20:,.0f} MB"


def print_table(result) -> None:
  print(f"\n{result['device']} | shape {result['shape']} | matmul peak "
        f"{result['matmul_peak_gflops']:,.0f} GFLOP/s | {result['torch']}")
  print(f"{'row':<19}{'tok/s':>11}{'ms/step':>10}{'x torch':>9}"
        f"{'GFLOP/s':>9}{'% peak':>8}{'XLA plan':>11}")
  for r in result["rows"]:
    ratio = "-" if r["ratio_to_torch"] is None else f"{r['ratio_to_torch']:.2f}"
    print(f"{r['name']:<19}{r['tokens_per_s']:>11,.0f}{r['ms_per_step']:>10.1f}"
          f"{ratio:>9}{r['gflops']:>9.1f}{100 * r['frac_of_peak']:>7.0f}%"
          f"{_mb(r['xla_bytes']):>11}")
  if result.get("memory"):
    print(f"\nLM step S=1, batch {result['config']['batch']}: peak memory")
    print(f"{'window':>7}{'remat':>7}{'measured peak':>15}{'XLA plan':>11}")
    for m in result["memory"]:
      print(f"{m['seq_len']:>7}{str(m['remat']):>7}{_mb(m['peak_bytes']):>15}"
            f"{_mb(m['xla_bytes']):>11}   ({m['peak_source']})")
    fit = result["max_window"]
    print(f"largest window in {fit['budget_gb']} GB (XLA plan, linear fit): "
          f"{fit['max_seq_len']}")
  for note in result["notes"]:
    print(f"note: {note}")


def run(quick: bool = False, shape_name: str = "A", json_path=None,
        rounds: int = 0, memory: bool = True, trace_dir=None) -> dict:
  """Runs every row; prints the table; returns (and optionally writes) it."""
  shape = SHAPES["quick" if quick else shape_name]
  rounds = rounds or (3 if quick else 7)
  rows, peak, torch_note = speed_rows(shape, rounds, trace_dir)
  notes = [torch_note] if torch_note else []
  result = {"device": f"{jax.devices()[0].device_kind} x1 "
                      f"({os.cpu_count()} CPU cores visible)",
            "shape": "quick" if quick else shape_name,
            "config": {k: v for k, v in shape.items()},
            "matmul_peak_gflops": peak / 1e9, "torch": torch_note or "-",
            "rows": rows, "notes": notes}
  if memory:
    result["memory"], result["max_window"] = memory_rows(
        result["shape"], fresh_processes=not quick)
    if quick:
      notes.append("quick: memory rows share one process, so their peaks "
                   "are cumulative")
  print_table(result)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(result, f, indent=1)
  return result


def main(argv):
  del argv
  if _MEMORY_ROW.value:  # child process of memory_rows
    seq_len, remat = (int(v) for v in _MEMORY_ROW.value.split(","))
    print(json.dumps(_memory_row(SHAPES[_SHAPE.value], seq_len, bool(remat))))
    return
  run(_QUICK.value, _SHAPE.value, _JSON.value, _ROUNDS.value, _MEMORY.value,
      _TRACE.value)


if __name__ == "__main__":
  app.run(main)
