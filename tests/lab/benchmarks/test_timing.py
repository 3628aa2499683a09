"""The matmul peak's calls: long enough at the datasheet's rate."""

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
