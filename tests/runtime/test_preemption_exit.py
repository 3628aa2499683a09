"""How a train run ends, as its exit status: 75 when a signal stopped it
before train.num_steps (a checkpoint saved), 0 when it reached them. Launchers
(launch/slurm.sbatch) requeue on 75 without reading logs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from zebra_jax.runtime import checkpoint
from zebra_jax.training import preemption
from tests.helpers import REPO

TIMEOUT = 240


def _strict_records(path):
  """metrics.jsonl parsed the way strict JSON readers do: a NaN or Infinity
  literal raises."""
  def reject(constant):
    raise ValueError(f"{constant} is not JSON")
  with open(path) as f:
    return [json.loads(line, parse_constant=reject) for line in f]


def test_exit_status_values():
  assert preemption.EXIT_STOPPED_EARLY == 75  # documented; launchers test it
  assert preemption.exit_status(False) == 0
  assert preemption.exit_status(True) == preemption.EXIT_STOPPED_EARLY


@pytest.mark.slow
def test_sigterm_before_first_eval_exits_75_strict_json_then_completes_0(
    tmp_path):
  workdir = str(tmp_path / "run")
  args = [sys.executable, "-m", "zebra_jax.main",
          "--config=demo:tiny", f"--workdir={workdir}",
          "--config.train.log_every=1", "--config.train.eval_every=100000",
          "--config.checkpoint.every_steps=100000",
          "--config.train.report_at_end=false"]
  proc = subprocess.Popen(args + ["--config.train.num_steps=1000000"],
                          cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  try:
    deadline = time.time() + TIMEOUT
    while not (os.path.exists(metrics) and '"train"' in open(metrics).read()):
      assert proc.poll() is None and time.time() < deadline, "no train step"
      time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=TIMEOUT)
  finally:
    proc.kill()
  assert proc.returncode == preemption.EXIT_STOPPED_EARLY, err[-3000:]
  assert "received SIGTERM" in out
  # TensorBoard's writer logs this for a non-finite scalar; there is none.
  assert "NaN or Inf" not in out + err
  records = _strict_records(metrics)
  [summary] = [r for r in records if r["kind"] == "summary"]
  assert summary["stopped_early"] and summary["best_valid_step"] is None
  assert summary["best_valid_loss"] is None
  assert summary["best_valid_ppl"] is None
  [saved] = checkpoint.Checkpointer(workdir).all_steps()
  assert saved == summary["steps"] >= 1

  # The same command with a reachable end resumes there and exits 0.
  done = subprocess.run(args + [f"--config.train.num_steps={saved + 2}"],
                        cwd=REPO, capture_output=True, text=True,
                        timeout=TIMEOUT)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"resuming from checkpoint at step {saved}" in done.stdout
  summaries = [r for r in _strict_records(metrics) if r["kind"] == "summary"]
  assert not summaries[-1]["stopped_early"]
  assert summaries[-1]["steps"] == saved + 2
  # Its final step evaluated: the best loss is a number again.
  assert summaries[-1]["best_valid_step"] == saved + 2
  assert summaries[-1]["best_valid_loss"] > 0
