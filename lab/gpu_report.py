"""Every GPU figure in one command: lab/notes/gpu-results.md and its JSON.

  python -m lab.gpu_report --out=OUT                 # every stage
  python -m lab.gpu_report --stages=wt103,infer --out=OUT   # a rerun
  python -m lab.gpu_report --dry_run --out=/tmp/r    # CPU, tiny shapes
  python -m lab.gpu_report --merge=RERUN/gpu-results.json --out=lab/notes

A GPU node is lent for 15 minutes: one command runs every stage, under
one budget (lab/benchmarks/gpu_budget.py: CALL_BUDGET_S, each stage's
STAGE_BUDGET_S), in order of value, each stage given what is left of the
call at most. Stages write each row to OUT/gpu-results.json as soon as it
is measured (the whole file written, then renamed over the old one) and
rewrite OUT/gpu-results.md from it, so a call killed at any second returns
every row measured before. A second call may rerun named stages: where OUT
has no gpu-results.json yet, the run starts from --carry_from
(lab/notes/gpu-results.json) and replaces only the stages it runs; --merge puts
a rerun's stages into a results file afterwards.

Every stage runs in its own process; a stage past its budget is killed and
the report says after how many rows. Before the stages, the installed
versions of the project's dependencies are checked against pyproject.toml's
bounds. Stages, in the order they run:
  smoke      which Pallas GPU backend this jax lowers the stripe kernel to
             (Triton or Mosaic GPU, from the lowered program's custom
             calls), then tiny Pallas kernels compiled and run: a 16 x 16
             dot in float32 and bfloat16 and the stripe kernel's forward
             and backward against the scan
  kernel     the headline rows: the core train step (hidden 1024, batch
             64, window 64, 2 layers; S=1 and grouped S=8; bf16 and fp32)
             on the scan and the fused Pallas kernel beside
             jax.experimental.rnn's cuDNN LSTM (fp32 and TF32; bf16 asked,
             refused by jax), torch nn.LSTM (cuDNN) and FlashRNN (heads = S;
             Triton, then CUDA last), S > 1 as S independent LSTMs of width
             H/S; tok/s and the ratio to every baseline; a row that cannot
             run says why in one line
  wt103      the recipe's model (113M parameters, the 267,735-word adaptive
             softmax, bf16) through the product's train step on synthetic
             Zipf ids: compile time, tok/s, peak device memory, the hours
             of the recipe's token budget on one GPU
  precision  the demo corpus in float32, bfloat16 and float16 (dynamic loss
             scaling): loss curves and skipped steps
  infer      the serving engine's generation tokens/s at 1, 16 and 64
             slots, every slot busy: the demo model, its one-slot token
             split between host and device, and the wt103 recipe's model
             with random weights
  scaling    data-parallel weak scaling over this machine's GPUs
  profile    a jax.profiler trace of three wt103 steps and XLA's dump of the
             step (XLA_FLAGS=--xla_dump_to), each packed into one archive
             in OUT, and the command that opens the trace in TensorBoard

Child processes start with XLA_PYTHON_CLIENT_PREALLOCATE=false and the parent
never starts a JAX backend, so no process holds memory another one needs.

--dry_run: tiny shapes on whatever device there is, with the dry budgets
(the tests and launch/gpu_rehearsal.sh run it). Its figures mean nothing.
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

from absl import flags

from lab.benchmarks import gpu_budget
from lab.benchmarks.gpu_budget import DRY_BUDGET_S, STAGE_BUDGET_S, STAGES
from lab.benchmarks.gpu_profile import dump_flags
from lab.benchmarks.gpu_results import Results, summary
from lab.benchmarks.shapes import NO_PREALLOCATE
from zebra_jax.cli import entry
from zebra_jax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b, "<": lambda a, b: a < b,
        "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def _flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_list("stages", "all", "Comma-separated stages to run "
                    f"({', '.join(STAGES)}), or all.")
  flags.DEFINE_alias("stage", "stages")
  flags.DEFINE_string("out", "lab/notes", "Folder for gpu-results.md/.json "
                      "and the profile's archives.")
  flags.DEFINE_string("carry_from", os.path.join(REPO, "lab", "notes",
                                                 "gpu-results.json"),
                      "Where OUT has no gpu-results.json: the previous "
                      "call's file to start from ('' for none).")
  flags.DEFINE_bool("dry_run", False, "Tiny shapes, seconds: checks that "
                    "every stage runs, measures nothing.")
  flags.DEFINE_float("call_started", None, "Unix time the call began (its "
                     "wrapper's start): the call's budget counts from "
                     "there; default now.")
  flags.DEFINE_float("call_budget", None, "Seconds the whole call may take "
                     "(default: gpu_budget's, or the dry budgets' sum with "
                     "--dry_run); stages get what is left at most.")
  flags.DEFINE_list("budgets", [], "STAGE=SECONDS,...: those stages' "
                    "budgets instead of gpu_budget's (a rerun of named "
                    "stages on a node with time to spare).")
  flags.DEFINE_float("wt103_seconds", 10.0,
                     "wt103: seconds of timed training.")
  flags.DEFINE_integer("precision_steps", 150, "precision: steps per dtype.")
  flags.DEFINE_bool("flashrnn_cuda", True, "kernel: FlashRNN's CUDA backend "
                    "rows too (compiled last, within the stage's budget).")
  flags.DEFINE_string("merge", None, "A rerun's gpu-results.json: its "
                      "stages replace theirs in OUT's file (no stage runs).")
  flags.DEFINE_string("stage_child", None, "Internal: run this one stage in "
                      "this process.")
  flags.DEFINE_string("work", None, "Internal: the folder of the precision "
                      "stage's runs, shared with infer.")
  flags.DEFINE_float("stage_deadline", None, "Internal: time.time() at which "
                     "the driver kills this stage.")


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


def stage_env(stage: str, work: str) -> dict:
  """A stage process's environment: this checkout first on PYTHONPATH, no
  preallocation; the profile stage with XLA's dump on."""
  env = {**os.environ, **NO_PREALLOCATE,
         "PYTHONPATH": os.pathsep.join(
             p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
  if stage == "profile":
    env["XLA_FLAGS"] = dump_flags(work, os.environ.get("XLA_FLAGS", ""))
  return env


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass  # every process of the group had ended


def drive(stages, out: str, dry: bool, budgets: dict | None = None,
          child_args=(), carry_from: str = "", deadline: float | None = None
          ) -> dict:
  """Runs each stage in a child process under its budget, or what is left
  before `deadline` (time.time()) if less, the process group killed at it;
  records each stage's status; prints the summary. Starts from
  carry_from's file where OUT has none. The parent never starts a JAX
  backend."""
  budgets = budgets or (DRY_BUDGET_S if dry else STAGE_BUDGET_S)
  _carry(out, carry_from)
  results = Results(out)
  if results.data.get("dry_run", dry) != dry:
    print("| previous results were "
          f"{'real' if dry else 'a dry run'}: not kept", flush=True)
    results.data = {}  # never mix dry-run figures with real ones
  results.data["dry_run"] = dry
  results.data["ran"] = list(stages)  # what --merge takes from this file
  versions = check_versions()
  results.data["versions"] = versions
  results.save()
  print("| versions: " + ", ".join(f"{k} {v or 'missing'}" for k, v in
                                   versions["installed"].items()), flush=True)
  print("| outside pyproject.toml's bounds: "
        + ("; ".join(versions["outside"]) or "none"), flush=True)
  work = tempfile.mkdtemp(prefix="zebra_gpu_report_work_")
  for stage in stages:
    budget = budgets[stage]
    if deadline is not None:
      budget = min(budget, deadline - time.time())
    results.data.pop(stage, None)
    results.data.setdefault("stages", {})[stage] = {
        "status": "running", "rows": 0, "budget_s": round(budget, 1)}
    if budget <= 0:
      results.data["stages"][stage]["status"] = (
          "not run: the call's budget is spent")
      results.save()
      print(f"| stage {stage}: not run, the call's budget is spent",
            flush=True)
      continue
    results.save()
    print(f"| stage {stage} (budget {budget:.0f} s)", flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "lab.gpu_report",
         f"--stage_child={stage}", f"--out={out}",
         "--dry_run" if dry else "--nodry_run", f"--work={work}",
         f"--stage_deadline={time.time() + budget:.1f}", *child_args],
        env=stage_env(stage, work), start_new_session=True)
    try:
      returncode = child.wait(timeout=budget)
    except subprocess.TimeoutExpired:
      returncode = None
    # Its own processes too, also those it left running when it ended (a
    # compiler a build started): they would hold the call's output open.
    _kill_group(child.pid)
    child.wait()
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


def merge(out: str, rerun_path: str) -> dict:
  """The stages of a rerun's results file (their sections and statuses)
  put into OUT's, which keeps every other stage; both files' pages
  rewritten. A rerun's machine section wins: it ran last."""
  try:
    with open(rerun_path) as f:
      rerun = json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f"--merge={rerun_path}: cannot read it ({e})") from e
  results = Results(out)
  if results.data.get("dry_run", False) != rerun.get("dry_run", False):
    raise UserError(f"--merge={rerun_path}: one file is a dry run, the "
                    "other is not")
  # A rerun's file also holds the stages it carried from the last call:
  # only those it ran replace OUT's.
  ran = rerun.get("ran", list(rerun.get("stages", {})))
  for stage in ran:
    results.data[stage] = rerun.get(stage, {})
    results.data.setdefault("stages", {})[stage] = rerun["stages"][stage]
  for key in ("machine", "versions", "dry_run"):
    if key in rerun:
      results.data[key] = rerun[key]
  results.save()
  print(f"| merged {', '.join(ran) or 'no stage'} "
        f"from {rerun_path} into {results.json_path}", flush=True)
  return results.data


