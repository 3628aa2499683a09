"""The striped-vs-classic comparison end to end (its parts:
tests/lab/benchmarks/test_stripes_*.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lab.benchmarks import stripes_experiment
from tests.helpers import REPO


def _compare_cli(out, *extra, check=True):
  """The CLI in a subprocess on 1 CPU device.

  conftest's 8 emulated devices would have every step all-reduce across 8
  threads; on 2 busy cores XLA's CPU rendezvous can time out and abort.
  """
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = REPO  # the lab runs from a checkout, in any directory
  done = subprocess.run(
      [sys.executable, "-m", "lab.experiments",
       "--config=demo:tiny", f"--out={out}",
       "--budget_minutes=0.02", "--seeds=0", "--stripes=1", "--grouped=2",
       "--equal_time=2", "--no_classic", "--eval_points=2",
       "--curve_eval_batches=2", *extra],
      check=check, env=env, cwd=os.path.dirname(out),  # any directory
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  if not check:
    return done
  with open(os.path.join(out, "results.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_tiny_comparison_end_to_end(tmp_path):
  out = str(tmp_path / "compare")
  results = _compare_cli(out)
  for name in ("results.md", "results.json", "valid_ppl_vs_time.png",
               "plan.json"):
    assert os.path.getsize(os.path.join(out, name)) > 0
  with open(os.path.join(out, "plan.json")) as f:
    plan = json.load(f)
  # The width search starts from grouped S=2 at the config's width (32) and
  # measures every width it tries.
  search = plan["width_search"]["2"]
  assert search[0] == [32, plan["steps_per_s"]["s2_grouped_h32"]]
  assert all(w % 8 == 0 and rate > 0 for w, rate in search)
  rows = results["table"]
  names = [r["setting"] for r in rows]
  assert names[:2] == ["s1_h32", "s2_grouped_h32"]
  assert names == [stripes_experiment.Setting(**s).name
                   for s in plan["settings"]]
  for r in rows:
    assert r["params"] > 0 and r["steps"] >= 1 and r["tok_per_s"] > 0
    assert r["tokens_seen"] == r["steps"] * 8 * 16  # tiny: batch 8 x seq 16
    assert 1.0 < r["valid_ppl"] < 200 and 1.0 < r["test_ppl"] < 200
    assert r["startup_s"] > 0 and r["train_s"] > 0
  assert rows[0]["params"] > rows[1]["params"]  # grouped shrinks W_x and U
  for run in results["runs"]:
    times = [p["train_s"] for p in run["curve"]]
    assert times and times == sorted(times) and times[-1] <= run["wall_s"]
    assert run["train_s"] <= run["wall_s"]
  assert len(results["meta"]["targets_used"]) == 2
  with open(os.path.join(out, "results.md")) as f:
    assert f.read().startswith("| setting | hidden | params |")
  # Rerunning resumes from results.json alone (workdirs are not committed):
  # nothing is trained again.
  shutil.rmtree(os.path.join(out, "workdirs"))
  assert _compare_cli(out)["runs"] == results["runs"]
  assert not os.path.exists(os.path.join(out, "workdirs", "runs"))
  # Other settings into the same folder: one error line naming the fix.
  done = _compare_cli(out, "--grouped=4", check=False)
  assert done.returncode == 2
  (line,) = done.stderr.strip().splitlines()
  assert line.startswith("error: ") and "plan.json was made for other" in line



@pytest.mark.slow
def test_a_run_stopped_by_sigterm_is_not_a_result(tmp_path):
  out = tmp_path / "stopped"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = REPO
  proc = subprocess.Popen(
      [sys.executable, "-m", "lab.experiments",
       "--config=demo:tiny", f"--out={out}",
       "--budget_minutes=2", "--seeds=0", "--stripes=1", "--no_classic",
       "--eval_points=2", "--curve_eval_batches=2"],
      env=env, cwd=str(tmp_path), stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)
  metrics = out / "workdirs" / "runs" / "s1_h32_seed0" / "metrics.jsonl"
  try:
    deadline = time.time() + 240
    while not (metrics.exists() and '"train"' in metrics.read_text()):
      assert proc.poll() is None and time.time() < deadline
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert "stopped during s1_h32 seed 0; rerun the same command" in err
  with open(out / "results.json") as f:
    assert json.load(f)["runs"] == []
  assert not (metrics.parent / "run.json").exists()
