"""Char, word and BPE tokenizers: vocab rules, round trips, prompts,
save/load, and the protocol every caller relies on."""

import json

from absl import logging
import ml_collections
import numpy as np
import pytest

from zebra_jax.data import pipeline, tokenizers
from zebra_jax.data.tokenizers import (BPESpec, CharSpec, CharTokenizer,
                                       WordSpec, WordTokenizer, word)
from zebra_jax.errors import UserError

# Counts: the 4, cat 3, sat 2, <eos> 3 (one per line, the empty one too),
# on 1, mat 1, a 1.
TRAIN = "the cat sat on the mat\n\nthe cat the cat sat a\n"


def test_word_vocab_order_and_specials():
  tok = WordTokenizer.build(TRAIN)
  # <unk>, <eos> first; then by descending count, ties alphabetical.
  assert tok.vocab == ["<unk>", "<eos>", "the", "cat", "sat", "a", "mat", "on"]
  assert (tok.unk_id, tok.eos_id, tok.vocab_size) == (0, 1, 8)
  assert tok.kind == "word"


def test_word_min_freq_and_max_vocab_size():
  assert WordTokenizer.build(TRAIN, WordSpec(min_freq=2)).vocab == [
      "<unk>", "<eos>", "the", "cat", "sat"]
  assert WordTokenizer.build(TRAIN, WordSpec(max_vocab_size=4)).vocab == [
      "<unk>", "<eos>", "the", "cat"]
  with pytest.raises(UserError, match="max_vocab_size=2"):
    WordTokenizer.build(TRAIN, WordSpec(max_vocab_size=2))


def test_word_encode_eos_per_line_and_unk():
  tok = WordTokenizer.build(TRAIN)
  ids = tok.encode("the dog\n\n  sat  \n")
  assert ids.dtype == np.int32
  words = [tok.vocab[i] for i in ids]
  assert words == ["the", "<unk>", "<eos>", "<eos>", "sat", "<eos>"]
  # A last line without "\n" still ends with <eos>, like a file iterator.
  assert tok.encode("the cat").tolist() == [2, 3, 1]
  assert tok.encode("").tolist() == []


def test_word_round_trip_and_decode():
  tok = WordTokenizer.build(TRAIN)
  assert tok.decode(tok.encode(TRAIN)) == TRAIN
  assert tok.decode([2, 3, 1, 4]) == "the cat\nsat"


def test_word_prompt_unknown_words_warn(monkeypatch):
  tok = WordTokenizer.build(TRAIN)
  warnings = []
  monkeypatch.setattr(logging, "warning",
                      lambda msg, *args: warnings.append(msg % args))
  ids = tok.encode_prompt("the zebra cat")
  assert ids.tolist() == [2, 0, 3]  # no <eos> at the end of a prompt
  assert len(warnings) == 1 and "zebra" in warnings[0]
  assert tok.encode_prompt("the\ncat").tolist() == [2, 1, 3]
  with pytest.raises(UserError, match="holds no words"):
    tok.encode_prompt("   ")


def test_char_vocab_round_trip_and_unk():
  text = "hello world\nhi\n"
  tok = CharTokenizer.build(text)
  assert tok.vocab == ["<unk>"] + sorted(set(text))
  assert tok.kind == "char"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.shape == (len(text),)
  assert ids.tolist() == [tok.vocab.index(c) for c in text]
  assert tok.decode(ids) == text
  # Characters absent from train (z, é, a non-BMP emoji) encode as <unk>.
  h = tok.vocab.index("h")
  assert tok.encode("hz\U0001F993é").tolist() == [h, 0, 0, 0]


def test_char_prompt_unknown_chars_raise():
  tok = CharTokenizer.build("hello\n")
  assert tok.encode_prompt("hell").tolist() == tok.encode("hell").tolist()
  with pytest.raises(UserError,
                     match=r"'Z', 'é'.*characters seen in training"):
    tok.encode_prompt("Zhé")


