"""The native time loops on every build target this CPU runs, and sampling.

  python3 -m lab.native_bench [--quick] [--rounds=N] [--json=F]

Rows (median ms per call, all interleaved round after round in one process;
ratios the median of each round's ratio):
  train_{S}_{isa}  stacked ZebraLSTMLayers + Adam (lab/benchmarks/steps.py
              core_runner, model.recurrence=native) with the library built
              for one -march: native (this CPU; avx512f where it has it),
              x86-64-v3 (avx2) and x86-64 (sse2) on x86-64; x avx512 is its
              time over the AVX-512 build's (or this CPU's build's)
  train_{S}_scan   the same with the scan
  loops_{S}_{isa}  one layer's forward and backward time loops alone (the
              FFI calls, no XLA work around them) with each build: what
              the build's vector width changes, undiluted by the step's
              matmuls
  sample_{S}_b1_{native,scan}  one request of one row through the serving
              engine (steps.py gen_runner): one token per step of the
              recurrence (T = 1, B = 1), native against the scan
  split_S1_{rows,units}_{N}  one dense S=1 layer's forward and backward time
              loops (the FFI calls alone) cut into N parts as on an N-core
              machine, by batch rows or by hidden units (the parts then run
              on this CPU's cores): x rows is the units split's time over
              the rows split's, the work each way of splitting costs
  split_w200_{rows,units}_{N}  the same at hidden 200, batch 20, 35 steps
              (PyTorch's word_language_model LSTM) on this CPU's N cores;
              us/step: a forward and a backward step
S1: one dense stripe; S8g: 8 grouped stripes. On a shared CPU compare the
ratios, not the times.
"""

import functools
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from lab.benchmarks.shapes import SHAPES
from lab.benchmarks.steps import core_runner, gen_runner
from lab.benchmarks.table import print_rows, ratio_text
from lab.benchmarks.timing import round_times
from zebra_jax.cli import entry
from zebra_jax.model.recurrence import native as native_recurrence
from zebra_jax.model.recurrence import native_build

# -march targets, this CPU's first: what other CPUs of the architecture run.
TARGETS = {"x86_64": ("native", "x86-64-v3", "x86-64")}.get(
    platform.machine(), ("native",))
SETTINGS = {"S1": (1, False), "S8g": (8, True)}  # stripes, grouped


def _with_target(target: str, build):
  """build() with the library for -march=target (traced and compiled now,
  so the target's FFI calls are in the compiled program); its vector ISA."""
  before = os.environ.get(native_build.MARCH_ENV)
  os.environ[native_build.MARCH_ENV] = target
  try:
    why = native_recurrence.unavailable(jnp.float32)
    if why:
      return None, why
    return build(), native_recurrence.vector_isa()
  finally:
    if before is None:
      del os.environ[native_build.MARCH_ENV]
    else:
      os.environ[native_build.MARCH_ENV] = before


def _loops_runner(shape, stripes: int, parts: int | None = None,
                  units: bool = False):
  """One layer's native forward and backward time loops alone (the FFI
  calls, and the copy of the projected window they overwrite, as in the
  step) at S stripes of width hidden / S. parts: the work cut into that
  many parts, by hidden units or by batch rows (None: as the library
  splits it on this CPU)."""
  s, t, b = stripes, shape["seq_len"], shape["batch"]
  g = shape["hidden"] // s
  rng = np.random.default_rng(0)
  x_proj = jnp.asarray(0.1 * rng.standard_normal((s, t, b, 4 * g)),
                       jnp.float32)
  w_h = jnp.asarray(rng.standard_normal((s, g, 4 * g)) / np.sqrt(g),
                    jnp.float32)
  zeros = jnp.zeros((s, b, g), jnp.float32)

  def window(x_proj, w_h):
    ys, h, c, (cs, gates) = native_recurrence._forward(
        x_proj, zeros, zeros, w_h, "gates")
    dz, dh, dc = native_recurrence._backward(ys, gates, cs, zeros, w_h, h, c)
    return ys, dz, dh, dc

  saved = (native_recurrence.threads, native_recurrence.MIN_UNIT_SPLIT_FLOPS)
  if parts is not None:
    native_recurrence.threads = lambda flops: parts
    native_recurrence.MIN_UNIT_SPLIT_FLOPS = 0 if units else 1 << 62
  try:  # the split is fixed when the call is traced
    compiled = jax.jit(window).lower(x_proj, w_h).compile()
  finally:
    native_recurrence.threads, native_recurrence.MIN_UNIT_SPLIT_FLOPS = saved
  return lambda: jax.block_until_ready(compiled(x_proj, w_h))


# PyTorch's word_language_model example's default LSTM (hidden 200, batch
# 20, 35 steps): a width where a step's work is small next to what a call
# and a wait a step cost.
SMALL = {"hidden": 200, "batch": 20, "seq_len": 35}


