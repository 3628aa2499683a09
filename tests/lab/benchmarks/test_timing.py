"""The matmul peak's calls: long enough at the datasheet's rate; rows
timed only on an idle process."""

import threading
import time

import pytest

from lab.benchmarks import timing
from lab.benchmarks.shapes import SHAPES


def test_peak_calls_last_10ms_at_the_datasheet_rate():
  h100, name = timing.datasheet("NVIDIA H100 80GB HBM3")
  assert (h100, name) == (989e12, "H100 SXM")
  assert timing.datasheet("NVIDIA H200")[0] == 989e12
  assert timing.datasheet("NVIDIA H100 PCIe") == (756e12, "H100 PCIe")
  assert timing.datasheet("cpu") == (None, "unknown")
  square = 2.0 * 2048 ** 3
  assert timing.peak_reps(square, h100) == 576  # ceil(0.01 * 989e12 / 17.2e9)
  # Every shape of the GPU bench, the tiny recurrent ones too: a timed call
  # is at least 10 ms of work even at the datasheet's rate.
  for s, m, k, n in timing.peak_shapes(SHAPES["gpu"]).values():
    flops = 2.0 * s * m * k * n
    reps = timing.peak_reps(flops, h100)
    assert 0.01 <= reps * flops / h100 < 0.01 + flops / h100
  assert timing.peak_reps(1e15, 1e12) == 1


def _spin_for(seconds: float, done: threading.Event) -> None:
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    pass
  done.set()


def test_settle_waits_until_no_thread_of_the_process_is_busy():
  done = threading.Event()
  spinner = threading.Thread(target=_spin_for, args=(0.2, done))
  spinner.start()
  waited = timing.settle()
  assert done.is_set() and 0.15 < waited < timing.SETTLE_MAX_S
  spinner.join()
  assert timing.settle() < 0.2  # idle: one pause or a few


def test_settle_outlasts_torchs_spinning_worker_threads():
  torch = pytest.importorskip("torch", reason="torch is not installed")
  torch.set_num_threads(2)
  a = torch.randn(1024, 1024)
  for _ in range(3):
    a @ a  # the OpenMP workers spin-wait after each call
  timing.settle()
  cpu = time.process_time()
  time.sleep(0.05)
  assert time.process_time() - cpu < 0.005
