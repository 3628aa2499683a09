"""Every tokenizer kind through every mode: train -> eval -> score (plain and
verbose) -> sample -> serve /score and /generate -> export -> the Triton model.

Each step goes through the function the CLI mode calls, on a tiny model over
a small corpus, and checks what the next one relies on: scores agree between
score mode and /score, greedy continuations agree between sample, /generate
and the exported Triton model, and the exported functions' logits match the
JAX model on the same tokens.
"""

import json
import math
import os
import threading

import numpy as np
import pytest

from zebra_jax.configs import demo
from zebra_jax.data import tokenizers
from zebra_jax.inference import export, loading, sample, score
from zebra_jax.serving import serve
from zebra_jax.model import lm
from zebra_jax.training import evaluate, loop
from tests.helpers import (WORDS, http_post, load_triton_model,
                           triton_request)

# A text every kind reads: its words and characters all occur in training.
TEXT = "the dog ran to the park and the bird sang\n"
PROMPT = "the cat sat"


def write_corpus(path, lines=240, seed=0):
  rng = np.random.default_rng(seed)
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(lines):
      start = rng.integers(0, len(WORDS) - 8)
      f.write(" ".join(WORDS[start:start + 8]) + "\n")


def tiny_config(kind, corpus):
  cfg = demo.get_config("tiny")
  cfg.data.update(source="text", path=str(corpus), tokenizer=kind,
                  bpe_vocab_size=300, seq_len=8)
  cfg.model.update(embed_size=16, hidden_size=16, num_layers=1)
  # A few steps, one checkpoint, no mid-run eval: the test stays fast.
  cfg.train.update(num_steps=3, eval_every=1000, eval_max_batches=2,
                   sample_at_eval=False)
  cfg.checkpoint.every_steps = 3
  cfg.eval.update(batch_size=8, seq_len=8)
  cfg.sample.update(prompt=PROMPT, max_new_tokens=6, temperature=0.0)
  return cfg


def check_saved_tokenizer(kind, folder):
  """Char and word write their own record; only BPE writes the HF file."""
  record = json.load(open(os.path.join(folder, "tokenizer.zebra.json")))
  assert record["kind"] == kind
  hf_file = os.path.join(folder, "tokenizer.json")
  if kind == "bpe":
    assert json.load(open(hf_file))["model"]["type"] == "BPE"
  else:
    assert not os.path.exists(hf_file)


def check_token_texts(kind, tokens):
  """The verbose token texts read back as the text (tokens[0] is unscored)."""
  if kind == "word":
    assert tokens == TEXT.split() + ["<eos>"]
  else:  # char and BPE tokens carry their own spaces
    assert "".join(tokens) == TEXT
    assert (len(tokens) == len(TEXT)) == (kind == "char")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_train_eval_score_sample_serve_export_triton(kind, tmp_path,
                                                     monkeypatch):
  if kind == "bpe":
    pytest.importorskip("tokenizers")
  write_corpus(tmp_path / "corpus.txt")
  cfg, workdir = tiny_config(kind, tmp_path / "corpus.txt"), str(
      tmp_path / "run")

  # train
  summary = loop.run(cfg, workdir)
  assert not summary["preempted"]
  check_saved_tokenizer(kind, os.path.join(workdir, "tokenizer"))

  # eval
  results = evaluate.run(cfg, workdir, "all")
  for split in ("valid", "test"):
    res = results[split]
    assert res["tokens"] > 0 and math.isfinite(res["ppl"]) and res["ppl"] > 1
    assert ("bpc" in res) == (kind == "char")

  # score, plain and --verbose
  [plain] = score.run(cfg, workdir, texts=[TEXT])
  [verbose] = score.run(cfg, workdir, texts=[TEXT], verbose=True)
  assert math.isfinite(plain["ppl"]) and plain["loss"] > 0
  assert plain["ppl"] == pytest.approx(math.exp(plain["loss"]))
  assert verbose["loss"] == plain["loss"] and ("bpc" in plain) == (
      kind == "char")
  logprobs = [lp for _, lp in verbose["token_logprobs"]]
  assert len(logprobs) == plain["tokens"]
  assert -sum(logprobs) / len(logprobs) == pytest.approx(plain["loss"])
  tokenizer = tokenizers.load(os.path.join(workdir, "tokenizer"))
  first = tokenizer.token_text(int(tokenizer.encode(TEXT)[0]))
  check_token_texts(kind, [first] + [t for t, _ in verbose["token_logprobs"]])
  if kind == "bpe":  # any text scores: bytes cover everything
    [other] = score.run(cfg, workdir, texts=["The module returns a list"])
    assert math.isfinite(other["loss"]) and other["tokens"] > 3

  # sample (greedy, as configured)
  [sampled] = sample.run(cfg, workdir)
  assert sampled.startswith(PROMPT) and len(sampled) > len(PROMPT)

  # serve: /score and /generate on an ephemeral port
  service = serve.Service(loading.load_for_inference(cfg, workdir),
                          serve.Limits.from_config(cfg))
  httpd = serve.make_server(service, "127.0.0.1", 0)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  try:
    status, out = http_post(httpd.server_port, "/score",
                       {"text": TEXT, "verbose": True})
    assert status == 200, out
    [served] = out["results"]
    assert served["tokens"] == plain["tokens"]
    assert served["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert [t for t, _ in served["token_logprobs"]] == [
        t for t, _ in verbose["token_logprobs"]]
    status, out = http_post(httpd.server_port, "/generate",
                       {"prompt": PROMPT, "max_new_tokens": 6,
                        "temperature": 0})
    assert status == 200, out
    assert out["texts"] == [sampled]
  finally:
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)

  # export, then the Triton model as its Python backend drives it
  export_dir = export.run(cfg, workdir, str(tmp_path / "export"))
  artifact = os.path.join(export_dir, "artifact")
  manifest = json.load(open(os.path.join(artifact, "manifest.json")))
  assert manifest["tokenizer"] == kind
  check_saved_tokenizer(kind, artifact)
  model_dir = os.path.join(export_dir, "triton", export.MODEL_NAME)
  triton_model = load_triton_model(model_dir, monkeypatch)
  [response] = triton_model.execute(
      [triton_request([PROMPT], MAX_NEW_TOKENS=6, TEMPERATURE=0.0)])
  assert response.error is None
  text, length = (t.as_numpy() for t in response.output_tensors[:2])
  assert bytes(text[0, :length[0, 0]]).decode() == sampled
  # The exported prompt function's logits are the JAX model's.
  loaded = service.loaded
  ids = tokenizer.encode_prompt(PROMPT)
  got, _ = triton_model.artifact.prompt_logits([ids.tolist()])
  logits, _ = lm.apply(loaded.graphdef, loaded.params, ids[None],
                       lm.init_carry(loaded.cfg.model, 1))
  np.testing.assert_allclose(np.asarray(got)[0], np.asarray(logits)[0, -1],
                             atol=1e-5)
  triton_model.finalize()
