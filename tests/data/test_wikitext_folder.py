"""A WikiText folder read as a long corpus is: in worker processes, with
progress, and stopped by a bad byte with one line and nothing after it; and
the synthetic WikiText-103-shaped folder the memory runs use."""

import collections
import os
import subprocess
import sys

import pytest

from zebra_jax.configs import wt103
from zebra_jax.data import pipeline, splits, tokenizers
from zebra_jax.data.sources import synthetic_wikitext
from zebra_jax.data.tokenizers import word
from tests.helpers import REPO, write_wikitext

# The CLI with 2 KB pieces: a small folder then spans several pieces, so
# words are counted in worker processes as a 0.5 GB split's are.
_SMALL_PIECES_CLI = (
    "import sys; from zebra_jax.data import splits; "
    "splits.CHUNK_BYTES = 2048; from zebra_jax import main; "
    "sys.argv[0] = 'zebra-jax'; main.run()")


def test_a_bad_byte_stops_with_one_line_and_no_warning(tmp_path):
  folder = str(write_wikitext(tmp_path / "wt"))
  path = os.path.join(folder, "wiki.train.tokens")
  data = open(path, "rb").read()
  with open(path, "wb") as f:  # a Latin-1 "é" past the first two pieces
    f.write(data[:6000] + b"caf\xe9\n" + data[6000:])
  bad_at = 6000 + len(b"caf")
  out = subprocess.run(
      [sys.executable, "-c", _SMALL_PIECES_CLI, "--config=wt103:tiny",
       f"--workdir={tmp_path / 'run'}", f"--config.data.path={folder}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  lines = [l for l in out.stderr.splitlines() if l.strip()]
  # Nothing after the error: no traceback, no resource_tracker warning
  # about the worker pool's semaphores.
  assert len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith("error: ") and path in lines[0]
  assert f"bad byte 0xe9 at byte offset {bad_at}" in lines[0]


def test_counting_the_vocabulary_prints_progress_lines(tmp_path, capsys,
                                                       monkeypatch):
  """Off a terminal the word count (tens of seconds on WikiText-103) says
  how far it is, as tokenizing does."""
  monkeypatch.setattr(pipeline, "_LINE_EVERY_S", 0.0)  # a line per piece
  monkeypatch.setattr(splits, "CHUNK_BYTES", 2048)
  folder = str(write_wikitext(tmp_path / "wt"))
  cfg = wt103.get_config("tiny")
  cfg.data.path = folder
  tokenizer, ids = pipeline.prepare_data(cfg, str(tmp_path / "run"))
  size = os.path.getsize(os.path.join(folder, "wiki.train.tokens"))
  lines = [l for l in capsys.readouterr().err.splitlines()
           if l.startswith("word vocabulary: ")]
  assert len(lines) >= 3, lines
  assert "ETA" in lines[0] and f"/{size:,} B (" in lines[0]
  assert lines[-1].startswith(f"word vocabulary: {size:,} B in ")
  assert tokenizer.vocab_size > 20 and len(ids["train"]) > 1000


def test_synthetic_folder_has_the_vocabulary_and_zipf_counts(tmp_path):
  folder = str(tmp_path / "syn")
  synthetic_wikitext.write_folder(folder, train_tokens=60_000,
                                  vocab_size=3_000, seed=1)
  train = splits.file_split("train", f"{folder}/wiki.train.tokens")
  tokenizer = tokenizers.build(word.WordSpec(), train.chunks())
  assert tokenizer.vocab_size == 3_000  # every word, <unk> and <eos>
  ids = tokenizer.encode(train.text())
  assert 60_000 <= len(ids) < 60_000 + 2 * 3_000  # + lines of missed words
  counts = collections.Counter(ids.tolist())
  first, tenth = (tokenizer.token_to_id[w]
                  for w in synthetic_wikitext.words(10)[::9])
  assert counts[first] / counts[tenth] == pytest.approx(10, rel=0.15)  # Zipf
  eos = counts[tokenizer.eos_id] / len(ids)
  assert eos == pytest.approx(1 / 57, rel=0.2)  # WikiText's line length
  for split in ("valid", "test"):
    assert os.path.getsize(f"{folder}/wiki.{split}.tokens") > 1000
