"""lab.pallas_plans on a CPU (interpret mode): each row runs the plan and
matmul precision it names, beside the scan."""

import subprocess
import sys

import jax
import pytest

from lab import pallas_plans
from zebra_jax.model.recurrence import pallas


@pytest.mark.slow
def test_each_row_runs_its_plan_and_precision(monkeypatch):
  traced, chooser = [], pallas.launch_plan
  fused = pallas._fused_layer  # pylint: disable=protected-access

  def spy(launch, interpret):
    traced.append((launch, jax.config.jax_default_matmul_precision))
    return fused(launch, interpret)
  monkeypatch.setattr(pallas, "_fused_layer", spy)
  rows = pallas_plans.time_plans("core_fp32", dry=True)
  assert [r["name"] for r in rows] == ["scan_S4", "held", "streamed k4",
                                       "held highest"]
  assert all(r["ms_per_step"] > 0 for r in rows)
  assert [r["precision"] for r in rows[1:]] == ["default", "default",
                                               "highest"]
  assert rows[2]["plan"] == ("fused: 4 rows, 4 warps, U_s streamed in "
                            "4-row blocks")
  assert {(p.u_strategy, p.k_chunk, prec) for p, prec in traced} == {
      ("held", 8, None), ("streamed", 4, None), ("held", 8, "highest")}
  assert pallas.launch_plan is chooser  # the stand-in is gone


def test_without_a_gpu_it_asks_for_one():
  got = subprocess.run([sys.executable, "-m", "lab.pallas_plans"],
                       capture_output=True, text=True, timeout=120)
  assert got.returncode == 2
  assert got.stderr.strip().splitlines()[-1].startswith(
      "error: the plans are GPU launch plans")
