"""launch/slurm.sbatch's decisions after srun, with srun, scontrol and squeue
played by small scripts (a real SLURM needs root: launch/slurm_rehearsal.sh
runs the same script under one). On exit 75 (stopped early, checkpoint
saved) the job is requeued when SLURM may requeue it and preempted it or its
time is up; any other stop ends the job with 75 so that it is not reported
as done."""

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE/srun.args"
echo "JAX_PLATFORMS=${JAX_PLATFORMS:-} SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK" \
  > "$FAKE/srun.env"
exit "$FAKE_SRUN_STATUS"
"""
_SCONTROL = """#!/usr/bin/env bash
case "$1" in
  show) echo "JobId=$3 JobName=zebra_jax"
        echo "   Requeue=$FAKE_REQUEUE Restarts=0 BatchFlag=1 Reboot=0"
        echo "   PreemptEligibleTime=2026-01-01T00:00:00 PreemptTime=$FAKE_PREEMPT"
        ;;
  requeue) echo "$2" >> "$FAKE/requeued"; exit "${FAKE_REQUEUE_STATUS:-0}" ;;
esac
"""
_SQUEUE = """#!/usr/bin/env bash
echo "$FAKE_TIME_LEFT"
"""


def _sbatch(tmp_path, srun_status, requeue="1", preempt="None",
            time_left="1-02:03:04", **env):
  fake = tmp_path / "bin"
  fake.mkdir(exist_ok=True)
  for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL),
                     ("squeue", _SQUEUE)):
    (fake / name).write_text(text)
    (fake / name).chmod(0o755)
  env = {"PATH": f"{fake}:{os.environ['PATH']}", "FAKE": str(fake),
         "FAKE_SRUN_STATUS": str(srun_status), "FAKE_REQUEUE": requeue,
         "FAKE_PREEMPT": preempt, "FAKE_TIME_LEFT": time_left,
         "SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "3",
         "ZEBRA_JAX_PYTHON": sys.executable, **env}
  out = subprocess.run(
      ["bash", os.path.join(REPO, "launch", "slurm.sbatch"), "demo",
       str(tmp_path / "run"), "--config.train.num_steps=7"],
      env=env, capture_output=True, text=True, timeout=60)
  requeued = fake / "requeued"
  return out, requeued.read_text().split() if requeued.exists() else []


@pytest.mark.parametrize("case,srun,kw,status,requeued,says", [
    ("done", 0, {}, 0, [], ""),
    ("preempted", 75, dict(preempt="2026-01-01T00:01:00"), 0, ["42"],
     "stopped early (preempted), checkpoint saved: requeueing job 42"),
    ("time limit", 75, dict(time_left="1:30"), 0, ["42"],
     "stopped early (time limit, 90 s left)"),
    ("time limit, hours", 75, dict(time_left="2:00:10"), 75, [],
     "submit the same command again"),
    ("scancel --signal=TERM", 75, {}, 75, [],
     "submit the same command again"),
    ("--no-requeue", 75, dict(requeue="0", preempt="2026-01-01T00:01:00"),
     75, [], "submit the same command again"),
    ("crashed while preempted", 1, dict(preempt="2026-01-01T00:01:00"), 1,
     [], ""),
    ("requeue refused", 75, dict(preempt="2026-01-01T00:01:00",
                                 FAKE_REQUEUE_STATUS="1"), 75, ["42"],
     "error: scontrol requeue 42 failed"),
])
def test_requeues_only_when_slurm_wants_the_job_back(
    tmp_path, case, srun, kw, status, requeued, says):
  del case
  out, calls = _sbatch(tmp_path, srun, **kw)
  assert out.returncode == status, out.stderr
  assert calls == requeued
  assert says in out.stdout + out.stderr


def test_runs_the_named_python_with_the_cpus_it_was_given(tmp_path):
  out, _ = _sbatch(tmp_path, 0, SLURM_GPUS_PER_NODE="8")
  assert out.returncode == 0, out.stderr
  args = (tmp_path / "bin" / "srun.args").read_text().splitlines()
  python = args.index(sys.executable)
  assert args[python:] == [
      sys.executable, "-m", "zebra_jax.main", "--config=demo",
      f"--workdir={tmp_path / 'run'}", "--config.train.num_steps=7"]
  # A task that holds neither its peers up nor a crashed peer's forever.
  assert "--kill-on-bad-exit=0" in args[:python]
  env = (tmp_path / "bin" / "srun.env").read_text()
  assert env.split() == ["JAX_PLATFORMS=cuda", "SRUN_CPUS_PER_TASK=3"]
  assert f"python {sys.executable}" in out.stdout  # logged


def test_a_python_without_zebra_jax_is_one_error_line(tmp_path):
  out, _ = _sbatch(tmp_path, 0, ZEBRA_JAX_PYTHON="/bin/false")
  assert out.returncode == 2
  assert out.stderr.startswith("error: /bin/false cannot import zebra_jax")
  assert "ZEBRA_JAX_PYTHON=" in out.stderr
  assert not (tmp_path / "bin" / "srun.args").exists()
