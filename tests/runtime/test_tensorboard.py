"""TensorBoard event files from MetricWriter hold the expected scalar tags.

Read back with tensorboard's own event reader (pip install tensorboard; no
TensorFlow needed), so what TensorBoard shows is what is tested.
"""

import glob
import os

import pytest

from zebra_jax.runtime import writer

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")


def _scalars(logdir):
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
          for tag in acc.Tags()["scalars"]}


def test_writer_scalars_read_back(tmp_path):
  workdir = str(tmp_path)
  log = writer.MetricWriter(workdir)
  for step in (100, 200):
    log.train_line(epoch=1, step=step, batch=step, batches=830, lr=3e-3,
                   ms_per_batch=141.0, tok_per_s=14524.0, loss=1.62,
                   ppl=5.05, acc=0.515, grad_norm=0.8)
  log.eval_line(1, 200, "valid", {"loss": 1.55, "ppl": 4.71, "acc": 0.534})
  log.close()

  logdir = os.path.join(workdir, "tensorboard")
  assert glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
  scalars = _scalars(logdir)
  for tag in ("train/loss", "train/ppl", "train/acc", "train/lr",
              "train/grad_norm", "train/tok_per_s", "train/ms_per_batch",
              "valid/loss", "valid/ppl", "valid/acc"):
    assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
  assert [s for s, _ in scalars["train/loss"]] == [100, 200]
  assert scalars["valid/ppl"] == [(200, pytest.approx(4.71, rel=1e-6))]
  assert scalars["train/tok_per_s"][0][1] == pytest.approx(14524.0)


def test_tensorboard_off_writes_no_events(tmp_path):
  log = writer.MetricWriter(str(tmp_path), tensorboard=False)
  log.eval_line(1, 10, "valid", {"loss": 1.0, "ppl": 2.72, "acc": 0.5})
  log.close()
  assert not os.path.exists(os.path.join(str(tmp_path), "tensorboard"))
