"""The kernel stage's headline rows: a ZebraLSTM core train step (2 layers,
forward + backward + Adam) on the scan and on the fused Pallas kernel,
beside every LSTM a user could take instead, timed interleaved in one
process: jax.experimental.rnn's cuDNN LSTM, torch nn.LSTM (cuDNN), FlashRNN.

Groups, in order of value: (bf16, S=1), (bf16, S=8 grouped), (fp32, S=1),
(fp32, S=8 grouped); each group's rows are written as soon as it is timed,
a row that cannot be built or run at once as an error row with its reason
(one line), so a stage killed at any moment keeps every group before it.
FlashRNN's builds take minutes (its Triton build of one 1024-unit head
was still running after 200 s on an H100): the stage times their rows
last, after every other group, and only as far as its budget lets them: a
build still running at the stage's deadline is left behind and its row
says so, so the stage ends on time.

A step of 2-15 ms timed once per round varies by a third between calls of
one node; each row's round is as many steps as fill ROUND_S, calibrated
from one step after its build.
"""

import importlib.util
import threading
import time

import jax
import jax.numpy as jnp

from lab.benchmarks import cudnn_jax, cudnn_torch, flashrnn_rows
from lab.benchmarks.gpu_results import first_error_line
from lab.benchmarks.steps import core_runner
from lab.benchmarks.timing import time_interleaved
from zebra_jax.model import lm
from zebra_jax.model.recurrence import pallas as pallas_recurrence

OURS = ("zebra_scan", "zebra_pallas")
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
ROUND_S = 0.05     # each row's steps per round fill about this long
MAX_CALLS = 200    # steps per round at most (a step of microseconds)
_BUILDS = []       # build threads started by _ready_by


def group_stripes(shape) -> tuple[int, int]:
  """S = 1 and the widest S of the shape (8 on the GPU shape)."""
  return shape["stripes"][0], shape["stripes"][-1]


def candidates(shape, dtype: str, stripes: int) -> list[tuple]:
  """[(row name, build)] of one group: build() returns a step function
  (compiled, run once) or raises; a string instead of build is the reason
  the row cannot run."""
  grouped = stripes > 1
  sized = {**shape, "dtype": dtype}
  prec = SHORT[dtype]
  out = [("zebra_scan", lambda: core_runner(sized, stripes, grouped=grouped))]
  gpu = jax.devices()[0].platform == "gpu"
  block, why = pallas_recurrence.plan(
      shape["batch"], shape["hidden"] // stripes, lm.compute_dtype(dtype),
      triton=gpu)
  out.append(("zebra_pallas", (lambda: core_runner(
      sized, stripes, grouped=grouped, kernel="pallas")) if block else
              f"the kernel does not fit this shape: {why}"))
  # jax refuses bf16 for its cuDNN LSTM: the bf16 group asks anyway (its
  # row says why not) and times TF32 beside it; fp32 times both.
  jax_precisions = ("bf16", "tf32") if prec == "bf16" else ("fp32", "tf32")
  for p in jax_precisions:
    out.append((f"jax_cudnn_{p}", _jax_builder(sized, stripes, p)))
  torch_precisions = ("bf16",) if prec == "bf16" else ("fp32", "tf32")
  for p in torch_precisions:
    out.append((f"torch_cudnn_{p}", _torch_builder(sized, stripes, p)))
  out.append(("flashrnn_triton", flashrnn_builder(sized, stripes, prec,
                                                   "triton")))
  return out


def _jax_builder(shape, stripes, precision):
  dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
  return lambda: cudnn_jax.runner(shape, stripes, precision, dtype)


def _torch_builder(shape, stripes, precision):
  if importlib.util.find_spec("torch") is None:
    return "torch not installed (pip install torch)"
  return lambda: cudnn_torch.train_step(shape, stripes, precision)


def flashrnn_builder(shape, stripes, precision, backend):
  why = flashrnn_rows.missing()
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


def _repeated(step, calls: int):
  def run():
    for _ in range(calls):
      step()
  return run


def _time_rows(steps: dict, rounds: int) -> dict:
  """Seconds per step of each, rounds interleaved, each row's round
  `_calls` steps long."""
  calls = {name: _calls(step) for name, step in steps.items()}
  sec = time_interleaved({name: _repeated(step, calls[name])
                          for name, step in steps.items()}, rounds)
  return {name: s / calls[name] for name, s in sec.items()}


def _timed(steps: dict, rounds: int, errors: dict) -> dict:
  """Seconds per step of each, timed interleaved; if that raises (one step
  failing at a later call), each timed alone and a failing one added to
  errors."""
  try:
    return _time_rows(steps, rounds) if steps else {}
  except Exception:  # pylint: disable=broad-except
    sec = {}
    for name, step in steps.items():
      try:
        sec.update(_time_rows({name: step}, rounds))
      except Exception as e:  # pylint: disable=broad-except
        errors[name] = first_error_line(e)
    return sec


def time_group(shape, dtype, stripes, cands, rounds: int,
               deadline: float | None = None) -> list[dict]:
  """The group's rows: each candidate built (guarded; before deadline,
  time.time(), when given), the ones that run timed interleaved; error rows
  say why, in the candidates' order."""
  steps, errors = {}, {}
  for name, build in cands:
    print(f"| building {name}_S{stripes} ({dtype})", flush=True)
    start = time.perf_counter()
    step, why = _ready_by(build, deadline)
    print(f"| {name}_S{stripes} ({dtype}): "
          f"{why or f'ready in {time.perf_counter() - start:.1f} s'}",
          flush=True)
    if step is None:
      errors[name] = why
    else:
      steps[name] = (step, time.perf_counter() - start)
  start = time.perf_counter()
  sec = _timed({n: s for n, (s, _) in steps.items()}, rounds, errors)
  print(f"| timed {len(steps)} rows in {time.perf_counter() - start:.1f} s",
        flush=True)
  tokens = shape["batch"] * shape["seq_len"]
  rows = []
  for name, _ in cands:
    row = {"name": f"{name}_S{stripes}", "impl": name, "stripes": stripes,
           "grouped": stripes > 1, "dtype": dtype}
    if name in errors or name not in sec:
      row["error"] = errors.get(name, "not timed")
    else:
      row.update(tokens_per_s=tokens / sec[name], ms_per_step=1e3 * sec[name],
                 build_s=steps[name][1])
    rows.append(row)
  return rows


def ratios(rows: list[dict]) -> dict:
  """{our row: {baseline row: tok/s ratio}} within one dtype: every row
  of ours against every baseline (both S) that ran."""
  ok = [r for r in rows if "tokens_per_s" in r]
  ours = [r for r in ok if r["impl"] in OURS]
  base = [r for r in ok if r["impl"] not in OURS]
  return {r["name"]: {b["name"]: r["tokens_per_s"] / b["tokens_per_s"]
                      for b in base} for r in ours}
