"""Interleaved timing and the best measured matmul (the peak rows are
measured against), beside the datasheet's figure.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.model import lm

# settle(): a pause a row waits in, and the share of one core this process
# may use in it and count as idle.
SETTLE_QUANTUM_S, SETTLE_IDLE_SHARE, SETTLE_MAX_S = 0.005, 0.1, 1.0


def settle(max_s: float = SETTLE_MAX_S) -> float:
  """Waits until this process's threads are idle (at most max_s); returns
  the seconds waited.

  A library's worker threads may spin-wait after its call returns: torch's
  OpenMP threads (libgomp) burnt 7.5 ms of CPU in the 100 ms after a call
  on a 2-core CPU, and a JAX row timed right after one of torch's ran 1.09x
  slower (52.5 against 48.4 ms, the word-level adaptive head), its second
  core taken. No row is timed until the last one's threads have stopped."""
  start = time.perf_counter()
  while time.perf_counter() - start < max_s:
    cpu = time.process_time()
    time.sleep(SETTLE_QUANTUM_S)
    if time.process_time() - cpu < SETTLE_IDLE_SHARE * SETTLE_QUANTUM_S:
      break
  return time.perf_counter() - start


def round_times(fns: dict, rounds: int, calls: int = 1) -> dict:
  """Seconds per call of each function in each round ([rounds] arrays),
  rounds interleaved so that load from other processes spreads over every
  row alike. Each function runs once untimed first: a first call pays for
  allocation, autotuning and lazy initialisation (cuDNN plans, XLA's GPU
  autotuner). On a CPU each row starts once the last row's threads are
  idle (`settle`)."""
  for fn in fns.values():
    fn()
  on_cpu = jax.default_backend() == "cpu"
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      if on_cpu:
        settle()
      start = time.perf_counter()
      for _ in range(calls):
        fn()
      times[name].append((time.perf_counter() - start) / calls)
  return {name: np.asarray(t) for name, t in times.items()}


def time_interleaved(fns: dict, rounds: int, calls: int = 1) -> dict:
  """Median seconds per call of each function (round_times)."""
  return {name: float(np.median(t))
          for name, t in round_times(fns, rounds, calls).items()}