@pytest.mark.parametrize("kind", ["char", "word"])
def test_save_load_equality(tmp_path, kind):
  config = ml_collections.ConfigDict(
      dict(tokenizer=kind, min_freq=1, max_vocab_size=0))
  tok = tokenizers.build(pipeline.tokenizer_spec(config), TRAIN + "ünïcode\n")
  assert tok.spec == {"char": CharSpec, "word": WordSpec}[kind]()
  tok.save(str(tmp_path))
  loaded = tokenizers.load(str(tmp_path))
  assert type(loaded) is type(tok) and loaded == tok
  assert loaded.fingerprint() == tok.fingerprint()
  assert loaded.encode(TRAIN).tolist() == tok.encode(TRAIN).tolist()
  # Not the HF tokenizers format, so not under its file name.
  assert not (tmp_path / "tokenizer.json").exists()
  spec = json.loads((tmp_path / "tokenizer.zebra.json").read_text(
      encoding="utf-8"))
  assert spec["kind"] == kind and spec["vocab"] == tok.vocab


@pytest.mark.parametrize("kind", ["char", "word"])
def test_reads_folders_saved_before_the_record(tmp_path, kind):
  """Older workdirs kept the char/word record in a file named tokenizer.json."""
  tok = tokenizers.TOKENIZERS[kind].build(TRAIN)
  (tmp_path / "tokenizer.json").write_text(json.dumps(
      {"kind": kind, "min_freq": 1, "max_vocab_size": 0, "vocab": tok.vocab}),
      encoding="utf-8")
  assert tokenizers.has_saved(str(tmp_path))
  assert tokenizers.load(str(tmp_path)) == tok


def test_fingerprint_depends_on_vocab_and_kind():
  a, b = WordTokenizer.build(TRAIN), WordTokenizer.build(TRAIN, WordSpec(min_freq=2))
  assert a.fingerprint() == WordTokenizer.build(TRAIN).fingerprint()
  assert a.fingerprint() != b.fingerprint()
  assert a.fingerprint() != CharTokenizer.build(TRAIN).fingerprint()


def test_load_missing_or_corrupt(tmp_path):
  with pytest.raises(UserError, match="no tokenizer: train first"):
    tokenizers.load(str(tmp_path))
  (tmp_path / "tokenizer.zebra.json").write_text("{not json", encoding="utf-8")
  with pytest.raises(UserError, match="corrupt"):
    tokenizers.load(str(tmp_path))
  (tmp_path / "tokenizer.zebra.json").write_text('{"kind": "char"}',
                                                 encoding="utf-8")
  with pytest.raises(UserError, match="corrupt.*KeyError"):
    tokenizers.load(str(tmp_path))


def test_make_tokenizer_unknown_kind():
  config = ml_collections.ConfigDict(
      dict(tokenizer="sentencepiece", min_freq=1, max_vocab_size=0))
  with pytest.raises(UserError, match="data.tokenizer .sentencepiece. is unknown"):
    pipeline.tokenizer_spec(config)


def test_char_encode_round_trips_a_megabyte():
  # Speed is measured by lab/data_bench.py; here: a megabyte of text in one
  # vectorised call gives one id per character, exactly invertible.
  text = "".join(f"{i % 97} The quick brown fox jumps over the lazy dog.\n"
                 for i in range(22_000))  # ~1.1 MB, ASCII: 1 byte a char
  tok = CharTokenizer.build(text)
  ids = tok.encode(text)
  assert ids.shape == (len(text.encode("utf-8")),) and ids.dtype == np.int32
  assert len(np.unique(ids)) == len(set(text))  # one id per distinct char
  assert tok.decode(ids) == text


def test_word_pieces_equal_whole_text():
  """build/encode over pieces cut after "\\n" equal the whole-text results."""
  text = TRAIN + "no final newline"
  pieces = ["the cat sat on the mat\n", "\n", "the cat the cat sat a\n",
            "no final newline"]
  assert "".join(pieces) == text
  whole = WordTokenizer.build(text)
  assert WordTokenizer.build(iter(pieces)) == whole
  chunked = np.concatenate(list(whole.encode_chunks(pieces)))
  assert chunked.tolist() == whole.encode(text).tolist()
  assert CharTokenizer.build(iter(pieces)) == CharTokenizer.build(text)


