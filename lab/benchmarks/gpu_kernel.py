"""The kernel stage's headline rows: a ZebraLSTM core train step (2 layers,
forward + backward + Adam) on the scan and on the fused Pallas kernel (at
S = 1 also the streaming per-step kernel, `model.recurrence=pallas_stream`,
which runs the widths the fused kernel leaves to the scan), beside every
LSTM a user could take instead, timed interleaved in one process:
jax.experimental.rnn's cuDNN LSTM, torch nn.LSTM (cuDNN), FlashRNN.

Baselines of a group of S stripes, by what they compute:
- same function: one dense cuDNN LSTM of width H (jax, torch). At S = 1 it
  is the model itself; at S > 1 it computes a superset (its recurrence is
  dense where the stripes' is block-diagonal), the LSTM a user would run
  at that width. The summary leads with these ratios.
- per-stripe loop (`..._loop`, S > 1): S separate cuDNN LSTMs of width H/S,
  one call each, what a user would write to get stripes out of cuDNN; its
  launches dominate at small widths, so its ratios flatter and are labelled.
- FlashRNN: its S heads are stripes (a peer with the same function).

Groups, in order of value: (bf16, S=1), (bf16, S=8 grouped), (fp32, S=1),
(fp32, S=8 grouped), then the wide group: the scan and the streaming
kernel alone at S = 1, bf16, at the shape's wide_hidden (the WikiText-103
recipe's 2048), where the fused kernel does not fit; each group's rows are
written as soon as it is timed,
a row that cannot be built or run at once as an error row with its reason
(one line), so a stage killed at any moment keeps every group before it.
FlashRNN's builds take minutes (its Triton build of one 1024-unit head
was still running after 200 s on an H100): the stage times their rows
last, after every other group, and only as far as its budget lets them: a
build still running at the stage's deadline is left behind and its row
says so, so the stage ends on time.

Each row is the median over rounds of its seconds per step on the device
(device_timing: CUDA events for torch, rounds dispatched back to back for
JAX, with the profiler's GPU busy time beside), with the spread, its host
wall time, its achieved TFLOP/s
(the matmuls of flops.step_flops) and that as a share of the chip's dense
peak for the math it runs in (bf16, TF32 or IEEE fp32). A round is as many
steps as fill ROUND_S, calibrated from one step after its build.
"""

import importlib.util
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from lab.benchmarks import (cudnn_jax, cudnn_torch, device_timing,
                            flashrnn_rows, mosaic_rows)
from lab.benchmarks.flops import step_flops
from lab.benchmarks.gpu_results import first_error_line
from lab.benchmarks.steps import core_runner
from lab.benchmarks.timing import datasheet
from zebra_jax.model import lm
from zebra_jax.model.recurrence import pallas as pallas_recurrence
from zebra_jax.model.recurrence import pallas_stream

OURS = ("zebra_scan", "zebra_pallas", "zebra_pallas_stream")
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
ROUND_S = 0.05     # each row's steps per round fill about this long
MAX_CALLS = 200    # steps per round at most (a step of microseconds)
_BUILDS = []       # build threads started by _ready_by


def group_stripes(shape) -> tuple[int, int]:
  """S = 1 and the widest S of the shape (8 on the GPU shape)."""
  return shape["stripes"][0], shape["stripes"][-1]


def candidates(shape, dtype: str, stripes: int) -> list[tuple]:
  """[(impl, build, row's stripes)] of one group: build() returns a step
  function (compiled, run once) or raises; a string instead of build is
  the reason the row cannot run. At S > 1 the dense baselines (row's
  stripes 1) run beside the per-stripe loops (`_loop`)."""
  grouped = stripes > 1
  sized = {**shape, "dtype": dtype}
  prec = SHORT[dtype]
  out = [("zebra_scan", lambda: core_runner(sized, stripes, grouped=grouped),
          stripes)]
  gpu = jax.devices()[0].platform == "gpu"
  block, why = pallas_recurrence.plan(
      shape["batch"], shape["hidden"] // stripes, lm.compute_dtype(dtype),
      triton=gpu)
  out.append(("zebra_pallas", (lambda: core_runner(
      sized, stripes, grouped=grouped, kernel="pallas")) if block else
              f"the kernel does not fit this shape: {why}", stripes))
  if not grouped:
    out.append(stream_candidate(sized))
  out += mosaic_rows.candidates(sized, stripes, grouped)
  # jax refuses bf16 for its cuDNN LSTM: the bf16 S=1 group asks anyway
  # (its row says why not) and times TF32 beside it; fp32 times both.
  jax_precisions = ("bf16", "tf32") if prec == "bf16" else ("fp32", "tf32")
  if grouped and prec == "bf16":
    jax_precisions = ("tf32",)
  torch_precisions = ("bf16",) if prec == "bf16" else ("fp32", "tf32")
  for width in ((1, stripes) if grouped else (1,)):
    loop = "_loop" if width > 1 else ""
    for p in jax_precisions:
      out.append((f"jax_cudnn_{p}{loop}", _jax_builder(sized, width, p),
                  width))
    for p in torch_precisions:
      out.append((f"torch_cudnn_{p}{loop}", _torch_builder(sized, width, p),
                  width))
  out.append(("flashrnn_triton", flashrnn_builder(sized, stripes, prec,
                                                   "triton"), stripes))
  return out