def _split_rows(shape, rounds: int) -> list[dict]:
  """split_S1_* rows: each split's time, and units over rows; split_w200_*
  the same at SMALL on this machine's cores, with each step's time."""
  fns, steps = {}, {}
  for parts in (2, 8, 16):
    for how in ("rows", "units"):
      fns[f"split_S1_{how}_{parts}"] = _loops_runner(shape, 1, parts,
                                                     how == "units")
      steps[f"split_S1_{how}_{parts}"] = shape["seq_len"]
  cores = native_recurrence.threads(1 << 62)
  for how in ("rows", "units"):
    fns[f"split_w200_{how}_{cores}"] = _loops_runner(SMALL, 1, cores,
                                                     how == "units")
    steps[f"split_w200_{how}_{cores}"] = SMALL["seq_len"]
  times = round_times(fns, rounds)
  return [{"name": row, "ms": 1e3 * float(np.median(t)),
           "us_per_step": 1e6 * float(np.median(t)) / steps[row],
           "x_rows": float(np.median(
               t / times[row.replace("_units_", "_rows_")]))}
          for row, t in times.items()]


def run(quick: bool, rounds: int, json_path: str | None) -> list[dict]:
  shape = SHAPES["quick" if quick else "A"]
  rounds = rounds or (3 if quick else 7)
  fns, notes, isas = {}, [], {}
  for name, (stripes, grouped) in SETTINGS.items():
    for target in TARGETS:
      runner, isa = _with_target(target, functools.partial(
          core_runner, shape, stripes, grouped=grouped, kernel="native"))
      if runner is None:
        notes.append(f"-march={target}: {isa}")
        continue
      fns[f"train_{name}_{isa}"] = runner
      isas[f"train_{name}_{isa}"] = isa
      loops, _ = _with_target(target, functools.partial(
          _loops_runner, shape, stripes))
      fns[f"loops_{name}_{isa}"] = loops
      isas[f"loops_{name}_{isa}"] = isa
    fns[f"train_{name}_scan"] = core_runner(shape, stripes, grouped=grouped)
  for name, (stripes, grouped) in SETTINGS.items():
    for kernel in ("native", "scan"):
      fns[f"sample_{name}_b1_{kernel}"] = gen_runner(
          shape, stripes, 1, grouped, kernel=kernel)
  # Ratios are taken round by round: on a loaded machine a round's load hits
  # its rows alike.
  times = round_times(fns, rounds)
  seconds = {row: float(np.median(t)) for row, t in times.items()}
  ratio = lambda row, ref: float(np.median(times[row] / times[ref]))
  rows = []
  for row in times:
    kind, setting = row.split("_")[:2]
    if kind in ("train", "loops"):
      # Against the AVX-512 build, else this CPU's build (the first built).
      builds = [r for r in isas if r.startswith(f"{kind}_{setting}_")]
      reference = next((r for r in builds if isas[r] == "avx512f"),
                       builds[0] if builds else None)
      scan = f"train_{setting}_scan" if kind == "train" else None
    else:
      reference, scan = None, f"sample_{setting}_b1_scan"
    rows.append({"name": row, "ms": 1e3 * seconds[row],
                 "x_avx512": (ratio(row, reference) if reference
                              and row in isas else None),
                 "x_scan": ratio(row, scan) if scan else None})
  print(f"native time loops, shape {'quick' if quick else 'A'} "
        f"(hidden {shape['hidden']}, batch {shape['batch']}, "
        f"seq {shape['seq_len']}; sampling {shape['gen_tokens']} tokens), "
        f"{jax.devices()[0].device_kind}, {len(os.sched_getaffinity(0))} "
        f"cores, {rounds} interleaved rounds, load {os.getloadavg()[0]:.1f}")
  print_rows(rows, [
      ("row", 24, lambda r: r["name"]),
      ("ms/call", 10, lambda r: f"{r['ms']:.2f}"),
      ("x avx512", 10, lambda r: ratio_text(r["x_avx512"])),
      ("x scan", 8, lambda r: ratio_text(r["x_scan"]))])
  for note in notes:
    print(f"not built: {note}")
  split = _split_rows(shape, rounds) if not native_recurrence.unavailable(
      jnp.float32) else []
  if split:
    print("one dense S=1 layer's time loops, its work cut into N parts:")
    print_rows(split, [
        ("row", 24, lambda r: r["name"]),
        ("ms/call", 10, lambda r: f"{r['ms']:.2f}"),
        ("us/step", 9, lambda r: f"{r['us_per_step']:.1f}"),
        ("x rows", 8, lambda r: ratio_text(r["x_rows"]))])
  if json_path:
    with open(json_path, "w") as f:
      json.dump({"shape": "quick" if quick else "A", "rounds": rounds,
                 "rows": rows, "split": split, "not_built": notes}, f,
                indent=1, allow_nan=False)
  return rows + split


def main(argv):
  del argv
  f = flags.FLAGS
  run(f.quick, f.rounds, f.json)


if __name__ == "__main__":
  flags.DEFINE_bool("quick", False, "Tiny shapes: a smoke test in seconds.")
  flags.DEFINE_integer("rounds", 0, "Timing rounds (0 = default).")
  flags.DEFINE_string("json", None, "Also write the rows here.")
  entry.run_tool(main)