# Datasheet dense tensor-core FLOP/s by device kind (substrings of jax's
# device_kind, first match wins) and by the math a row's matmuls run in:
# bf16 (and fp16), tf32, and IEEE fp32 on the CUDA cores. The H200 has the
# H100 SXM's compute.
DATASHEET = (("H100 PCIe", "H100 PCIe",
              {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
             ("H100", "H100 SXM",
              {"bf16": 989e12, "tf32": 494.5e12, "fp32": 66.9e12}),
             ("H200", "H200",
              {"bf16": 989e12, "tf32": 494.5e12, "fp32": 66.9e12}),
             ("A100", "A100", {"bf16": 312e12, "tf32": 156e12,
                               "fp32": 19.5e12}))
DATASHEET_BF16 = tuple((key, peaks["bf16"], name)
                       for key, name, peaks in DATASHEET)
# FLOP/s no device of the platform reaches: sizes the peak's calls where the
# datasheet does not know the device.
_FLOPS_CEILING = {"gpu": 2.5e15, "cpu": 1e12}
PEAK_CALL_SECONDS = 0.01


def datasheet(device_kind: str, math: str = "bf16"
              ) -> tuple[float | None, str]:
  """(dense FLOP/s in `math`, device name) from DATASHEET; (None,
  "unknown") for a device it does not know."""
  for key, name, peaks in DATASHEET:
    if key in device_kind:
      return peaks[math], name
  return None, "unknown"


def peak_reps(flops_per_matmul: float, device_flops: float,
              seconds: float = PEAK_CALL_SECONDS) -> int:
  """Matmuls per timed call so that a call lasts at least `seconds` on a
  device doing `device_flops` (an upper bound: the datasheet), so that
  launch and dispatch costs vanish beside the work."""
  return max(1, int(np.ceil(seconds * device_flops / flops_per_matmul)))


def peak_shapes(shape: dict) -> dict:
  """Matmul shapes [batch, m, k, n] the peak is measured on: a large square
  one and the steps' own (input projection, recurrence, head, grouped)."""
  b, t, h, v = shape["batch"], shape["seq_len"], shape["hidden"], shape["vocab"]
  n = 256 if shape["hidden"] <= 64 else 2048
  shapes = {f"square {n}": (1, n, n, n),
            "input projection": (1, b * t, h, 4 * h),
            "recurrence S=1": (1, b, h, 4 * h),
            "head": (1, b * t, h, v)}
  for s in sorted({*shape["stripes"], *shape["grouped_stripes"]} - {1}):
    shapes[f"recurrence S={s}"] = (s, b, h // s, 4 * h // s)
  for s in shape["grouped_stripes"]:
    shapes[f"grouped projection S={s}"] = (s, b * t, h // s, 4 * h // s)
  return shapes


def device_flops() -> float:
  """FLOP/s no device of this kind exceeds: its datasheet's, else the
  platform's ceiling (`peak_reps` sizes calls with it)."""
  device = jax.devices()[0]
  return (datasheet(device.device_kind)[0]
          or _FLOPS_CEILING.get(device.platform, 2.5e15))


def shape_reps(shape: dict, flops_per_matmul: float) -> int:
  """`peak_reps` for this device; at most 4 for the quick shapes (a smoke
  test)."""
  reps = peak_reps(flops_per_matmul, device_flops())
  return min(reps, 4) if shape["hidden"] <= 64 else reps


def matmul_peak(shape: dict, rounds: int,
                torch_matmuls: dict | None = None) -> tuple[float, dict,
                                                             dict]:
  """(FLOP/s, {shape name: GFLOP/s}, torch's {shape name: GFLOP/s}): the
  best measured matmul of `peak_shapes`, each a batched matmul in the
  compute dtype with float32 accumulation (as the steps run them),
  repeated inside one compiled loop so that every timed call lasts at
  least PEAK_CALL_SECONDS even at the datasheet's rate (`peak_reps`).

  torch_matmuls: {shape name: (call, FLOPs a call)} of the same shapes
  (`torch_reference.torch_matmuls`), timed interleaved with XLA's: the peak
  is the best of both, so that a torch row faster than every XLA matmul
  does not read above 100%."""
  dt = lm.compute_dtype(shape["dtype"])
  fns, flops = {}, {}
  for name, (s, m, k, n) in peak_shapes(shape).items():
    reps = shape_reps(shape, 2.0 * s * m * k * n)
    a = jnp.full((s, m, k), 0.01, dt)
    w = jnp.full((s, k, n), 0.01, dt)

    @jax.jit
    def loop(a, w, reps=reps):
      # `a` changes sign every iteration: were it loop-invariant, XLA would
      # hoist the matmul out of the loop and time it once for `reps`.
      def body(_, carry):
        a, acc = carry
        return -a, acc + jnp.einsum("smk,skn->smn", a, w,
                                    preferred_element_type=jnp.float32)
      zeros = jnp.zeros((a.shape[0], a.shape[1], w.shape[2]), jnp.float32)
      return jax.lax.fori_loop(0, reps, body, (a, zeros))[1]
    fns[name] = functools.partial(
        lambda f, a, w: jax.block_until_ready(f(a, w)), loop, a, w)
    flops[name] = 2.0 * s * m * k * n * reps
  for name, (call, call_flops) in (torch_matmuls or {}).items():
    fns[f"torch {name}"], flops[f"torch {name}"] = call, call_flops
  sec = time_interleaved(fns, rounds)
  gflops = {name: flops[name] / sec[name] / 1e9 for name in fns}
  per_shape = {n: g for n, g in gflops.items() if not n.startswith("torch ")}
  torch_per_shape = {n[len("torch "):]: g for n, g in gflops.items()
                     if n.startswith("torch ")}
  return max(gflops.values()) * 1e9, per_shape, torch_per_shape