def parse_stages(names) -> tuple:
  """The stages named (in running order), or every stage for 'all'."""
  if list(names) == ["all"]:
    return STAGES
  unknown = sorted(set(names) - set(STAGES))
  if unknown:
    raise UserError(f"unknown stages {unknown}: choose from "
                    f"{', '.join(STAGES)}")
  return tuple(s for s in STAGES if s in names)


def parse_budgets(items, dry: bool) -> dict:
  """The stage budgets, those named as STAGE=SECONDS replaced."""
  budgets = dict(DRY_BUDGET_S if dry else STAGE_BUDGET_S)
  for item in items:
    stage, _, seconds = item.partition("=")
    try:
      value = float(seconds)
    except ValueError:
      value = 0.0
    if stage not in budgets or value <= 0:
      raise UserError(f"--budgets: {item!r} is not STAGE=SECONDS with a "
                      f"stage of {', '.join(STAGES)} and seconds > 0")
    budgets[stage] = value
  return budgets


def main(argv):
  del argv
  f = flags.FLAGS
  if f.stage_child:
    from lab.benchmarks.gpu_stages import run_stage  # pylint: disable=g-import-not-at-top
    run_stage(f.stage_child, f.out, f.dry_run, f.wt103_seconds,
              f.precision_steps, f.flashrnn_cuda, f.work, f.stage_deadline)
    return
  # Before anything could start a JAX backend here: children see the GPU
  # whole.
  for key, value in NO_PREALLOCATE.items():
    os.environ.setdefault(key, value)
  if f.merge:
    merge(f.out, f.merge)
    return
  stages = parse_stages(f.stages)
  budget = f.call_budget or (
      gpu_budget.call_seconds(DRY_BUDGET_S) if f.dry_run
      else gpu_budget.CALL_BUDGET_S)
  started = f.call_started or time.time()
  # A few seconds before the call's end: the summary and the exit status.
  deadline = started + budget - 5
  report = drive(stages, f.out, f.dry_run, carry_from=f.carry_from,
                 budgets=parse_budgets(f.budgets, f.dry_run),
                 deadline=deadline, child_args=(
      f"--wt103_seconds={f.wt103_seconds}",
      f"--precision_steps={f.precision_steps}",
      "--flashrnn_cuda" if f.flashrnn_cuda else "--noflashrnn_cuda"))
  # Every stage's rows are on disk either way; the exit status tells a
  # script whether all of them finished.
  if any(report["stages"][s]["status"] != "done" for s in stages):
    sys.exit(1)


if __name__ == "__main__":
  _flags()
  if entry.asks_help(sys.argv):
    print(__doc__)
    print(flags.FLAGS.main_module_help())
    sys.exit(0)
  entry.run_tool(main)