def stream_candidate(shape) -> tuple:
  """The streaming kernel's S = 1 row: (impl, build or why not, 1)."""
  launch = pallas_stream.launch_plan(
      shape["batch"], shape["hidden"], lm.compute_dtype(shape["dtype"]),
      triton=jax.devices()[0].platform == "gpu")
  build = ((lambda: core_runner(shape, 1, kernel="pallas_stream"))
           if launch.rows else
           f"the kernel does not fit this shape: {launch.why}")
  return ("zebra_pallas_stream", build, 1)


def wide_group(shape):
  """(shape at its wide_hidden, bf16; the group's label; its candidates:
  the scan and the streaming kernel at S = 1), or None for a shape
  without one."""
  if "wide_hidden" not in shape:
    return None
  wide = {**shape, "hidden": shape["wide_hidden"], "dtype": "bfloat16"}
  return (wide, f"1 at H={wide['hidden']}",
          [("zebra_scan", lambda: core_runner(wide, 1), 1),
           stream_candidate(wide)])


def math_of(impl: str, dtype: str) -> str:
  """The math a row's matmuls run in: bf16, tf32 or fp32 (IEEE). JAX's
  default precision runs our float32 dots in TF32 on a GPU."""
  for math in ("tf32", "fp32", "bf16"):
    if f"_{math}" in impl:
      return math
  if impl.startswith("flashrnn"):
    return SHORT[dtype]
  return "bf16" if dtype == "bfloat16" else "tf32"


def row_flops(shape, impl: str, stripes: int) -> float | None:
  """Matmul FLOPs of one train step of the row (what it computes: a dense
  LSTM of width H at S = 1, S blocks of width H/S otherwise); None for a
  shape that names only its batch (a whole LM step timed elsewhere)."""
  if "hidden" not in shape or "layers" not in shape:
    return None
  tokens = shape["batch"] * shape["seq_len"]
  return tokens * step_flops(shape, stripes, grouped=stripes > 1,
                             input_grad=False)


def _jax_builder(shape, stripes, precision):
  dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
  return lambda: cudnn_jax.runner(shape, stripes, precision, dtype)


def _torch_builder(shape, stripes, precision):
  if importlib.util.find_spec("torch") is None:
    return "torch not installed (pip install torch)"
  return lambda: cudnn_torch.train_step(shape, stripes, precision)


def flashrnn_builder(shape, stripes, precision, backend):
  why = (flashrnn_rows.unsupported(shape["hidden"], stripes, backend)
         or flashrnn_rows.missing())
  return why or (lambda: flashrnn_rows.train_step(shape, stripes, precision,
                                                  backend))


def _ready(build):
  """(step, None) built and run once, or (None, the reason it cannot)."""
  if isinstance(build, str):
    return None, build
  try:
    step = build()
    step()
    return step, None
  except Exception as e:  # pylint: disable=broad-except
    return None, first_error_line(e)


def _ready_by(build, deadline: float | None):
  """_ready, given until deadline (time.time()) when there is one: the
  build runs in a daemon thread, and one still running then is left behind
  ((None, why), the caller's process ends without waiting for it)."""
  if deadline is None or isinstance(build, str):
    return _ready(build)
  left = deadline - time.time()
  if left <= 0:
    return None, "not built: the stage's budget was spent"
  box = {}
  thread = threading.Thread(target=lambda: box.update(got=_ready(build)),
                            daemon=True)
  _BUILDS.append(thread)
  thread.start()
  thread.join(left)
  if thread.is_alive():
    return None, (f"still building after {left:.0f} s, what the stage's "
                  "budget had left")
  return box["got"]


def left_behind() -> bool:
  """Whether a build given up at its deadline is still running: then the
  process must end with os._exit, since CUDA and Triton code in that
  thread can hold the interpreter's exit."""
  return any(t.is_alive() for t in _BUILDS)


def _calls(step) -> int:
  """Steps per round so that a round of this step lasts about ROUND_S."""
  start = time.perf_counter()
  step()
  took = time.perf_counter() - start
  return max(1, min(MAX_CALLS, int(ROUND_S / max(took, 1e-9))))


