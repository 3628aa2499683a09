"""Token caching in the workdir, and the stream / random-window batchers."""

import json
import os

import ml_collections
import numpy as np
import pytest

from zebra_jax.data import id_cache, pipeline, sources, splits
from zebra_jax.errors import UserError


def make_config(path, **data_overrides) -> ml_collections.ConfigDict:
  d = dict(source="text", path=str(path), tokenizer="word", min_freq=1,
           max_vocab_size=0, valid_fraction=0.2, test_fraction=0.2,
           batching="streams", batch_size=2, seq_len=3)
  d.update(data_overrides)
  return ml_collections.ConfigDict(dict(seed=0, data=d))


@pytest.fixture
def text_file(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("".join(f"the cat {i % 3} sat\n" for i in range(10)),
                  encoding="utf-8")
  return path


def test_prepare_data_writes_and_reuses_cache(tmp_path, text_file, monkeypatch):
  config, workdir = make_config(text_file), str(tmp_path / "run")
  tok, ids = pipeline.prepare_data(config, workdir)
  # 10 lines: train = 6, valid = 2, test = 2; each line is 4 words + <eos>.
  assert {k: len(v) for k, v in ids.items()} == {"train": 30, "valid": 10,
                                                 "test": 10}
  assert all(v.dtype == np.int32 for v in ids.values())
  assert tok.decode(ids["valid"]) == "the cat 0 sat\nthe cat 1 sat\n"
  manifest = json.loads((tmp_path / "run/data/manifest.json").read_text())
  assert manifest["num_tokens"]["train"] == 30
  assert manifest["tokenizer_fingerprint"] == tok.fingerprint()
  assert os.path.isfile(tmp_path / "run/tokenizer/tokenizer.zebra.json")

  def no_reading(_):
    raise AssertionError("the corpus was read although the cache matched")

  monkeypatch.setattr(sources.TextSource, "open", no_reading)
  tok2, ids2 = pipeline.prepare_data(config, workdir)
  assert tok2 == tok
  assert isinstance(ids2["train"], np.memmap)
  for name in splits.SPLITS:
    np.testing.assert_array_equal(ids2[name], ids[name])


def test_changed_source_is_reencoded_with_the_saved_tokenizer(tmp_path,
                                                              text_file):
  config, workdir = make_config(text_file), str(tmp_path / "run")
  tok, _ = pipeline.prepare_data(config, workdir)
  text_file.write_text("the dog sat\n" * 10, encoding="utf-8")
  tok2, ids = pipeline.prepare_data(config, workdir)
  assert tok2 == tok  # the vocab is the run's, so "dog" is unknown now
  assert ids["train"][:4].tolist() == [tok.token_to_id["the"], tok.unk_id,
                                       tok.token_to_id["sat"], tok.eos_id]


def test_tokenizer_mismatch_is_a_user_error(tmp_path, text_file):
  workdir = str(tmp_path / "run")
  pipeline.prepare_data(make_config(text_file), workdir)
  with pytest.raises(UserError,
                     match="made with tokenizer=word.*new --workdir"):
    pipeline.prepare_data(make_config(text_file, tokenizer="char"), workdir)
  with pytest.raises(UserError, match="min_freq=1.*min_freq=2"):
    pipeline.prepare_data(make_config(text_file, min_freq=2), workdir)


def test_load_eval_data_needs_a_trained_workdir(tmp_path, text_file):
  config, workdir = make_config(text_file), str(tmp_path / "run")
  with pytest.raises(UserError, match="has no tokenizer.*train first"):
    pipeline.load_eval_data(config, workdir)
  tok, ids = pipeline.prepare_data(config, workdir)
  tok2, ids2 = pipeline.load_eval_data(config, workdir)
  assert tok2 == tok
  np.testing.assert_array_equal(ids2["test"], ids["test"])


def test_stream_batcher_matches_reshape():
  ids = np.arange(27, dtype=np.int32)  # 3 rows of 9, nothing trimmed
  batcher = pipeline.StreamBatcher(ids, batch_size=3, seq_len=2)
  rows = ids.reshape(3, 9)
  assert batcher.batches_per_epoch == 4  # (9 - 1) // 2
  for i in range(4):
    inputs, targets = batcher.get(i)
    assert inputs.dtype == np.int32 and inputs.shape == (3, 2)
    np.testing.assert_array_equal(inputs, rows[:, 2 * i:2 * i + 2])
    np.testing.assert_array_equal(targets, rows[:, 2 * i + 1:2 * i + 3])
  with pytest.raises(IndexError):
    batcher.get(4)


def test_stream_batcher_rows_continue_and_tail_is_trimmed():
  ids = np.arange(100, dtype=np.int32)
  batcher = pipeline.StreamBatcher(ids, batch_size=4, seq_len=5)  # rows of 25
  assert batcher.batches_per_epoch == 4  # (25 - 1) // 5
  first, _ = batcher.get(0)
  np.testing.assert_array_equal(first[:, 0], [0, 25, 50, 75])
  for i in range(batcher.batches_per_epoch - 1):
    inputs, targets = batcher.get(i)
    next_inputs, _ = batcher.get(i + 1)
    np.testing.assert_array_equal(next_inputs[:, 0], inputs[:, -1] + 1)
    np.testing.assert_array_equal(targets, inputs + 1)
  ids = np.arange(103, dtype=np.int32)  # 3 extra tokens: dropped
  np.testing.assert_array_equal(
      pipeline.StreamBatcher(ids, 4, 5).get(3)[0], batcher.get(3)[0])


def test_stream_batcher_process_slices():
  ids = np.arange(8 * 11, dtype=np.int32)
  full_inputs, full_targets = pipeline.StreamBatcher(ids, 8, 5).get(1)
  for p in range(4):
    local = pipeline.StreamBatcher(ids, 8, 5, process_index=p, process_count=4)
    assert local.local_batch_size == 2
    inputs, targets = local.get(1)
    np.testing.assert_array_equal(inputs, full_inputs[2 * p:2 * p + 2])
    np.testing.assert_array_equal(targets, full_targets[2 * p:2 * p + 2])
  with pytest.raises(UserError, match="multiple of the process count 3"):
    pipeline.StreamBatcher(ids, 8, 5, process_index=0, process_count=3)


def test_too_short_split_is_a_user_error():
  with pytest.raises(UserError, match="50 tokens.*batch_size=10.*seq_len=5"):
    pipeline.StreamBatcher(np.arange(50, dtype=np.int32), 10, 5)  # rows of 5 < 6
  with pytest.raises(UserError, match="5 tokens.*seq_len=5"):
    pipeline.RandomWindowBatcher(np.arange(5, dtype=np.int32), 2, 5, seed=0)


def test_random_batcher_is_deterministic_per_seed_and_index():
  ids = np.arange(1000, dtype=np.int32)
  a = pipeline.RandomWindowBatcher(ids, batch_size=4, seq_len=8, seed=1)
  b = pipeline.RandomWindowBatcher(ids, batch_size=4, seq_len=8, seed=1)
  assert a.batches_per_epoch == 1000 // 32
  inputs, targets = a.get(5)
  assert inputs.shape == (4, 8) and inputs.dtype == np.int32
  np.testing.assert_array_equal(targets, inputs + 1)  # arange: shift = +1
  np.testing.assert_array_equal(np.diff(inputs, axis=1), 1)  # contiguous
  assert inputs.min() >= 0 and targets.max() <= 999
  # Resuming at index 5 gives what the uninterrupted run saw.
  for _ in range(3):
    b.get(0)
  np.testing.assert_array_equal(b.get(5)[0], inputs)
  assert not np.array_equal(a.get(6)[0], inputs)
  assert not np.array_equal(a.get(5, epoch=1)[0], inputs)
  other_seed = pipeline.RandomWindowBatcher(ids, 4, 8, seed=2)
  assert not np.array_equal(other_seed.get(5)[0], inputs)
  local = pipeline.RandomWindowBatcher(ids, 4, 8, seed=1, process_index=1,
                                   process_count=2)
  np.testing.assert_array_equal(local.get(5)[0], inputs[2:])


def test_make_batcher_and_position():
  config = make_config("", batching="random", batch_size=2, seq_len=3).data
  ids = np.arange(40, dtype=np.int32)
  assert isinstance(pipeline.make_batcher(config, ids, seed=0),
                    pipeline.RandomWindowBatcher)
  config.batching = "streams"
  assert isinstance(pipeline.make_batcher(config, ids, seed=0), pipeline.StreamBatcher)
  config.batching = "shuffle"
  with pytest.raises(UserError, match="data.batching 'shuffle' is unknown"):
    pipeline.make_batcher(config, ids, seed=0)

  position = pipeline.DataPosition()
  seen = []
  for _ in range(5):
    seen.append((position.epoch, position.index))
    position = position.advance(batches_per_epoch=2)
  assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
  assert pipeline.DataPosition.from_dict(position.to_dict()) == position
  assert json.loads(json.dumps(position.to_dict())) == {"epoch": 2, "index": 1}


def synthetic_wikitext(folder, num_tokens: int, vocab: int = 50_000,
                       words_per_line: int = 20):
  """A WikiText-format folder of `num_tokens` words, made with numpy in
  about a second: 6-letter words with log-uniform (Zipf-like) ids."""
  rng = np.random.default_rng(0)
  ids = (vocab ** rng.random(num_tokens)).astype(np.int64) - 1
  letters = np.empty((num_tokens, 7), np.uint8)
  for k in range(5, -1, -1):
    letters[:, k] = 97 + ids % 26
    ids //= 26
  letters[:, 6] = ord(" ")
  letters[words_per_line - 1::words_per_line, 6] = ord("\n")
  letters[-1, 6] = ord("\n")
  text = letters.tobytes().decode("ascii")
  folder.mkdir()
  (folder / "wiki.train.tokens").write_text(text, encoding="ascii")
  for split in ("valid", "test"):
    (folder / f"wiki.{split}.tokens").write_text(text[:7000], encoding="ascii")
  return text


# 10M tokens, a large corpus's scale: ~17 s on 2 busy cores (count ~1.3M tokens/s,
# encode ~1.2M tokens/s per core, both in spawn workers when cores allow).
BIG_TOKENS = 10_000_000


def test_big_corpus_caches_once_and_is_reused(tmp_path, monkeypatch):
  synthetic_wikitext(tmp_path / "wt", BIG_TOKENS)
  config = make_config(tmp_path / "wt", source="wikitext")
  workdir = str(tmp_path / "run")
  monkeypatch.setattr(splits, "CHUNK_BYTES", 1 << 22)  # ~10 pieces
  tok, ids = pipeline.prepare_data(config, workdir)
  assert isinstance(ids["train"], np.memmap)
  # 20 words + <eos> per line.
  assert len(ids["train"]) == BIG_TOKENS // 20 * 21
  assert ids["train"][20] == tok.eos_id and ids["train"][41] == tok.eos_id
  assert tok.vocab_size > 10_000 and tok.unk_id not in ids["train"][:1000]
  first = tok.decode(ids["train"][:21]).split()
  text_start = (tmp_path / "wt" / "wiki.train.tokens").read_text()[:200]
  assert first == text_start.split()[:20]

  def no_reading(_):
    raise AssertionError("the corpus was read although the cache matched")

  monkeypatch.setattr(sources, "open_splits", no_reading)
  tok2, ids2 = pipeline.prepare_data(config, workdir)
  assert tok2 == tok
  np.testing.assert_array_equal(ids2["train"][-1000:], ids["train"][-1000:])


def test_streamed_npy_header_is_patched(tmp_path):
  path = str(tmp_path / "x.npy")

  class NoProgress:
    def add_tokens(self, n):
      del n

  arrays = [np.arange(5, dtype=np.int32), np.arange(0, dtype=np.int32),
            np.arange(7, dtype=np.int64)]
  assert id_cache.stream_npy(path, arrays, NoProgress()) == 12
  loaded = np.load(path, mmap_mode="r")
  assert loaded.dtype == np.int32
  assert loaded.tolist() == list(range(5)) + list(range(7))


def test_bpe_prepare_data_and_settings_check(tmp_path, text_file):
  pytest.importorskip("tokenizers")
  config = make_config(text_file, tokenizer="bpe", bpe_vocab_size=280)
  workdir = str(tmp_path / "run")
  tok, ids = pipeline.prepare_data(config, workdir)
  assert tok.kind == "bpe"
  assert tok.decode(ids["valid"]) == "the cat 0 sat\nthe cat 1 sat\n"
  assert pipeline.prepare_data(config, workdir)[0] == tok
  config.data.bpe_vocab_size = 400
  with pytest.raises(UserError, match="bpe_vocab_size=280.*bpe_vocab_size=400"):
    pipeline.prepare_data(config, workdir)


def test_file_split_pieces_cut_after_newlines(tmp_path, monkeypatch):
  monkeypatch.setattr(splits, "CHUNK_BYTES", 8)
  path = tmp_path / "f.txt"
  text = "\ufeffab\r\ncdefghijklmnop\nq\n\nr é s\nno end"
  path.write_bytes(text.encode("utf-8"))
  split = splits.file_split("train", str(path))
  pieces = list(split.chunks())
  assert "".join(pieces) == text[1:].replace("\r\n", "\n")
  assert all(p.endswith("\n") for p in pieces[:-1]) and len(pieces) > 3
  assert split.size == os.path.getsize(path) and split.unit == "B"
  path.write_bytes(b"ok\nfine line\n\xff bad\n")
  with pytest.raises(UserError, match="byte offset 13"):
    list(splits.file_split("train", str(path)).chunks())


def test_tokenizing_off_a_terminal_prints_progress_lines(tmp_path, capsys,
                                                         monkeypatch):
  """In a batch job's log, tokenizing shows its rate and ETA as it goes."""
  from zebra_jax.data import tokenizers
  from zebra_jax.data.tokenizers.char import CharSpec
  monkeypatch.setattr(id_cache, "_LINE_EVERY_S", 0.0)  # a line per piece
  monkeypatch.setattr(splits, "CHUNK_BYTES", 64)  # several pieces per split
  text = "".join(f"line {i}: some words to tokenize.\n" for i in range(200))
  parts = {name: splits.in_memory_split(name, text) for name in splits.SPLITS}
  tokenizer = tokenizers.build(CharSpec(), parts["train"].chunks())
  id_cache.IdCache(str(tmp_path)).write(parts, "fp", tokenizer)
  lines = [l for l in capsys.readouterr().err.splitlines()
           if l.startswith("tokenizing train:")]
  assert len(lines) >= 3, lines
  assert all("tokens/s" in l for l in lines[:-1])
  assert "ETA" in lines[-2] and lines[-1].endswith(" s")
  assert f"{len(text):,} tokens in" in lines[-1]  # char: one token a char