def test_word_encode_in_worker_processes(monkeypatch):
  """The spawn pool gives the same ids, in order, as encoding in-process."""
  monkeypatch.setattr(word, "num_workers", lambda: 2)
  tok = WordTokenizer.build(TRAIN)
  pieces = [f"the cat {i} sat\n" * 3 for i in range(6)]
  pooled = np.concatenate(list(tok.encode_chunks(pieces)))
  assert pooled.tolist() == tok.encode("".join(pieces)).tolist()


BPE_TEXT = ("The zebra's stripes: 12 black, 12 white.\n\n  Ünïcode 🦓 too\n"
            * 40)


def bpe_config(size=300):
  return ml_collections.ConfigDict(dict(tokenizer="bpe", min_freq=1,
                                        max_vocab_size=0, bpe_vocab_size=size))


def test_bpe_trains_saves_reloads_and_round_trips(tmp_path):
  pytest.importorskip("tokenizers")
  tok = tokenizers.build(pipeline.tokenizer_spec(bpe_config()),
                         [BPE_TEXT[:500], BPE_TEXT[500:]])
  assert tok.kind == "bpe" and 256 < tok.vocab_size <= 300
  ids = tok.encode(BPE_TEXT)
  assert ids.dtype == np.int32 and len(ids) < len(BPE_TEXT.encode()) / 2
  assert tok.decode(ids) == BPE_TEXT
  unseen = "never seen: Ω ≈ ∑ 😀\n"  # bytes: nothing is unknown
  assert tok.decode(tok.encode(unseen)) == unseen
  assert tok.decode(tok.encode_prompt("The zebra")) == "The zebra"
  tok.save(str(tmp_path))
  spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
  assert spec["model"]["type"] == "BPE"  # the HF tokenizers format
  loaded = tokenizers.load(str(tmp_path))
  assert loaded == tok and loaded.fingerprint() == tok.fingerprint()
  assert loaded.spec == BPESpec(bpe_vocab_size=300)
  assert loaded.spec == pipeline.tokenizer_spec(bpe_config())
  assert loaded.encode(BPE_TEXT).tolist() == ids.tolist()
  with pytest.raises(UserError, match="bpe_vocab_size=100"):
    tokenizers.build(pipeline.tokenizer_spec(bpe_config(100)), BPE_TEXT)
  # A folder from before the record: HF file + bpe_settings.json.
  (tmp_path / "tokenizer.zebra.json").unlink()
  (tmp_path / "bpe_settings.json").write_text(
      '{"tokenizer": "bpe", "bpe_vocab_size": 300}', encoding="utf-8")
  assert tokenizers.load(str(tmp_path)) == tok


def test_protocol_capabilities_and_token_text():
  """What callers branch on instead of a kind name."""
  pytest.importorskip("tokenizers")
  char, wordtok = CharTokenizer.build(TRAIN), WordTokenizer.build(TRAIN)
  bpe = tokenizers.build(BPESpec(bpe_vocab_size=300), BPE_TEXT)
  for tok in (char, wordtok, bpe):
    assert isinstance(tok, tokenizers.Tokenizer)  # runtime_checkable
  assert (char.char_level, wordtok.char_level, bpe.char_level) == (
      True, False, False)
  assert (char.spaces_in_tokens, wordtok.spaces_in_tokens,
          bpe.spaces_in_tokens) == (True, False, True)
  assert [char.token_text(i) for i in char.encode("the c")] == list("the c")
  assert [wordtok.token_text(i) for i in wordtok.encode("the cat")] == [
      "the", "cat", "<eos>"]
  ids = bpe.encode("The zebra's stripes")
  assert "".join(bpe.token_text(i) for i in ids) == "The zebra's stripes"
  assert sorted(tokenizers.TOKENIZERS) == ["bpe", "char", "word"]
  assert CharSpec() != WordSpec() and WordSpec() == WordSpec(1, 0)
