"""Generation: batched prompts of different lengths, chunks, stop, stream and
the CLI."""

import dataclasses
import subprocess
import sys

import pytest

from zebra_jax.errors import UserError
from zebra_jax import engine
from zebra_jax.inference import loading, sample
from tests import references
from tests.helpers import REPO

P = engine.SamplingParams

PROMPTS = ["the ", "line 12: the quick", "x"]


@pytest.fixture(scope="module")
def trained(char_run):
  cfg, workdir = char_run
  gen = sample.Generator(loading.load_for_inference(cfg, workdir))
  yield cfg, workdir, gen
  gen.close()


def test_batched_prompts_of_different_lengths_match_each_alone(trained):
  """Greedy rows together equal each alone and the reference outside the
  engine (the whole prompt as one window); sampled rows with a repetition
  penalty (each row's own seen tokens) equal each alone on the same
  stream."""
  _, _, gen = trained
  greedy = P(max_new_tokens=12, temperature=0.0)
  texts = gen.generate(PROMPTS, greedy)
  assert texts == [gen.generate([p], greedy)[0] for p in PROMPTS]
  assert texts == [p + references.greedy_text(gen, p, 12) for p in PROMPTS]
  assert all(len(t) == len(p) + 12 for t, p in zip(texts, PROMPTS))
  sampled = P(max_new_tokens=12, temperature=1.0, repetition_penalty=1.5,
              seed=3)
  together = gen.generate(PROMPTS, sampled)
  alone = [p + gen.engine.submit(p, sampled, sample_index=i).result(
      timeout=300) for i, p in enumerate(PROMPTS)]
  assert together == alone
  assert together != texts


def test_chunks_and_seeds_reproduce(trained):
  cfg, workdir, gen = trained
  options = P(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=7)
  one_shot = gen.generate(PROMPTS[:2], options, num_samples=2)
  assert len(one_shot) == 4 and one_shot[0].startswith(PROMPTS[0])
  assert one_shot[2].startswith(PROMPTS[1])
  assert one_shot[0] != one_shot[1]  # each sample its own stream of the seed
  # Other engine shapes: 3 tokens per decode call, prompts in chunks of 5
  # (line 12's prompt takes 4), 2 slots (rows wait in the queue).
  other_shapes = sample.Generator(loading.load_for_inference(cfg, workdir),
                                  decode_block=3, prefill_chunk=5,
                                  prefill_rows=1, slots=2)
  try:
    chunked = other_shapes.generate(PROMPTS[:2], options, num_samples=2)
  finally:
    other_shapes.close()
  assert chunked == one_shot  # token i always uses fold_in(key, i)
  other = gen.generate(PROMPTS[:2], dataclasses.replace(options, seed=8),
                       num_samples=2)
  assert other != one_shot


def test_stop_string_and_streaming(trained):
  _, _, gen = trained
  base = P(max_new_tokens=30, temperature=1.0, seed=1)
  free = gen.generate(["the "], base)[0][len("the "):]
  # A stop string that first appears after a few characters (sampled text
  # varies enough to have one).
  stop = next(free[i:i + 2] for i in range(5, 28)
              if free.find(free[i:i + 2]) == i)
  cut = free.split(stop, 1)[0]
  pieces = []
  stopped = gen.generate(["the "], dataclasses.replace(base, stop=(stop,)),
                         on_text=lambda row, text: pieces.append(text))
  assert stopped == ["the " + cut] and stop not in cut
  assert "".join(pieces) == cut and len(pieces) >= 2  # printed as it grew
  pieces.clear()
  streamed = gen.generate(["the "], base, on_text=lambda r, t: pieces.append(t))
  assert "".join(pieces) == free == streamed[0][len("the "):]


def test_repetition_penalty_changes_greedy_text(trained):
  _, _, gen = trained
  plain = gen.generate(["the "], P(max_new_tokens=40,
                                               temperature=0.0))[0]
  penalized = gen.generate(["the "], P(
      max_new_tokens=40, temperature=0.0, repetition_penalty=50.0))[0]
  assert penalized != plain
  # A huge penalty pushes every seen character below every unseen one.
  new = penalized[len("the "):]
  assert len(set(new)) > len(set(plain[len("the "):]))


@pytest.mark.parametrize("options, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be a number"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1 must be a whole number"),
    (dict(top_k=2**40), "top_k=1099511627776 must be a whole number in"),
])
def test_bad_options(trained, options, message):
  _, _, gen = trained
  with pytest.raises(UserError, match=message):
    gen.generate(["the "], P(**options))
  with pytest.raises(UserError, match="no prompts"):
    gen.generate([], P())


@pytest.mark.slow
def test_cli_prompt_file_and_stream(trained, tmp_path):
  cfg, workdir, gen = trained
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("the \n\nline 12: the quick\n")
  common = [sys.executable, "-m", "zebra_jax.main",
            "--config=demo:tiny", f"--workdir={workdir}",
            "--config.data.source=text", f"--config.data.path={cfg.data.path}",
            "--mode=sample", "--config.sample.max_new_tokens=16",
            "--config.sample.temperature=0"]
  run = lambda *a: subprocess.run(common + list(a), capture_output=True,
                                  text=True, timeout=300, cwd=REPO)
  out = run(f"--prompt_file={prompts}",
            "--config.sample.repetition_penalty=1.2")
  assert out.returncode == 0, out.stderr
  expected = gen.generate(["the ", "line 12: the quick"], P(
      max_new_tokens=16, temperature=0.0, repetition_penalty=1.2))
  assert "----- sample 2/2" in out.stdout
  assert all(t in out.stdout for t in expected)
  out = run("--prompt=the ", "--config.sample.stream",
            "--config.sample.chunk=4")
  assert out.returncode == 0, out.stderr
  greedy = gen.generate(["the "], P(max_new_tokens=16,
                                                 temperature=0.0))[0]
  assert greedy in out.stdout
  with pytest.raises(UserError, match="--config.sample.stream prints one"):
    stream_cfg = cfg.copy_and_resolve_references()
    stream_cfg.sample.stream = True
    sample.run(stream_cfg, workdir, ["the ", "x"])


def test_bpe_continuations_keep_their_own_spaces_and_whole_characters():
  """Byte-level BPE: ' world' is one token, so the prompt 'hello' must not get
  a second space; a character whose bytes span two chunks is never streamed
  as U+FFFD."""
  pytest.importorskip("tokenizers")
  from zebra_jax.data.tokenizers import BPESpec, BPETokenizer
  tok = BPETokenizer.build(["hello world, the world is big. wörld é\n" * 50],
                           BPESpec(bpe_vocab_size=300))
  ids = tok.encode_prompt("hello world")
  assert engine.continuation(tok, "hello", ids[1:]) == " world"
  euro = tok.encode_prompt("a€")  # unseen in training: 3 byte tokens
  partial = engine.continuation(tok, "x", euro[:-1])
  assert partial.startswith("a") and partial.endswith("\ufffd")
  assert engine.stream_safe(partial, (), final=False) == "a"
  assert engine.stream_safe(partial, (), final=True) == partial
  assert engine.continuation(tok, "x", euro) == "a€"