def _time_rows(steps: dict, rounds: int) -> dict:
  """device_timing.time_rows of each, rounds interleaved, each row's
  round `_calls` steps long."""
  calls = {name: _calls(step) for name, step in steps.items()}
  return device_timing.time_rows(steps, calls, rounds)


def _timed(steps: dict, rounds: int, errors: dict) -> dict:
  """Each row's timings, timed interleaved; if that raises (one step
  failing at a later call), each timed alone and a failing one added to
  errors."""
  try:
    return _time_rows(steps, rounds) if steps else {}
  except Exception:  # pylint: disable=broad-except
    got = {}
    for name, step in steps.items():
      try:
        got.update(_time_rows({name: step}, rounds))
      except Exception as e:  # pylint: disable=broad-except
        errors[name] = first_error_line(e)
    return got


def _measured(shape, impl: str, dtype: str, stripes: int, timed: dict
              ) -> dict:
  """A row's figures from its timings: device median and spread, wall,
  tok/s, TFLOP/s and the share of the chip's peak in its math."""
  dev = device_timing.stats(timed["device_s"])
  sec = dev["median_s"]
  math = math_of(impl, dtype)
  peak, _ = datasheet(jax.devices()[0].device_kind, math)
  flops = row_flops(shape, impl, stripes)
  tflops = flops and flops / sec / 1e12
  row = {"tokens_per_s": shape["batch"] * shape["seq_len"] / sec,
         "ms_per_step": 1e3 * sec, "min_ms": 1e3 * dev["min_s"],
         "max_ms": 1e3 * dev["max_s"], "rounds": dev["rounds"],
         "wall_ms_per_step": 1e3 * float(np.median(timed["wall_s"])),
         "timer": timed["timer"], "tflops": tflops, "math": math,
         "peak_fraction": peak and tflops and tflops * 1e12 / peak}
  for key in ("span_s", "busy_s"):  # the profiler's view of a JAX row
    if key in timed:
      row[key.replace("_s", "_ms")] = 1e3 * float(np.median(timed[key]))
  if timed["note"]:
    row["timer_note"] = timed["note"]
  return row


def time_group(shape, dtype, stripes, cands, rounds: int,
               deadline: float | None = None,
               label: str | None = None) -> list[dict]:
  """The group's rows: each candidate built (guarded; before deadline,
  time.time(), when given), the ones that run timed interleaved; error rows
  say why, in the candidates' order. A candidate is (impl, build) or
  (impl, build, the row's own stripes). label: the group's name when it is
  not its stripes (another width: its row names end in _h<width>, and no
  other group's baselines count for it)."""
  cands = [(c[0], c[1], c[2] if len(c) > 2 else stripes) for c in cands]
  suffix = f"_h{shape['hidden']}" if label else ""
  steps, errors = {}, {}
  for impl, build, width in cands:
    name = f"{impl}_S{width}{suffix}"
    print(f"| building {name} (group S={stripes}, {dtype})", flush=True)
    start = time.perf_counter()
    step, why = _ready_by(build, deadline)
    print(f"| {name} ({dtype}): "
          f"{why or f'ready in {time.perf_counter() - start:.1f} s'}",
          flush=True)
    if step is None:
      errors[name] = why
    else:
      steps[name] = (step, time.perf_counter() - start)
  start = time.perf_counter()
  timed = _timed({n: s for n, (s, _) in steps.items()}, rounds, errors)
  print(f"| timed {len(steps)} rows in {time.perf_counter() - start:.1f} s",
        flush=True)
  rows = []
  for impl, _, width in cands:
    name = f"{impl}_S{width}{suffix}"
    row = {"name": name, "impl": impl, "stripes": width,
           "group": label or stripes, "grouped": width > 1, "dtype": dtype}
    if name in errors or name not in timed:
      row["error"] = errors.get(name, "not timed")
    else:
      row.update(_measured(shape, impl, dtype, width, timed[name]),
                 build_s=steps[name][1])
    rows.append(row)
  return rows


def ratios(rows: list[dict]) -> dict:
  """{our row: {baseline row: tok/s ratio}} within one dtype: every row of
  ours against every baseline of its group (timed in the same process,
  the dense rows interleaved with it) that ran."""
  ok = [r for r in rows if "tokens_per_s" in r]
  group = lambda r: r.get("group", r["stripes"])
  mine = OURS + (mosaic_rows.IMPL,)
  ours = [r for r in ok if r["impl"] in mine]
  base = [r for r in ok if r["impl"] not in mine]
  return {r["name"]: {b["name"]: r["tokens_per_s"] / b["tokens_per_s"]
                      for b in base if group(b) == group(r)} for r in ours}
