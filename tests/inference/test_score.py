"""Score mode: per-text loss equals eval on a split holding only that text."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from zebra_jax.configs import wt103
from zebra_jax.errors import UserError
from zebra_jax.inference import loading, score
from zebra_jax.training import evaluate, loop
from tests.helpers import REPO, write_wikitext

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("score"))
  cfg = wt103.get_config("tiny")
  cfg.data.path = write_wikitext(os.path.join(tmp, "wt"))
  # Few steps, one checkpoint, no mid-run eval: the fixture stays fast.
  cfg.train.num_steps = cfg.checkpoint.every_steps = 5
  cfg.train.eval_every = 1000
  workdir = os.path.join(tmp, "run")
  loop.run(cfg, workdir)
  return cfg, workdir


def test_score_equals_eval_on_a_split_of_only_that_text(trained):
  cfg, workdir = trained
  test_file = os.path.join(cfg.data.path, "wiki.test.tokens")
  [res] = score.run(cfg, workdir, text_files=[test_file])
  loaded = loading.load_for_inference(cfg, workdir)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  # The test split is exactly this file; batch 1 keeps every token in order.
  evaluator = evaluate.Evaluator(loaded.graphdef, mesh, loaded.cfg.model,
                                 batch_size=1, seq_len=16)
  expected = evaluator.run(loaded.params, loaded.splits["test"])
  assert res["tokens"] == expected["tokens"] == len(loaded.splits["test"]) - 1
  assert res["loss"] == pytest.approx(expected["loss"], rel=1e-5)
  assert res["ppl"] == pytest.approx(expected["ppl"], rel=1e-5)
  assert "bpc" not in res  # word level


def test_window_length_does_not_change_scores(trained):
  cfg, workdir = trained
  loaded = loading.load_for_inference(cfg, workdir)
  text = "the cat sat on a mat . \n the dog ran to the park . \n" * 3
  short = score.Scorer(loaded, seq_len=5).score_text(text)
  whole = score.Scorer(loaded, seq_len=1000).score_text(text)
  assert short.count == whole.count == len(loaded.tokenizer.encode(text)) - 1
  np.testing.assert_allclose(short.logprobs, whole.logprobs, atol=1e-5)
  assert (short.logprobs < 0).all()


def test_verbose_gives_per_token_logprobs(trained, capsys):
  cfg, workdir = trained
  [res] = score.run(cfg, workdir, texts=["the cat sat"], verbose=True)
  tokens = [t for t, _ in res["token_logprobs"]]
  assert tokens == ["cat", "sat", "<eos>"] and res["tokens"] == 3
  total = sum(lp for _, lp in res["token_logprobs"])
  assert -total / 3 == pytest.approx(res["loss"])
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("| text 1 | 3 tokens | loss ")
  assert len(out) == 1 + 3 and "'sat'" in out[2]


def test_cli_score_and_bad_inputs(trained, tmp_path):
  cfg, workdir = trained
  common = [sys.executable, "-m", "zebra_jax.main",
            "--config=wt103:tiny", f"--workdir={workdir}",
            f"--config.data.path={cfg.data.path}", "--mode=score"]
  out = subprocess.run(common + ["--text=the cat sat", "--text=the dog ran"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
  assert out.returncode == 0, out.stderr
  assert "| text 1 | 3 tokens |" in out.stdout
  assert "| text 2 | 3 tokens |" in out.stdout
  with pytest.raises(UserError, match="cannot read --text_file"):
    score.run(cfg, workdir, text_files=[f"{tmp_path}/missing.txt"])
  with pytest.raises(UserError, match="nothing to score"):
    score.run(cfg, workdir)
  loaded = loading.load_for_inference(cfg, workdir)
  with pytest.raises(UserError, match="nothing to score|at least two"):
    score.Scorer(loaded, 16).score_ids(np.array([3]))
