"""--mode=plot writes a non-empty PNG overlaying workdirs the test creates."""

import subprocess
import sys

from tests.helpers import assert_png, write_metrics_run


def test_plot_mode_writes_png_overlaying_workdirs(tmp_path):
  write_metrics_run(str(tmp_path / "s1"), ms_per_batch=200, final_loss=1.5)
  write_metrics_run(str(tmp_path / "s8"), ms_per_batch=120, final_loss=1.6)
  out = str(tmp_path / "plots" / "s1_vs_s8.png")
  subprocess.run([sys.executable, "-m", "zebra_jax.main", "--mode=plot",
                  f"--workdir={tmp_path / 's1'}", f"--compare={tmp_path / 's8'}",
                  f"--plot_out={out}"],
                 check=True, cwd=tmp_path)  # not the repository: installed use
  assert_png(out)


def test_plot_mode_missing_workdir_is_one_error_line(tmp_path):
  out = subprocess.run([sys.executable, "-m", "zebra_jax.main", "--mode=plot",
                        f"--workdir={tmp_path / 'none'}"],
                       capture_output=True, text=True, cwd=tmp_path)
  assert out.returncode == 2
  assert out.stderr.splitlines() == [
      f"error: {tmp_path}/none/metrics.jsonl does not exist: train in "
      f"{tmp_path}/none first, or pass a workdir that has metrics.jsonl"]
