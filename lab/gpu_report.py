"""Every GPU figure: docs/gpu-results.md and its JSON, in two commands.

  python -m lab.gpu_report --stages=smoke,quick,bench --out=OUT
  python -m lab.gpu_report --stages=wt103,precision,infer,scaling \
      --out=OUT
  python -m lab.gpu_report --dry_run --out=/tmp/r      # CPU, tiny

A GPU node runs one command at a time, under 10 minutes each: the stages
are split into two calls (gpu_results.CALLS, each under CALL_BUDGET_S with
its stages' budgets), each adding its sections to the same OUT/gpu-results.json.
Where OUT has no gpu-results.json yet, the run starts from --carry_from
(docs/gpu-results.json: the tree's copy of the previous call's file).

Every stage runs in its own process, under its own time budget
(STAGE_BUDGET_S); a stage past its budget is killed and the report says
after how many rows. Stages write each row to OUT/gpu-results.json as soon as
it is measured (the whole file written, then renamed over the old one) and
rewrite OUT/gpu-results.md from it, so a killed stage loses only the row it
was measuring. Before the stages, the installed versions of the project's
dependencies are checked against pyproject.toml's bounds (the report's
versions section; those outside are printed). Stages:
  smoke      tiny Pallas kernels compiled and run first: a 16 x 16 dot in
             float32 and bfloat16 and the stripe kernel's forward and
             backward against the scan; each records ok (its error, the
             precision of its tt.dots) or the first error line
  quick      the machine (GPU, driver, jax/jaxlib, cuDNN of jax and torch),
             the best measured matmul beside the datasheet figure, and the
             core train step at S=1 and S=8 against cuDNN nn.LSTM: the first
             figures, on disk within minutes
  bench      the rest of lab.bench --shape=gpu (core, LM, eval,
             word-level and generation rows against torch, bf16), group by
             group, then pallas rows (the fused stripe kernel,
             model.recurrence=pallas, beside the scan in bf16 and fp32; a
             shape the kernel does not fit is a scan_fallback_* row) and the
             memory rows; a pallas row that raises is an error row
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

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib

from absl import app, flags

from lab.benchmarks.gpu_results import (DRY_BUDGET_S, STAGE_BUDGET_S,
                                              STAGES, Results, summary)
from lab.benchmarks.shapes import NO_PREALLOCATE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b, "<": lambda a, b: a < b,
        "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def _flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_list("stages", "all", "Comma-separated stages to run "
                    f"({', '.join(STAGES)}), or all.")
  flags.DEFINE_alias("stage", "stages")
  flags.DEFINE_string("out", "docs", "Folder for gpu-results.md/.json.")
  flags.DEFINE_string("carry_from", os.path.join(REPO, "docs",
                                                 "gpu-results.json"),
                      "Where OUT has no gpu-results.json: the previous "
                      "call's file to start from ('' for none).")
  flags.DEFINE_bool("dry_run", False, "Tiny shapes, seconds: checks that "
                    "every stage runs, measures nothing.")
  flags.DEFINE_float("wt103_seconds", 30.0,
                     "wt103: seconds of timed training.")
  flags.DEFINE_integer("precision_steps", 300, "precision: steps per dtype.")
  flags.DEFINE_bool("bench_rows", True, "bench: run the speed table's rows "
                    "too (else only pallas and memory).")
  flags.DEFINE_string("stage_child", None, "Internal: run this one stage in "
                      "this process.")
  flags.DEFINE_string("work", None, "Internal: the folder of the precision "
                      "stage's runs, shared with infer.")


def _release(version: str) -> tuple:
  """'2.11.0+cu130' -> (2, 11, 0): the release numbers (pre-releases count
  as their release)."""
  match = re.match(r"\d+(\.\d+)*", version)
  return tuple(int(x) for x in match.group(0).split(".")) if match else ()


def satisfies(version: str, spec: str) -> bool:
  """Whether version meets every clause of a specifier like '>=1.0,<2'."""
  have = _release(version)
  for clause in filter(None, (c.strip() for c in spec.split(","))):
    op, want = re.match(r"(>=|<=|==|!=|>|<)\s*(\S+)", clause).groups()
    want = _release(want)
    width = max(len(have), len(want))
    if not _OPS[op](have + (0,) * (width - len(have)),
                    want + (0,) * (width - len(want))):
      return False
  return True


def check_versions(pyproject: str = os.path.join(REPO, "pyproject.toml")):
  """Each dependency of pyproject.toml (and the bench extra's torch) with
  its installed version and bounds: {installed, required, outside,
  missing}."""
  with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
  deps = project["dependencies"] + project["optional-dependencies"]["bench"]
  report = {"installed": {}, "required": {}, "outside": [], "missing": []}
  for dep in deps:
    dep = dep.split(";")[0].strip()
    name, spec = re.match(r"([A-Za-z0-9._-]+)(?:\[[^]]*\])?\s*(.*)",
                          dep).groups()
    try:
      version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      version = None
    report["installed"][name] = version
    report["required"][name] = spec
    if version is None:
      report["missing"].append(name)
    elif not satisfies(version, spec):
      report["outside"].append(f"{name} {version} (pyproject.toml: {spec})")
  for extra in ("jaxlib",):  # beside jax, not a dependency of its own
    try:
      report["installed"][extra] = importlib.metadata.version(extra)
    except importlib.metadata.PackageNotFoundError:
      report["installed"][extra] = None
  return report


def _carry(out: str, carry_from: str) -> None:
  """Copies the previous call's gpu-results.json into OUT when OUT has
  none: the node's OUT starts empty at every call."""
  target = os.path.join(out, "gpu-results.json")
  if (not carry_from or os.path.exists(target)
      or not os.path.exists(carry_from)
      or os.path.abspath(carry_from) == os.path.abspath(target)):
    print(f"| no previous results carried into {out}", flush=True)
    return
  with open(carry_from) as f:
    stages = list(json.load(f).get("stages", {}))
  os.makedirs(out, exist_ok=True)
  shutil.copyfile(carry_from, target)
  print(f"| carried {carry_from} into {out}: stages "
        f"{', '.join(stages) or 'none'}", flush=True)


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
          child_args=(), carry_from: str = "") -> dict:
  """Runs each stage in a child process under its budget, the process
  group killed at the budget; records each stage's status; prints the
  summary. Starts from carry_from's file where OUT has none. The parent
  never starts a JAX backend."""
  budgets = budgets or (DRY_BUDGET_S if dry else STAGE_BUDGET_S)
  _carry(out, carry_from)
  results = Results(out)
  if results.data.get("dry_run", dry) != dry:
    print("| previous results were "
          f"{'real' if dry else 'a dry run'}: not kept", flush=True)
    results.data = {}  # never mix dry-run figures with real ones
  results.data["dry_run"] = dry
  versions = check_versions()
  results.data["versions"] = versions
  results.save()
  print("| versions: " + ", ".join(f"{k} {v or 'missing'}" for k, v in
                                   versions["installed"].items()), flush=True)
  print("| outside pyproject.toml's bounds: "
        + ("; ".join(versions["outside"]) or "none"), flush=True)
  work = tempfile.mkdtemp(prefix="zebra_gpu_report_work_")
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
        [sys.executable, "-m", "lab.gpu_report",
         f"--stage_child={stage}", f"--out={out}",
         "--dry_run" if dry else "--nodry_run", f"--work={work}",
         *child_args],
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
  shutil.rmtree(work, ignore_errors=True)
  print("\n".join(["", "GPU report summary"] + summary(results.data)))
  return results.data


def main(argv):
  del argv
  f = flags.FLAGS
  if f.stage_child:
    from lab.benchmarks.gpu_stages import run_stage  # pylint: disable=g-import-not-at-top
    run_stage(f.stage_child, f.out, f.dry_run, f.wt103_seconds,
              f.precision_steps, f.bench_rows, f.work)
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
  report = drive(stages, f.out, f.dry_run, carry_from=f.carry_from,
                 child_args=(
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
