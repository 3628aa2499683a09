"""Smoke tests on a GPU: `ZEBRA_JAX_TEST_GPU=1 pytest -m gpu`.

Deselected by default (pyproject's addopts): the rest of the suite pins the
CPU. Each test runs the command line as a user would, on the GPU.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.gpu


def _run(*args, timeout=600):
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  done = subprocess.run([sys.executable, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def test_a_gpu_is_what_jax_sees():
  out = _run("-c", "import jax; print(jax.devices()[0].platform)")
  assert out.strip() == "gpu"


def test_train_eval_sample_on_the_gpu(tmp_path):
  workdir = str(tmp_path / "run")
  common = ["-m", "zebra_jax.main", "--config=demo:tiny",
            f"--workdir={workdir}"]
  out = _run(*common, "--config.train.num_steps=30")
  assert "test ppl" in out
  out = _run(*common, "--mode=eval")
  assert "valid ppl" in out and "test ppl" in out
  out = _run(*common, "--mode=sample", "--prompt=The ",
             "--config.sample.max_new_tokens=40")
  assert out.strip()


def test_bench_quick_on_the_gpu(tmp_path):
  out = _run("-m", "lab.bench", "--quick", "--memory=false",
             f"--json={tmp_path / 'bench.json'}")
  assert (tmp_path / "bench.json").exists(), out


def test_the_reports_smoke_stage_on_the_gpu(tmp_path):
  """The report's first stage as its call runs it: the stripe kernel
  lowers through a Pallas GPU backend and every tiny kernel runs."""
  _run("-m", "lab.gpu_report", "--stages=smoke", f"--out={tmp_path}",
       "--carry_from=")
  report = json.loads((tmp_path / "gpu-results.json").read_text())
  assert report["smoke"]["backend"] in ("triton", "mosaic_gpu")
  assert all(r["status"] == "ok" for r in report["smoke"]["rows"]), report
