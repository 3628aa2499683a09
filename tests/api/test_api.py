"""The Python API through its public names only, on the tiny trained run."""

import os

import numpy as np
import pytest

from tests.helpers import python_block


@pytest.fixture(scope="module")
def model(char_run):
  import zebra_jax
  _, workdir = char_run
  with zebra_jax.load(workdir) as loaded:
    yield loaded


@pytest.mark.slow  # the serving engine compiles its programs
def test_generate_stream_and_callback_agree(model):
  import zebra_jax
  params = zebra_jax.SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)
  first, second = model.generate(["the ", "line "], params)
  assert first and second and not first.startswith("the ")
  assert "".join(model.stream("the ", params)) == first
  heard = {0: "", 1: ""}

  def on_text(row, piece):
    heard[row] += piece
  again = model.generate(["the ", "line "], params, on_text=on_text)
  assert again == [first, second] == [heard[0], heard[1]]
  greedy = model.generate(["the "], model.sampling_params(temperature=0.0),
                          num_samples=2)
  assert greedy[0] == greedy[1]
  with pytest.raises(TypeError, match="pass a list"):
    model.generate("the ", params)


def test_score_and_evaluate(model, tmp_path):
  import zebra_jax.errors
  short, longer = model.score(["the quick brown fox.",
                               "the quick brown fox. the lazy dog."])
  assert short.count == len("the quick brown fox.") - 1
  assert short.log_likelihood < 0
  assert np.isclose(short.perplexity,
                    np.exp(-short.log_likelihood / short.count))
  assert longer.log_likelihood < short.log_likelihood
  vocab = model.config.model.vocab_size  # 20 steps: a little better than uniform
  assert 1.0 < model.evaluate("valid") < vocab
  text = tmp_path / "fox.txt"
  text.write_text("line 3: the quick brown fox jumps over the lazy dog.\n" * 40)
  assert 1.0 < model.evaluate(str(text)) < vocab
  with pytest.raises(zebra_jax.errors.UserError, match="neither a split"):
    model.evaluate("train")


@pytest.mark.slow  # the serving engine compiles its programs
def test_the_api_is_the_commands_path(char_run, model, capsys):
  """sample and score in the CLI print what the API returns."""
  from zebra_jax.cli import modes
  cfg, workdir = char_run
  cfg = cfg.copy_and_resolve_references()
  cfg.sample.prompt = "the "
  modes.sample(cfg, workdir, prompt_file=None)
  printed = capsys.readouterr().out
  [completion] = model.generate([cfg.sample.prompt])
  assert f"\n{cfg.sample.prompt}{completion}\n" in printed
  modes.score(cfg, workdir, text=["the lazy dog."], text_file=[],
              verbose=False)
  [s] = model.score(["the lazy dog."])
  assert f"loss {s.loss:.4f}" in capsys.readouterr().out


@pytest.mark.slow  # the serving engine compiles its programs
def test_the_pages_examples_run(char_run, tmp_path, monkeypatch, capsys):
  """docs/python-api.md's example, as written, on runs/demo."""
  _, workdir = char_run
  os.makedirs(tmp_path / "runs")
  os.symlink(workdir, tmp_path / "runs" / "demo")
  monkeypatch.chdir(tmp_path)
  exec(python_block("docs/python-api.md", "zebra_jax.load"), {})  # pylint: disable=exec-used
  out = capsys.readouterr().out
  assert "[" in out and out.strip()


def test_importing_the_package_starts_no_jax():
  import subprocess
  import sys
  code = ("import sys, zebra_jax; zebra_jax.SamplingParams(); "
          "assert 'jax' not in sys.modules; "
          "assert {'load', 'Model', 'SamplingParams'} <= set(dir(zebra_jax))")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
