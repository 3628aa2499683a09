"""device_timing: the device span of each round read from a perfetto
trace's GPU stream lines, CUDA events or host wall time otherwise."""

import jax
import jax.numpy as jnp

from lab.benchmarks import device_timing
from lab.benchmarks.steps import Runner


def _meta(kind, pid, name, tid=None):
  e = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
  if tid is not None:
    e["tid"] = tid
  return e


def _x(name, pid, tid, ts, dur):
  return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts,
          "dur": dur}


def _trace():
  """A host process (pid 9) with two round annotations, a GPU (pid 1)
  with a compute stream (tid 7), a copy stream (tid 8) and a derived
  "Steps" line (tid 2) whose events span whole host steps."""
  return [
      _meta("process_name", 9, "/host:CPU"),
      _meta("process_name", 1, "/device:GPU:0 (NVIDIA H200)"),
      _meta("thread_name", 1, "Stream #7(Compute)", tid=7),
      _meta("thread_name", 1, "Stream #8(MemcpyH2D)", tid=8),
      _meta("thread_name", 1, "Steps", tid=2),
      _x("zebra_round a 0", 9, 1, 1000, 500),
      _x("zebra_round b 0", 9, 1, 1600, 300),
      _x("steps", 1, 2, 900, 1200),        # a derived line: never a kernel
      _x("fusion", 1, 7, 1100, 100),       # round a: 1100 .. 1400
      _x("copy", 1, 8, 1250, 50),
      _x("dot", 1, 7, 1300, 100),
      _x("dot", 1, 7, 1700, 80),           # round b: 1700 .. 1780
      _x("late", 1, 7, 1890, 50),          # ends after b's window: not b's
  ]


def test_device_spans_read_the_streams_inside_each_annotation():
  spans = device_timing.device_spans(
      _trace(), ["zebra_round a 0", "zebra_round b 0", "zebra_round c 0"])
  # round a: its compute and copy kernels overlap (1250 .. 1300 inside
  # 1100 .. 1200? no: the copy fills 1250 .. 1300 between the two dots):
  # span 1100 .. 1400, busy 100 + 50 + 100
  assert spans == {"zebra_round a 0": (300e-6, 250e-6),
                   "zebra_round b 0": (80e-6, 80e-6)}


def test_a_trace_without_a_gpu_has_no_spans():
  host_only = [e for e in _trace() if e["pid"] == 9]
  assert device_timing.device_spans(host_only, ["zebra_round a 0"]) == {}


class _Step:
  """A step with dispatch and wait that counts what it was asked."""
  timing = "torch"
  device = "cpu"

  def __init__(self):
    self.dispatched, self.waits = 0, 0

  def dispatch(self):
    self.dispatched += 1

  def wait(self):
    self.waits += 1


def test_rounds_dispatch_back_to_back_and_wait_once():
  step = _Step()
  got = device_timing.time_rows({"s": step}, {"s": 4}, rounds=3)["s"]
  assert step.dispatched == 4 * (1 + 3) and step.waits == 1 + 3
  assert got["timer"] == device_timing.WALL and got["note"] == ""
  assert got["device_s"] == got["wall_s"] and len(got["wall_s"]) == 3
  stats = device_timing.stats(got["device_s"])
  assert stats["min_s"] <= stats["median_s"] <= stats["max_s"]
  assert stats["rounds"] == 3


def test_a_jax_row_off_a_gpu_keeps_the_host_clock():
  """Off a GPU a JAX row is never traced (no device lines to read): its
  rounds are host wall time, and the real profiler is not started."""
  x = jnp.ones((8, 8))
  runner = Runner(jax.jit(lambda a: (a @ a / 8.0,)), (x,), {0: 0})
  got = device_timing.time_rows({"r": runner}, {"r": 2}, rounds=2)["r"]
  assert got["timer"] == device_timing.WALL
  assert len(got["device_s"]) == 2 and min(got["device_s"]) > 0


def test_a_real_cpu_trace_has_no_device_span(monkeypatch):
  """The traced pass through the real profiler: on a CPU its trace holds
  the host annotations but no GPU process, and the row says why it keeps
  the host clock."""
  x = jnp.ones((8, 8))
  runner = Runner(jax.jit(lambda a: (a @ a / 8.0,)), (x,), {0: 0})
  monkeypatch.setattr(device_timing, "_clock",
                      lambda step: device_timing.BACK_TO_BACK)
  got = device_timing.time_rows({"r": runner}, {"r": 2}, rounds=2)["r"]
  assert got["device_s"] == got["wall_s"] and "busy_s" not in got
  assert got["note"].startswith("no kernels in the trace for ['r']")


def test_busy_time_is_the_union_of_overlapping_kernels():
  assert device_timing._union([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
  assert device_timing._union([]) == 0
