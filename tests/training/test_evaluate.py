"""Evaluation: device-count invariance, exact perplexity, splits, the CLI."""

import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from zebra_jax.errors import UserError
from zebra_jax.inference import loading
from zebra_jax.model import lm, metrics
from zebra_jax.training import evaluate
from tests.helpers import REPO


def one_device_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",),
                           axis_types=(jax.sharding.AxisType.Auto,))


def test_eval_on_8_devices_equals_1_device(char_run):
  cfg, workdir = char_run
  many = evaluate.run(cfg, workdir, "all")
  one = evaluate.run(cfg, workdir, "all", mesh=one_device_mesh())
  assert set(many) == {"valid", "test"}
  for split in many:
    assert many[split]["tokens"] == one[split]["tokens"] > 0
    assert many[split]["acc"] == one[split]["acc"]
    assert many[split]["loss"] == pytest.approx(one[split]["loss"], rel=1e-6)
    assert many[split]["bpc"] == pytest.approx(
        many[split]["loss"] / math.log(2))  # char level: bits per character


def test_perplexity_is_exp_of_summed_loss_over_tokens(char_run):
  """Windows of 7, 7 and 6 tokens: exp(sum / count), not a mean of windows."""
  cfg, workdir = char_run
  loaded = loading.load_for_inference(cfg, workdir)
  ids = np.asarray(loaded.splits["valid"][:8 * 21 + 3])  # 3 left over
  evaluator = evaluate.Evaluator(loaded.graphdef, one_device_mesh(),
                                 loaded.cfg.model, batch_size=8, seq_len=7)
  res = evaluator.run(loaded.params, ids)
  # By hand: one pass over each row, numpy log-softmax, one mean.
  rows = ids[:8 * 21].reshape(8, 21)
  logits, _ = lm.apply(loaded.graphdef, loaded.params, rows[:, :-1],
                          lm.init_carry(loaded.cfg.model, 8))
  logits = np.asarray(logits, np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + \
      logits.max(-1)
  nll = logz - np.take_along_axis(logits, rows[:, 1:, None], -1)[..., 0]
  assert res["tokens"] == nll.size == 8 * 20
  assert res["loss"] == pytest.approx(nll.mean(), rel=1e-5)
  assert res["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-5)
  by_window = [nll[:, s:s + 7].mean() for s in (0, 7, 14)]
  assert math.exp(np.mean(by_window)) != pytest.approx(res["ppl"], rel=1e-7)
  # The host-side formula on numbers small enough to check by eye.
  assert metrics.summarize(6.0, 1.0, 3.0)["ppl"] == pytest.approx(math.e ** 2)


def test_eval_options_are_checked(char_run):
  cfg, workdir = char_run
  with pytest.raises(UserError, match="does not divide over 8 devices"):
    bad = cfg.copy_and_resolve_references()
    bad.eval.batch_size = 12
    evaluate.run(bad, workdir, "test")
  with pytest.raises(UserError, match="--split=train is unknown"):
    evaluate.run(cfg, workdir, "train")
  with pytest.raises(UserError, match="too short"):
    big = cfg.copy_and_resolve_references()
    big.eval.batch_size = 8 * 10_000
    evaluate.run(big, workdir, "test")


def test_cli_eval_one_split_prints_the_summary_block(char_run):
  cfg, workdir = char_run
  out = subprocess.run(
      [sys.executable, "-m", "zebra_jax.main", "--config=demo:tiny",
       f"--workdir={workdir}", "--config.data.source=text",
       f"--config.data.path={cfg.data.path}", "--mode=eval", "--split=test",
       "--config.eval.seq_len=20"],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert out.returncode == 0, out.stderr
  assert "| test at step 20 |" in out.stdout and "valid" not in out.stdout
  for field in ("test loss", "test ppl", "test acc", "test bpc", "time",
                "tok/s"):
    assert field in out.stdout
  assert out.stdout.count("=" * 89) == 2


def test_max_tokens_scores_every_row_up_to_a_column(char_run):
  """eval.max_tokens=85 over 8 rows: the first 10 targets of every row
  (windows of 7 and 3), by hand as above; the report names the limit."""
  cfg, workdir = char_run
  loaded = loading.load_for_inference(cfg, workdir)
  ids = np.asarray(loaded.splits["valid"][:8 * 21 + 3])
  evaluator = evaluate.Evaluator(loaded.graphdef, one_device_mesh(),
                                 loaded.cfg.model, batch_size=8, seq_len=7)
  res = evaluator.run(loaded.params, ids, max_tokens=85)
  rows = ids[:8 * 21].reshape(8, 21)
  logits, _ = lm.apply(loaded.graphdef, loaded.params, rows[:, :10],
                       lm.init_carry(loaded.cfg.model, 8))
  logits = np.asarray(logits, np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + \
      logits.max(-1)
  nll = logz - np.take_along_axis(logits, rows[:, 1:11, None], -1)[..., 0]
  assert res["tokens"] == 80 and res["split_tokens"] == 8 * 20
  assert res["loss"] == pytest.approx(nll.mean(), rel=1e-5)
  block = evaluate.summary_block("valid", 20, res, char_level=True)
  assert "| 80 of 160 tokens (eval.max_tokens) |" in block
  whole = evaluator.run(loaded.params, ids)
  assert whole["tokens"] == whole["split_tokens"] == 160
  assert "| 160 tokens |" in evaluate.summary_block("valid", 20, whole, True)
  # A limit beyond the split, and one under a token a row: still valid.
  assert evaluator.run(loaded.params, ids, max_tokens=10**9)["tokens"] == 160
  assert evaluator.run(loaded.params, ids, max_tokens=3)["tokens"] == 8


def test_long_evaluations_print_progress_lines(char_run, capsys, monkeypatch):
  """Off a terminal (a batch job's log) a pass prints its rate and ETA."""
  cfg, workdir = char_run
  monkeypatch.setattr(evaluate, "_LINE_EVERY_S", 0.0)  # a line per update
  monkeypatch.setattr(evaluate, "_WINDOWS_IN_FLIGHT", 1)
  loaded = loading.load_for_inference(cfg, workdir)
  evaluator = evaluate.Evaluator(loaded.graphdef, one_device_mesh(),
                                 loaded.cfg.model, batch_size=8, seq_len=7)
  capsys.readouterr()
  evaluator.run(loaded.params, loaded.splits["valid"][:8 * 21 + 3],
                label="valid")
  lines = [l for l in capsys.readouterr().out.splitlines()
           if l.startswith("valid: ")]
  assert len(lines) >= 4, lines  # a line per window, then the closing one
  assert "/160 tok" in lines[0] and "ETA" in lines[0]
  assert lines[-1].startswith("valid: 160 tok in ")


def test_head_scored_in_time_chunks_gives_the_same_sums(char_run,
                                                        monkeypatch):
  """A head wider than the platform's block budget scores each window a
  few steps at a time: the same loss and accuracy, on one device and with
  the stripes split over 2 devices (data 4 x stripe 2)."""
  from zebra_jax.model import adaptive_softmax as asm
  from zebra_jax.runtime import parallel
  cfg, workdir = char_run
  loaded = loading.load_for_inference(cfg, workdir)
  ids = np.asarray(loaded.splits["valid"][:8 * 17])
  width = evaluate.head_width(loaded.cfg.model)
  assert width == loaded.cfg.model.vocab_size  # the full head: every word
  meshes = (one_device_mesh(), parallel.make_mesh(stripe_devices=2))
  whole = [evaluate.Evaluator(loaded.graphdef, mesh, loaded.cfg.model, 8, 8)
           .run(loaded.params, ids) for mesh in meshes]
  # A budget of 3 rows x 8 x width: windows of 8 steps scored 2 at a time.
  monkeypatch.setattr(asm, "CHUNK_BUDGET_BYTES", {"cpu": 4 * width * 8 * 3})
  assert evaluate.head_steps(8, 8, width) == 2
  assert evaluate.head_steps(8, 7, width) == 1  # 7 is prime
  assert evaluate.head_steps(8, 8, 0) == 8
  for mesh, want in zip(meshes, whole):
    got = evaluate.Evaluator(loaded.graphdef, mesh, loaded.cfg.model, 8,
                             8).run(loaded.params, ids)
    assert got["tokens"] == want["tokens"] == 8 * 16
    assert got["acc"] == want["acc"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
