"""Every GPU figure in one command: docs/gpu-results.md and its JSON.

  python -m zebra_jax.tools.gpu_report --out=docs                  # every stage
  python -m zebra_jax.tools.gpu_report --stages=quick,bench --out=docs
  python -m zebra_jax.tools.gpu_report --dry_run --out=/tmp/r      # CPU, tiny

Every stage runs in its own process, under its own time budget
(STAGE_BUDGET_S, each under 10 minutes on one H100); a stage past its budget
is killed and the report says after how many rows. Stages write each row to
OUT/gpu-results.json as soon as it is measured (the whole file written, then
renamed over the old one) and rewrite OUT/gpu-results.md from it, so a killed
stage loses only the row it was measuring. Stages:
  quick      the machine (GPU, driver, jax/jaxlib, cuDNN of jax and torch),
             the best measured matmul beside the datasheet figure, and the
             core train step at S=1 and S=8 against cuDNN nn.LSTM: the first
             figures, on disk within minutes
  bench      the rest of zebra_jax.tools.bench --shape=gpu (core, LM, eval,
             word-level and generation rows against torch, bf16), group by
             group, then pallas rows (the fused stripe kernel,
             model.recurrence=pallas, beside the scan in bf16 and fp32; a
             shape the kernel does not fit is a scan_fallback_* row) and the
             memory rows
  wt103      the wt103 config's model (hidden 2048, S=8, the 267,735-word
             adaptive softmax, batch 128 x 128) trained on synthetic Zipf ids:
             tok/s, ms/step, memory, and the share of the step spent in the
             LSTM layers, the head and the optimizer from a jax.profiler trace
  precision  the demo corpus in float32, bfloat16 and float16 (dynamic loss
             scaling), a few hundred steps each: loss curves and skipped steps
  infer      infer_bench latency percentiles at batch 1..64 (the precision
             stage's float32 run, or a short demo run, is the checkpoint)
  scaling    data-parallel weak scaling over 1, 2, 4, ... GPUs of this machine

Child processes start with XLA_PYTHON_CLIENT_PREALLOCATE=false and the parent
never starts a JAX backend, so no process holds memory another one needs.

--dry_run: tiny shapes on whatever device there is, with smaller budgets (the
tests run it so that the script cannot rot). Its figures mean nothing.
"""

import os
import signal
import subprocess
import sys
import time

from absl import app, flags

from zebra_jax.benchmarks.gpu_results import Results, summary
from zebra_jax.benchmarks.gpu_stages import (DRY_BUDGET_S, REPO,
                                             STAGE_BUDGET_S, STAGES, run_stage)
from zebra_jax.benchmarks.shapes import NO_PREALLOCATE


def _flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_list("stages", "all", "Comma-separated stages to run "
                    f"({', '.join(STAGES)}), or all.")
  flags.DEFINE_alias("stage", "stages")
  flags.DEFINE_string("out", "docs", "Folder for gpu-results.md/.json.")
  flags.DEFINE_bool("dry_run", False, "Tiny shapes, seconds: checks that "
                    "every stage runs, measures nothing.")
  flags.DEFINE_float("wt103_seconds", 120.0,
                     "wt103: seconds of timed training.")
  flags.DEFINE_integer("precision_steps", 300, "precision: steps per dtype.")
  flags.DEFINE_bool("bench_rows", True, "bench: run the speed table's rows "
                    "too (else only pallas and memory).")
  flags.DEFINE_string("stage_child", None, "Internal: run this one stage in "
                      "this process.")


def _status(returncode, rows: int) -> str:
  if returncode == 0:
    return "done"
  if returncode is None:
    return f"stopped at its budget after {rows} rows"
  if returncode < 0:
    return (f"stopped by {signal.Signals(-returncode).name} after {rows} "
            "rows")
  return f"failed (exit {returncode}) after {rows} rows"


def drive(stages, out: str, dry: bool, budgets: dict | None = None,
          child_args=()) -> dict:
  """Runs each stage in a child process under its budget, the process
  group killed at the budget; records each stage's status; prints the
  summary. The parent never starts a JAX backend."""
  budgets = budgets or (DRY_BUDGET_S if dry else STAGE_BUDGET_S)
  results = Results(out)
  if results.data.get("dry_run", dry) != dry:
    results.data = {}  # never mix dry-run figures with real ones
  results.data["dry_run"] = dry
  env = {**os.environ, **NO_PREALLOCATE,
         "PYTHONPATH": os.pathsep.join(
             p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
  for stage in stages:
    results.data.pop(stage, None)
    results.data.setdefault("stages", {})[stage] = {
        "status": "running", "rows": 0, "budget_s": budgets[stage]}
    results.save()
    print(f"| stage {stage} (budget {budgets[stage]} s)", flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "zebra_jax.tools.gpu_report",
         f"--stage_child={stage}", f"--out={out}",
         "--dry_run" if dry else "--nodry_run", *child_args],
        env=env, start_new_session=True)
    try:
      returncode = child.wait(timeout=budgets[stage])
    except subprocess.TimeoutExpired:
      os.killpg(child.pid, signal.SIGKILL)  # its own processes too
      child.wait()
      returncode = None
    results = Results(out)
    status = results.data["stages"][stage]
    status.update(seconds=round(time.perf_counter() - start, 1),
                  status=_status(returncode, status["rows"]))
    results.save()
    print(f"| stage {stage}: {status['status']}, {status['seconds']} s",
          flush=True)
  print("\n".join(["", "GPU report summary"] + summary(results.data)))
  return results.data


def main(argv):
  del argv
  f = flags.FLAGS
  if f.stage_child:
    run_stage(f.stage_child, f.out, f.dry_run, f.wt103_seconds,
              f.precision_steps, f.bench_rows)
    return
  # Before anything could start a JAX backend here: children see the GPU
  # whole.
  for key, value in NO_PREALLOCATE.items():
    os.environ.setdefault(key, value)
  stages = STAGES if f.stages == ["all"] else tuple(f.stages)
  unknown = set(stages) - set(STAGES)
  if unknown:
    raise app.UsageError(f"unknown stages {sorted(unknown)}: choose from "
                         f"{', '.join(STAGES)}")
  report = drive(stages, f.out, f.dry_run, child_args=(
      f"--wt103_seconds={f.wt103_seconds}",
      f"--precision_steps={f.precision_steps}",
      "--bench_rows" if f.bench_rows else "--nobench_rows"))
  # Every stage's rows are on disk either way; the exit status tells a
  # script whether all of them finished.
  if any(report["stages"][s]["status"] != "done" for s in stages):
    sys.exit(1)


if __name__ == "__main__":
  _flags()
  app.run(main)
