"""Loss/perplexity curves: series, wall-clock origin, the default PNG path."""

import pytest

from zebra_jax.errors import UserError
from zebra_jax.runtime import plots
from tests.helpers import assert_png, write_metrics_run


def test_run_defaults_to_first_workdir(tmp_path):
  write_metrics_run(str(tmp_path / "a"), ms_per_batch=100, final_loss=1.0)
  out = plots.run([str(tmp_path / "a")])
  assert out == str(tmp_path / "a" / "curves.png")
  assert_png(out)


def test_series_and_wall_clock_origin(tmp_path):
  write_metrics_run(str(tmp_path / "a"), ms_per_batch=100, final_loss=1.0)
  run = plots.load_run(str(tmp_path / "a"))
  assert run.label == "a"
  steps, losses = plots.series(run, "valid", "loss", "step")
  assert steps == [50, 100] and len(losses) == 2
  seconds, _ = plots.series(run, "train", "loss", "seconds")
  assert seconds[0] == pytest.approx(1.0) and seconds[-1] == pytest.approx(10.0)
  run.records.insert(0, {"kind": "start", "step": 0, "time": 999_999.0})
  assert plots.start_time(run.records) == 999_999.0


def test_missing_metrics_is_a_user_error(tmp_path):
  with pytest.raises(UserError, match="metrics.jsonl"):
    plots.run([str(tmp_path)])
