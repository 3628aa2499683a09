"""Where one zebra_jax train step's time goes: head, recurrence, projections,
optimizer, data and host.

The step is the loop's own (training.loop.compile_train_step) on the loop's
batches. Three measurements, one after the other:
  wall    `steps` loop iterations (batch, dispatch, step), synchronised at
          the end only, as the loop runs them: ms per step
  data    the batcher and the batch's transfer alone: ms per step
  device  a jax.profiler trace of `traced` steps, each synchronised: every
          op's time, given to a part of the model by its named scope (the
          compiled HLO's op_name) and kind (traces.op_kind)
Parts: recurrence = the layers' time loops (native custom calls, or the
scan's ops); projections = the layers' other matmuls (the input projection
and its gradients; XLA's dots, or the native bf16 matmul's calls); layers other = the layers' elementwise ops outside the
loops (dropout, stripe shuffles); head = logits, softmax, loss and their
gradients; embedding; optimizer = clipping and the update. A CPU runs
independent ops on several threads at once: each instant of the trace is
shared among the ops running then, so the parts add up to the time any op
ran. host = the traced step's span - that - data: dispatch, Python, the
gaps between ops. The parts are of a traced step, synchronised and slowed
by the profiler; `wall` is the loop's pace.
"""

import tempfile
import time

import jax
import numpy as np

from lab.benchmarks import traces
from zebra_jax.runtime import profiling

PARTS = ("head", "recurrence", "projections", "layers other", "embedding",
         "optimizer", "other ops", "data", "host")


def op_part(hlo_op: str, scope: str, matmul_calls=frozenset()) -> str | None:
  """The part an op's time belongs to; None for loop ops spanning others.
  matmul_calls: the custom calls that are matmuls, not time loops
  (`traces.bf16_matmul_calls`)."""
  kind = "matmul" if hlo_op in matmul_calls else traces.op_kind(hlo_op)
  if kind is None:
    return None
  category = traces.scope_category(scope)
  if category == "lstm_layers":
    if kind == "native time loops" or "while" in scope:
      return "recurrence"
    return "projections" if kind == "matmul" else "layers other"
  return {"head": "head", "embedding": "embedding",
          "optimizer": "optimizer"}.get(category, "other ops")


def device_parts(trace_dir: str, hlo_text: str, names: list[str]) -> dict:
  """{part: seconds} of the ops inside the `names` annotations, and the
  busy seconds (when any op ran). A CPU runs independent ops on several
  threads at once: each instant is shared equally among the ops running
  then, so the parts add up to the busy time, not to more."""
  events = profiling.trace_op_events(trace_dir) or []
  spans = traced_spans(trace_dir, names)
  scopes = traces.hlo_op_scopes(hlo_text)
  matmul_calls = traces.bf16_matmul_calls(hlo_text)
  intervals = []
  for e in events:
    op = e.get("args", {}).get("hlo_op")
    if not op or not any(a <= e["ts"] <= b for a, b in spans):
      continue
    part = op_part(op, scopes.get(op, ""), matmul_calls)
    if part:
      intervals.append((e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6,
                        part))
  return partition(intervals)


def partition(intervals) -> tuple[dict, float]:
  """[(start, end, part)] -> ({part: seconds}, busy seconds): each instant
  shared equally among the intervals covering it."""
  edges = sorted([(a, 1, p) for a, _, p in intervals] +
                 [(b, -1, p) for _, b, p in intervals],
                 key=lambda x: (x[0], -x[1]))
  seconds = dict.fromkeys(PARTS, 0.0)
  running = dict.fromkeys(PARTS, 0)
  busy, last = 0.0, None
  for t, change, part in edges:
    active = sum(running.values())
    if last is not None and active:
      busy += t - last
      for p, n in running.items():
        seconds[p] += (t - last) * n / active
    running[part] += change
    last = t
  return seconds, busy


def split_step(step_fn, state, next_batch, steps: int = 30,
               traced: int = 5, trace_dir: str | None = None) -> dict:
  """{part: ms per step} and the wall ms per step (see the module
  docstring). next_batch(i) -> the loop's batch i; state is consumed."""
  for i in range(3):  # compile, then settle
    state, sums = step_fn(state, next_batch(i))
  jax.block_until_ready(sums)
  start = time.perf_counter()
  for i in range(steps):
    state, sums = step_fn(state, next_batch(i))
  jax.block_until_ready(sums)
  wall = (time.perf_counter() - start) / steps
  start = time.perf_counter()
  for i in range(steps):
    jax.block_until_ready(next_batch(i))
  data = (time.perf_counter() - start) / steps
  hlo = step_fn.lower(state, next_batch(0)).compile().as_text()
  trace_dir = trace_dir or tempfile.mkdtemp(prefix="zebra_wlm_trace_")
  names = [f"wlm_step_{i}" for i in range(traced)]
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  for i, name in enumerate(names):
    with jax.profiler.TraceAnnotation(name):
      state, sums = step_fn(state, next_batch(i))
      jax.block_until_ready(sums)
  jax.profiler.stop_trace()
  seconds, busy = device_parts(trace_dir, hlo, names)
  span = sum(b - a for a, b in traced_spans(trace_dir, names)) / 1e6
  ms = {k: 1e3 * v / traced for k, v in seconds.items()}
  ms["data"] = 1e3 * data
  traced_ms = 1e3 * span / traced
  ms["host"] = max(0.0, traced_ms - 1e3 * busy / traced - ms["data"])
  return {"ms": ms, "traced_ms": traced_ms, "wall_ms": 1e3 * wall,
          "device_ms": 1e3 * busy / traced, "trace_dir": trace_dir}


