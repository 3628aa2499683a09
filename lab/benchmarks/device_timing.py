"""Seconds per step on the device, rounds interleaved: CUDA events around a
torch row's round; for a JAX row, which has no CUDA events, the host wall
time of a round whose steps are dispatched back to back and waited for
once, with the jax.profiler trace's view of the same rounds beside it.

Host wall time of a loop that waits for every step moves with the host:
torch's bf16 S=1 row moved 1.9x between four calls on one kind of node.
A round here dispatches a row's steps back to back and waits once at its
end (steps with `dispatch` and `wait`, as `steps.Runner` and
`TorchTrainer` have), as a training loop keeps the device fed; its wall
time is then the device's plus one wait. On an H200 the torch rows' CUDA
events and wall times of such rounds agreed within 1%, while the
profiler's span from a JAX round's first kernel to its last ran up to
1.56x the untraced round's wall time (its hooks on every launch open gaps
between small kernels): so the profiler gives each JAX row its GPU busy
time (the union of its kernels' intervals, which the hooks do not
stretch) and span, never its figure. The traced pass covers the JAX rows
alone, so the profiler never slows a torch row.
"""

import tempfile

import jax
import numpy as np

from lab.benchmarks.timing import round_times
from zebra_jax.runtime import profiling

WALL, CUDA_EVENTS, BACK_TO_BACK = ("host wall", "CUDA events",
                                   "back-to-back wall")
_LABEL = "zebra_round"


def _round(step, calls: int) -> None:
  """calls steps dispatched back to back, waited for once."""
  dispatch = getattr(step, "dispatch", step)
  for _ in range(calls):
    dispatch()
  getattr(step, "wait", lambda: None)()


def _clock(step) -> str:
  """The device clock a step can be timed with."""
  kind = getattr(step, "timing", None)
  if kind == "torch" and getattr(step, "device", "") == "cuda":
    return CUDA_EVENTS
  if kind == "jax" and jax.default_backend() == "gpu":
    return BACK_TO_BACK
  return WALL


def _cuda_round(step, calls: int) -> float:
  """Seconds of one round between two CUDA events on torch's stream."""
  import torch  # pylint: disable=g-import-not-at-top
  start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
  start.record()
  _round(step, calls)
  end.record()
  end.synchronize()
  return start.elapsed_time(end) / 1e3


def _walls(steps: dict, calls: dict, rounds: int) -> tuple[dict, dict]:
  """(wall, CUDA events) seconds per round of every row, rows interleaved
  by `timing.round_times` (each row's round run once untimed first)."""
  events = {name: [] for name in steps if _clock(steps[name]) == CUDA_EVENTS}

  def one_round(name):
    step, n = steps[name], calls[name]
    if name in events:
      return lambda: events[name].append(_cuda_round(step, n))
    return lambda: _round(step, n)
  wall = round_times({name: one_round(name) for name in steps}, rounds)
  # round_times' untimed first round recorded events too: not a round
  return ({name: list(w) for name, w in wall.items()},
          {name: e[1:] for name, e in events.items()})


