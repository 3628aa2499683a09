"""The GPU report's call rehearsed as the node runs it, and the ledger of
the node's time it would spend (launch/gpu_rehearsal.sh runs this module).

  python -m lab.benchmarks.gpu_rehearsal --out=OUT [--budget=S]
      [--stages="smoke kernel"] [--kill_after=kernel:6] -- COMMAND...

COMMAND (bash launch/gpu_report.sh --dry-run STAGES, from an empty OUT) runs
in its own process group, killed whole with SIGKILL at the budget, as the
node's timeout kills a call, or, with --kill_after=STAGE:ROWS, as soon as
OUT/gpu-results.json counts ROWS rows of STAGE: a call killed mid-stage.
Then it checks what OUT holds, as the node would send it back: every row
the call printed as measured ("| measured STAGE ROW") is in the returned
file; without a kill, every stage ran to its end. Last it prints the
device-time ledger from gpu_budget.py and fails if the budgets do not fit
the node's window. Exit 0: the rehearsal passed; 1: it failed; 2: bad
arguments.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

from lab.benchmarks import gpu_budget, gpu_results

MEASURED = "| measured "


def _rows(out: str, stage: str) -> int:
  try:
    with open(os.path.join(out, "gpu-results.json")) as f:
      return json.load(f)["stages"][stage]["rows"]
  except (OSError, ValueError, KeyError):
    return 0


def run_call(command, out: str, budget: float, kill_after=None) -> dict:
  """Runs command, its output passed through and kept; kills its process
  group at budget seconds or once kill_after=(stage, rows) is on disk.
  {returncode, seconds, killed (why or None), log}."""
  start = time.monotonic()
  process = subprocess.Popen(command, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
  log = []

  def read():
    for line in process.stdout:
      sys.stdout.write(line)
      sys.stdout.flush()
      log.append(line.rstrip("\n"))
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  killed = None
  while process.poll() is None:
    if time.monotonic() - start > budget:
      killed = f"killed at its {budget:.0f} s budget"
    elif kill_after and _rows(out, kill_after[0]) >= kill_after[1]:
      killed = f"killed once {kill_after[0]} had {kill_after[1]} rows"
    if killed:
      os.killpg(process.pid, signal.SIGKILL)
      break
    time.sleep(0.1)
  process.wait()
  reader.join(timeout=10)
  return {"returncode": process.returncode, "killed": killed, "log": log,
          "seconds": time.monotonic() - start}


def measured(log) -> list[tuple[str, str]]:
  """(stage, row) of every "| measured STAGE ROW" line of a call's log."""
  found = []
  for line in log:
    if line.startswith(MEASURED):
      stage, _, row = line[len(MEASURED):].partition(" ")
      found.append((stage, row))
  return found


def too_much(out: str) -> list[str]:
  """Why the node could not send OUT back whole: more files, or larger
  ones, than it returns."""
  files = [os.path.join(root, f) for root, _, names in os.walk(out)
           for f in names]
  found = [f"{len(files)} files > {gpu_budget.RETURNED_FILES}"] if (
      len(files) > gpu_budget.RETURNED_FILES) else []
  return found + [f"{os.path.relpath(f, out)}: {os.path.getsize(f)} bytes > "
                  f"{gpu_budget.RETURNED_FILE_BYTES}" for f in files
                  if os.path.getsize(f) > gpu_budget.RETURNED_FILE_BYTES]


def check(out: str, log, stages, killed) -> list[str]:
  """What the returned OUT lacks: rows measured but not returned; without
  a kill, stages that did not finish; files the node would not send."""
  path = os.path.join(out, "gpu-results.json")
  if not os.path.exists(path):
    return ["no gpu-results.json came back"]
  with open(path) as f:
    report = json.load(f)
  have = set(gpu_results.row_ids(report))  # as the log names them
  lost = [f"{s} {r}" for s, r in measured(log) if (s, r) not in have]
  problems = [f"measured but not returned: {', '.join(lost)}"] if lost else []
  problems += too_much(out)
  if not killed:
    status = report.get("stages", {})
    problems += [f"{s}: {status.get(s, {}).get('status', 'missing')}"
                 for s in stages if status.get(s, {}).get("status") != "done"]
  return problems


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m lab.benchmarks.gpu_rehearsal",
      description="Runs the GPU report's call as the node does and prints "
      "the device-time ledger.")
  parser.add_argument("--out", required=True, help="the call's OUT folder")
  parser.add_argument("--budget", type=float, default=None, help="seconds "
                      "before the call is killed (default: the dry budgets' "
                      "sum and the overhead)")
  parser.add_argument("--stages", default=" ".join(gpu_budget.STAGES),
                      help="the stages the call runs, space-separated")
  parser.add_argument("--kill_after", default=None, metavar="STAGE:ROWS",
                      help="kill the call once STAGE has ROWS rows on disk")
  parser.add_argument("command", nargs="+", help="the call, after --")
  args = parser.parse_args(argv)
  stages = args.stages.split()
  kill_after = None
  if args.kill_after:
    stage, _, rows = args.kill_after.partition(":")
    if stage not in gpu_budget.STAGES or not rows.isdigit():
      parser.exit(2, f"error: --kill_after wants STAGE:ROWS with a stage of "
                     f"{', '.join(gpu_budget.STAGES)}, not {args.kill_after}\n")
    kill_after = (stage, int(rows))
  budget = args.budget or gpu_budget.call_seconds(gpu_budget.DRY_BUDGET_S)
  call = run_call(args.command, args.out, budget, kill_after)
  failed = [] if call["killed"] or call["returncode"] == 0 else [
      f"the call exited {call['returncode']}"]
  if call["killed"] and not kill_after:
    failed.append(f"the call was {call['killed']}")
  failed += check(args.out, call["log"], stages, call["killed"])
  failed += gpu_budget.problems()
  rows = len(measured(call["log"]))
  print(f"== the call: {call['seconds']:.0f} s on this machine (dry shapes), "
        f"{call['killed'] or 'ran to its end'}; {rows} rows measured, "
        "each one in the returned gpu-results.json"
        if not failed else f"== the call: {call['seconds']:.0f} s")
  print("\n".join(gpu_budget.ledger_lines()))
  if failed:
    print(f"== rehearsal failed: {'; '.join(failed)}")
    return 1
  print(f"== rehearsal passed: {', '.join(stages)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
