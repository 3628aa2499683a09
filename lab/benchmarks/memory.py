"""Peak memory of the LM train step per window, with and without remat.

Peaks only grow within a process, so each row runs in a fresh one.
"""

import json
import os
import subprocess
import sys

from lab.benchmarks.shapes import NO_PREALLOCATE, SHAPES
from lab.benchmarks.steps import lm_runner
from zebra_jax.runtime import profiling

# What a row's fresh process runs: the row as one JSON line on stdout.
# The parent's malloc settings too (lab/bench.py sets them).
_CHILD = ("import json; from lab.benchmarks import memory, shapes; "
          "from zebra_jax.runtime import host_memory; "
          "host_memory.reuse_freed_host_memory(); "
          "print(json.dumps(memory.memory_row(shapes.SHAPES[{!r}], {}, {})))")

def memory_row(shape, seq_len, remat):
  """One LM train step at S=1 for this window: planned and measured peak."""
  runner = lm_runner(shape, 1, seq_len=seq_len, remat=remat)
  runner()
  peak, source = profiling.peak_memory()
  return {"seq_len": seq_len, "remat": remat, "peak_bytes": peak,
          "peak_source": source,
          "xla_bytes": profiling.compiled_bytes(runner.compiled)}


def memory_rows(shape_name, fresh_processes: bool):
  """Peak memory per window, with and without remat; the largest window that
  fits shape['budget_gb'], extrapolated from XLA's plan (linear in window)."""
  shape, rows = SHAPES[shape_name], []
  for remat in (False, True):
    for seq_len in shape["windows"]:
      if fresh_processes:  # peaks only grow: one process per row
        out = subprocess.run(
            [sys.executable, "-c", _CHILD.format(shape_name, seq_len,
                                                 remat)],
            capture_output=True, text=True, check=True,
            env={**os.environ, **NO_PREALLOCATE})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
      else:
        rows.append(memory_row(shape, seq_len, remat))
  budget = shape["budget_gb"] * 2 ** 30
  fits = {}
  for remat in (False, True):
    pts = [(r["seq_len"], r["xla_bytes"]) for r in rows
           if r["remat"] == remat and r["xla_bytes"]]
    if len(pts) >= 2:
      (t0, b0), (t1, b1) = pts[0], pts[-1]
      per_token = (b1 - b0) / (t1 - t0)
      fits[f"remat={remat}"] = int((budget - b0) / per_token + t0) \
          if per_token > 0 else None
  return rows, {"budget_gb": shape["budget_gb"], "max_seq_len": fits}
