"""The plot command writes a non-empty PNG from workdirs the test creates."""

import json
import os
import subprocess
import sys

import pytest

from zebra_jax.errors import UserError
from zebra_jax.tools import plot

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(workdir, ms_per_batch, final_loss, start=1_000_000.0):
  """A synthetic metrics.jsonl in the format train.py writes."""
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(10, 101, 10):
      loss = final_loss + 2.0 / step
      t = start + step * ms_per_batch / 1000
      f.write(json.dumps({"kind": "train", "step": step, "time": t,
                          "ms_per_batch": ms_per_batch, "tok_per_s": 1e4,
                          "loss": loss, "ppl": 2.718 ** loss, "acc": 0.5})
              + "\n")
      if step % 50 == 0:
        f.write(json.dumps({"kind": "valid", "step": step, "time": t + 1,
                            "loss": loss + 0.1, "ppl": 2.718 ** (loss + 0.1),
                            "acc": 0.5}) + "\n")
    f.write('{"kind": "train", "step": 1')  # a torn last line (killed run)


def _assert_png(path):
  with open(path, "rb") as f:
    assert f.read(8) == _PNG_MAGIC
  assert os.path.getsize(path) > 5000  # axes, curves and legend, not a blank


def test_cli_writes_png_overlaying_workdirs(tmp_path):
  _write_run(str(tmp_path / "s1"), ms_per_batch=200, final_loss=1.5)
  _write_run(str(tmp_path / "s8"), ms_per_batch=120, final_loss=1.6)
  out = str(tmp_path / "plots" / "s1_vs_s8.png")
  subprocess.run([sys.executable, "-m", "zebra_jax.tools.plot",
                  str(tmp_path / "s1"), str(tmp_path / "s8"), f"--out={out}"],
                 check=True, cwd=tmp_path)  # not the repository: installed use
  _assert_png(out)


def test_cli_missing_workdir_is_one_error_line(tmp_path):
  out = subprocess.run([sys.executable, "-m", "zebra_jax.tools.plot",
                        str(tmp_path / "none")], capture_output=True, text=True,
                       cwd=tmp_path)
  assert out.returncode == 2
  assert out.stderr.splitlines() == [
      f"error: {tmp_path}/none/metrics.jsonl does not exist: train in "
      f"{tmp_path}/none first, or pass a workdir that has metrics.jsonl"]


def test_run_defaults_to_first_workdir(tmp_path):
  _write_run(str(tmp_path / "a"), ms_per_batch=100, final_loss=1.0)
  out = plot.run([str(tmp_path / "a")])
  assert out == str(tmp_path / "a" / "curves.png")
  _assert_png(out)


def test_series_and_wall_clock_origin(tmp_path):
  _write_run(str(tmp_path / "a"), ms_per_batch=100, final_loss=1.0)
  run = plot.load_run(str(tmp_path / "a"))
  assert run.label == "a"
  steps, losses = plot.series(run, "valid", "loss", "step")
  assert steps == [50, 100] and len(losses) == 2
  seconds, _ = plot.series(run, "train", "loss", "seconds")
  assert seconds[0] == pytest.approx(1.0) and seconds[-1] == pytest.approx(10.0)
  run.records.insert(0, {"kind": "start", "step": 0, "time": 999_999.0})
  assert plot.start_time(run.records) == 999_999.0


def test_missing_metrics_is_a_user_error(tmp_path):
  with pytest.raises(UserError, match="metrics.jsonl"):
    plot.run([str(tmp_path)])