def traced_spans(trace_dir: str, names: list[str]) -> list[tuple[int, int]]:
  """(start, end) in microseconds of each `names` annotation."""
  events = profiling.trace_op_events(trace_dir) or []
  return [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
          if e.get("name") in names]


def matmul_rate(m: int, k: int, n: int, seconds: float = 0.05) -> float:
  """FLOP/s of float32 [m, k] x [k, n] matmuls on this device, repeated
  inside one compiled loop (no dispatch between them), best of 5 rounds."""
  reps = max(1, int(seconds * 1e11 / (2.0 * m * k * n)))  # at ~100 GFLOP/s
  a = jax.numpy.full((m, k), 0.01, jax.numpy.float32)
  w = jax.numpy.full((k, n), 0.01, jax.numpy.float32)

  @jax.jit
  def loop(a, w):
    # `a` flips sign each time: a loop-invariant matmul would be hoisted.
    def body(_, carry):
      a, acc = carry
      return -a, acc + (a @ w)[0, 0]
    return jax.lax.fori_loop(0, reps, body, (a, 0.0))[1]

  jax.block_until_ready(loop(a, w))
  best = np.inf
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(loop(a, w))
    best = min(best, time.perf_counter() - start)
  return 2.0 * m * k * n * reps / best


def loop_step(cfg, workdir: str):
  """(step_fn, state, next_batch, vocab size): the train step and batches
  `training.loop.run` would build from cfg."""
  # pylint: disable=g-import-not-at-top
  import dataclasses
  from zebra_jax.data import pipeline
  from zebra_jax.model.config import ModelConfig
  from zebra_jax.runtime import parallel, rundir
  from zebra_jax.training import loop
  from zebra_jax.training.train_state import init_state
  vocab_size, _, splits = rundir.prepare(cfg, workdir)
  model = dataclasses.replace(ModelConfig.of(cfg.model), vocab_size=vocab_size)
  mesh = parallel.make_mesh(stripe_devices=1)
  graphdef, tx, state = init_state(cfg, mesh, model)
  batcher = pipeline.make_batcher(cfg.data, splits["train"], cfg.seed)
  step_fn = loop.compile_train_step(graphdef, tx, mesh, state)

  def next_batch(i: int) -> dict:
    index = i % batcher.batches_per_epoch
    return loop.make_batch(mesh, batcher, index)

  return step_fn, state, next_batch, vocab_size


def trace_row(cfg, name: str, steps: int = 30, traced: int = 5) -> dict:
  """The split of cfg's step, with the matmul FLOPs it runs and the rate
  this device's matmuls of the step's two shapes reach."""
  from lab.benchmarks import flops  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix="wlm_trace_") as workdir:
    step_fn, state, next_batch, vocab = loop_step(cfg, workdir)
    split = split_step(step_fn, state, next_batch, steps, traced)
  m, d = cfg.model, cfg.data
  shape = dict(hidden=m.hidden_size, layers=m.num_layers, vocab=vocab)
  tokens = d.batch_size * d.seq_len
  grouped = m.stripe_input == "grouped"
  h = m.hidden_size
  return {"name": name, **split, "vocab": vocab, "tokens": tokens,
          "time_steps": d.seq_len, "layers": m.num_layers,
          "step_flops": tokens * flops.step_flops(
              shape, m.num_stripes, grouped=grouped, head="full"),
          "head_flops": tokens * flops.head_step_flops(shape, "full"),
          "recurrent_flops": tokens * m.num_layers * 3 * 2.0 * h * 4 * h
                             / m.num_stripes,
          "head_rate": matmul_rate(tokens, h, vocab),
          "recurrent_rate": matmul_rate(d.batch_size, h // m.num_stripes,
                                        4 * h // m.num_stripes)}


def print_trace(row: dict) -> None:
  ms, traced = row["ms"], row["traced_ms"]
  print(f"\n{row['name']}: {row['wall_ms']:.1f} ms a step run as the loop "
        f"runs it ({1e3 * row['tokens'] / row['wall_ms']:,.0f} tok/s); "
        f"traced, each step synchronised: {traced:.1f} ms, ops busy "
        f"{row['device_ms']:.1f} ms")
  for part in PARTS:
    print(f"  {part:<13}{ms[part]:>8.2f} ms {100 * ms[part] / traced:>6.1f}%")
  head_floor = 1e3 * row["head_flops"] / row["head_rate"]
  rec_floor = 1e3 * row["recurrent_flops"] / row["recurrent_rate"]
  passes = row["time_steps"] * row["layers"] * 2  # forward and backward
  print(f"  matmul FLOPs a step {row['step_flops'] / 1e9:.2f} G; head "
        f"{row['head_flops'] / 1e9:.2f} G at {row['head_rate'] / 1e9:.0f} "
        f"GFLOP/s = {head_floor:.1f} ms (measured {ms['head']:.1f})")
  print(f"  recurrence: {1e3 * ms['recurrence'] / passes:.1f} us per time "
        f"step and layer (forward or backward), its matmuls "
        f"{1e3 * rec_floor / passes:.1f} us at the [batch, H/S] x [H/S, 4H/S] "
        f"rate {row['recurrent_rate'] / 1e9:.0f} GFLOP/s")
