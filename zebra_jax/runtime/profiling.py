"""Profiling and memory helpers: a step-window tracer and peak-memory readers.

The train loop traces a window of steps with `StepProfiler`; the trace lands in
`workdir/profile/` and opens in TensorBoard's Profile tab or `xprof`. Steps are
named by `jax.profiler.StepTraceAnnotation`, and the ops inside them by the
`jax.named_scope`s of the model ("embedding", "zebra_lstm_{i}", "head") and of
the train step ("loss", "optimizer").

Peak memory: on GPUs the allocator's `peak_bytes_in_use`; on CPU the process's
peak resident set size. Both only ever grow within a process, so comparing two
configurations needs two processes (lab.benchmarks.memory does that).
XLA's own buffer plan for one compiled step (`compiled_bytes`) is exact per step and
needs no run, so it also answers "which window fits this budget".
"""

import glob
import gzip
import json
import os
import resource
import sys
from typing import Any, Callable

import jax


class StepProfiler:
  """Traces steps [start_step, start_step + num_steps) into workdir/profile.

  The first steps compile; start at step >= 2 or so to see steady state.
  num_steps <= 0 disables it. start_step counts from the step the run starts
  at when it resumes past it: resumed at step 500, start_step=10 traces steps
  510 onwards, again after the compiling steps (one log line says so). A
  resume exactly at start_step traces from there, as a fresh run would.

  Usage in a train loop (step = updates done before this one):
    profiler = StepProfiler(workdir, start_step, num_steps, first_step, log)
    profiler.before_step(step)
    state, sums = step_fn(state, batch)
    profiler.after_step(step, sums)
    ...
    profiler.close()
  """

  def __init__(self, workdir: str, start_step: int, num_steps: int,
               first_step: int = 0,
               log: Callable[[str], None] | None = None):
    self.logdir = os.path.join(workdir, "profile")
    self.enabled = num_steps > 0
    if self.enabled and start_step < first_step:
      if log is not None:
        log(f"profile: steps {start_step}-{start_step + num_steps - 1} came "
            f"before the resume at step {first_step}; tracing steps "
            f"{first_step + start_step}-"
            f"{first_step + start_step + num_steps - 1} instead")
      start_step += first_step
    self.start, self.stop = start_step, start_step + num_steps
    self.active = False

  def before_step(self, step: int) -> None:
    if self.enabled and not self.active and step == self.start:
      jax.profiler.start_trace(self.logdir)
      self.active = True

  def after_step(self, step: int, outputs: Any = None) -> None:
    """Stops after the last traced step; waits for its outputs first, since
    dispatch is asynchronous and the trace would otherwise miss its kernels."""
    if self.active and step + 1 >= self.stop:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active, self.enabled = False, False


def peak_memory() -> tuple[int, str]:
  """(bytes, source): device peak on accelerators, process peak RSS on CPU."""
  device = jax.devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device_peak_bytes_in_use"
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # ru_maxrss is KiB on Linux, bytes on macOS.
  scale = 1 if sys.platform == "darwin" else 1024
  return int(peak * scale), "process_peak_rss"


def compiled_bytes(compiled) -> int | None:
  """Bytes XLA plans for one call of a compiled function: arguments + outputs +
  temporaries, minus donated (aliased) buffers; None if the backend won't
  say."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # Not every backend implements it.
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes
             + m.temp_size_in_bytes - m.alias_size_in_bytes)


def trace_events(trace_dir: str) -> list[dict] | None:
  """Every event of the newest perfetto trace under trace_dir (jax.profiler
  with create_perfetto_trace=True), metadata included; None if there is
  none."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                           recursive=True))
  if not files:
    return None
  with gzip.open(files[-1], "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def trace_op_events(trace_dir: str) -> list[dict] | None:
  """The complete ("X") events of the newest perfetto trace under
  trace_dir; None if there is none."""
  events = trace_events(trace_dir)
  return None if events is None else [e for e in events
                                      if e.get("ph") == "X"]
