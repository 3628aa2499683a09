"""gpu_report's driver: a stage killed midway keeps the rows it finished,
and a stage past its budget is stopped (the stages themselves:
tests/benchmarks/test_gpu_stages.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from zebra_jax.tools import gpu_report


def _stage_child_pid(stage, out):
  """The pid of the child process running `stage` into `out`, or None."""
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    except OSError:
      continue
    if f"--stage_child={stage}" in args and f"--out={out}" in args:
      return int(pid)
  return None


@pytest.mark.slow
def test_a_stage_killed_midway_keeps_its_rows(tmp_path):
  # The real command line: the driver starts the quick stage's process; it
  # is killed once its first row (the matmul peak) is on disk.
  out = str(tmp_path)
  path = tmp_path / "gpu-results.json"
  driver = subprocess.Popen(
      [sys.executable, "-m", "zebra_jax.tools.gpu_report", "--stages=quick",
       "--dry_run", f"--out={out}"], stdout=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    try:
      rows = json.loads(path.read_text())["stages"]["quick"]["rows"]
    except (OSError, ValueError, KeyError):
      rows = 0
    if rows >= 1:
      break
    time.sleep(0.2)
  os.kill(_stage_child_pid("quick", out), signal.SIGKILL)
  stdout, _ = driver.communicate(timeout=60)
  assert driver.returncode == 1  # a stage did not finish; its rows stay

  report = json.loads(path.read_text())
  status = report["stages"]["quick"]
  assert status["status"] == (
      f"stopped by SIGKILL after {status['rows']} rows")
  assert report["quick"]["peak"]["best_measured_matmul_tflops"] > 0
  assert status["rows"] == 1 + len(report["quick"].get("rows", []))
  page = (tmp_path / "gpu-results.md").read_text()
  assert "## Best measured matmul" in page
  assert "stage quick: stopped by SIGKILL" in page
  assert "stage quick: stopped by SIGKILL" in stdout  # the printed summary

  # A stage past its budget: its process group is killed, the report says so.
  gpu_report.drive(["scaling"], out, dry=True, budgets={"scaling": 2})
  report = json.loads(path.read_text())
  assert report["stages"]["scaling"]["status"].startswith(
      "stopped at its budget after")
  assert report["quick"]["peak"]  # the earlier stage's rows stay
