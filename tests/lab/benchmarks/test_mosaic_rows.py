"""The kernel stage's Mosaic forward row: where it appears, its check
against the scan (run here in Mosaic GPU interpret mode), and a failed
check making it an error row instead of a timed one."""

import jax
import pytest

from lab.benchmarks import gpu_kernel, mosaic_rows
from zebra_jax.model.recurrence import pallas_mosaic

SHAPE = dict(hidden=128, layers=1, batch=16, seq_len=3, dtype="bfloat16")


def test_the_row_is_in_bf16_groups_of_several_stripes_only(capsys):
  assert mosaic_rows.candidates({**SHAPE, "dtype": "float32"}, 2, True) == []
  assert mosaic_rows.candidates(SHAPE, 1, False) == []
  assert capsys.readouterr().out == ""
  rows = mosaic_rows.candidates(SHAPE, 2, True)
  if jax.devices()[0].platform == "gpu":
    assert [(impl, s) for impl, _, s in rows] == [("zebra_mosaic", 2)]
  else:  # no row: one line says why
    assert rows == []
    assert capsys.readouterr().out == (
        "| zebra_mosaic_S2 (bfloat16): skipped: Mosaic GPU kernels run on "
        "GPUs only (the CPU tests run it in interpret mode)\n")


@pytest.mark.skipif(not pallas_mosaic.has_interpreter(),
                    reason="this jax has no Mosaic GPU interpreter")
def test_the_check_passes_the_kernel_in_interpret_mode():
  """S=2, G=64: every array within the tolerance of the scan's."""
  errors = mosaic_rows.forward_errors(SHAPE, 2, interpret=True)
  assert set(errors) == {"ys", "h", "c", "cs", "gates"}
  assert max(errors.values()) <= mosaic_rows.TOLERANCE


@pytest.mark.parametrize("error", [0.5, float("nan")])
def test_outputs_beyond_tolerance_fail_the_row(monkeypatch, error):
  monkeypatch.setattr(mosaic_rows, "forward_errors",
                      lambda *a, **k: {"ys": 1e-3, "gates": error})
  rows = gpu_kernel.time_group(
      SHAPE, "bfloat16", 2, [(mosaic_rows.IMPL, lambda: mosaic_rows
                              .checked_runner(SHAPE, 2, True), 2)], rounds=1)
  [row] = rows
  assert "tokens_per_s" not in row
  assert row["error"].startswith(
      "RuntimeError: failed: outputs differ from the scan's: gates")


def test_a_checked_row_is_timed_and_counts_as_ours(monkeypatch):
  """Past its check the row is the core train step on the Mosaic forward
  (here in interpret mode), timed; its ratios are ours over the baselines,
  never a baseline of the other rows of ours."""
  monkeypatch.setattr(mosaic_rows, "forward_errors",
                      lambda *a, **k: {"ys": 0.0})
  [row] = gpu_kernel.time_group(
      SHAPE, "bfloat16", 2, [(mosaic_rows.IMPL, lambda: mosaic_rows
                              .checked_runner(SHAPE, 2, True), 2)], rounds=1)
  assert row["tokens_per_s"] > 0, row
  base = dict(row, name="torch_cudnn_bf16_S1", impl="torch_cudnn_bf16",
              stripes=1)
  pallas = dict(row, name="zebra_pallas_S2", impl="zebra_pallas")
  assert set(gpu_kernel.ratios([row, base, pallas])) == {
      "zebra_mosaic_S2", "zebra_pallas_S2"}
  assert gpu_kernel.ratios([row, base, pallas])["zebra_mosaic_S2"] == {
      "torch_cudnn_bf16_S1": 1.0}