def device_spans(events: list[dict], labels: list[str]) -> dict:
  """{label: (span, busy) seconds of the kernels inside the host
  annotation named label}: span from the first kernel's start to the last
  one's end, busy the union of their intervals. Kernels are the complete
  events of a GPU device's stream lines (processes named /device:GPU:N,
  threads named Stream ...) of a perfetto trace. A label whose window
  holds no kernel is left out; no GPU process, {}."""
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") in ("process_name",
                                                "thread_name"):
      names[(e["name"], e.get("pid"), e.get("tid"))] = (
          e.get("args", {}).get("name", ""))
  gpus = {pid for (kind, pid, _), n in names.items()
          if kind == "process_name" and "GPU" in n}
  if not gpus:
    return {}
  streams = {(pid, tid) for (kind, pid, tid), n in names.items()
             if kind == "thread_name" and pid in gpus and "Stream" in n}
  kernels = sorted(
      (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
      if e.get("ph") == "X" and e.get("pid") in gpus
      and (not streams or (e.get("pid"), e.get("tid")) in streams))
  starts = np.asarray([k[0] for k in kernels])
  found = {}
  for e in events:
    if (e.get("ph") != "X" or e.get("name") not in labels
        or e.get("pid") in gpus):
      continue
    lo, hi = e["ts"], e["ts"] + e.get("dur", 0)
    inside = [k for k in kernels[np.searchsorted(starts, lo):
                                 np.searchsorted(starts, hi, "right")]
              if k[1] <= hi]
    if inside:
      found[e["name"]] = (
          (max(k[1] for k in inside) - inside[0][0]) / 1e6,
          _union(inside) / 1e6)
  return found


def _union(intervals) -> float:
  """Length of the union of (start, end) intervals sorted by start."""
  total, reach = 0.0, None
  for lo, hi in intervals:
    if reach is None or lo > reach:
      total += hi - lo
      reach = hi
    elif hi > reach:
      total += hi - reach
      reach = hi
  return total


def _traced(steps: dict, calls: dict, rounds: int) -> tuple[dict, str]:
  """({row: {"span": [seconds per round], "busy": [...]}}, why not) of the
  JAX rows from one profiler trace, rows interleaved; a row the trace
  shows no kernel for is left out and the reason says so."""
  label = lambda name, r: f"{_LABEL} {name} {r}"
  with tempfile.TemporaryDirectory(prefix="zebra_device_time_") as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
      for r in range(rounds):
        for name, step in steps.items():
          with jax.profiler.TraceAnnotation(label(name, r)):
            _round(step, calls[name])
    finally:
      jax.profiler.stop_trace()
    events = profiling.trace_events(trace_dir) or []
  spans = device_spans(events, [label(n, r) for n in steps
                                for r in range(rounds)])
  got = {name: {"span": [spans[label(name, r)][0] for r in range(rounds)],
                "busy": [spans[label(name, r)][1] for r in range(rounds)]}
         for name in steps
         if all(label(name, r) in spans for r in range(rounds))}
  if len(got) == len(steps):
    return got, ""
  processes = sorted({e.get("args", {}).get("name", "") for e in events
                      if e.get("name") == "process_name"})
  return got, (f"no kernels in the trace for {sorted(set(steps) - set(got))}"
               f" (its processes: {processes})")


def time_rows(steps: dict, calls: dict, rounds: int) -> dict:
  """{row: {"device_s": [seconds per step, one a round], "wall_s": [...],
  "timer": the clock device_s was read from, "note": what the trace could
  not tell, or "", and for a traced JAX row "span_s" and "busy_s"}}: every
  row's rounds interleaved, wall and CUDA events in one pass, then the
  JAX rows' trace in a second."""
  wall, events = _walls(steps, calls, rounds)
  jax_rows = {n: s for n, s in steps.items() if _clock(s) == BACK_TO_BACK}
  try:
    traced, why = _traced(jax_rows, calls, rounds) if jax_rows else ({}, "")
  except Exception as e:  # pylint: disable=broad-except
    # the profiler itself failed: the rows keep their figures, and say so
    traced, why = {}, (f"the profiler failed ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200] if str(e) else ''})")
  out = {}
  for name, step in steps.items():
    per = lambda secs: [s / calls[name] for s in secs]
    row = {"wall_s": per(wall[name]), "device_s": per(wall[name]),
           "timer": _clock(step), "note": ""}
    if name in events:
      row["device_s"] = per(events[name])
    if name in traced:
      row.update(span_s=per(traced[name]["span"]),
                 busy_s=per(traced[name]["busy"]))
    elif name in jax_rows:
      row["note"] = why
    out[name] = row
  return out


def stats(seconds: list[float]) -> dict:
  """The median and spread of per-step seconds over rounds."""
  return {"median_s": float(np.median(seconds)),
          "min_s": float(np.min(seconds)), "max_s": float(np.max(seconds)),
          "rounds": len(seconds)}
