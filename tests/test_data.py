"""Token caching in the workdir, and the stream / random-window batchers."""

import json
import os

import ml_collections
import numpy as np
import pytest

from zebra_jax import corpus
from zebra_jax import data
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
  tok, ids = data.prepare_data(config, workdir)
  # 10 lines: train = 6, valid = 2, test = 2; each line is 4 words + <eos>.
  assert {k: len(v) for k, v in ids.items()} == {"train": 30, "valid": 10,
                                                 "test": 10}
  assert all(v.dtype == np.int32 for v in ids.values())
  assert tok.decode(ids["valid"]) == "the cat 0 sat\nthe cat 1 sat\n"
  manifest = json.loads((tmp_path / "run/data/manifest.json").read_text())
  assert manifest["num_tokens"]["train"] == 30
  assert manifest["tokenizer_fingerprint"] == tok.fingerprint()
  assert os.path.isfile(tmp_path / "run/tokenizer/tokenizer.json")

  def no_reading(_):
    raise AssertionError("the corpus was read although the cache matched")

  monkeypatch.setattr(corpus, "load_splits", no_reading)
  tok2, ids2 = data.prepare_data(config, workdir)
  assert tok2 == tok
  assert isinstance(ids2["train"], np.memmap)
  for name in corpus.SPLITS:
    np.testing.assert_array_equal(ids2[name], ids[name])


def test_changed_source_is_reencoded_with_the_saved_tokenizer(tmp_path,
                                                              text_file):
  config, workdir = make_config(text_file), str(tmp_path / "run")
  tok, _ = data.prepare_data(config, workdir)
  text_file.write_text("the dog sat\n" * 10, encoding="utf-8")
  tok2, ids = data.prepare_data(config, workdir)
  assert tok2 == tok  # the vocab is the run's, so "dog" is unknown now
  assert ids["train"][:4].tolist() == [tok.token_to_id["the"], tok.unk_id,
                                       tok.token_to_id["sat"], tok.eos_id]


def test_tokenizer_mismatch_is_a_user_error(tmp_path, text_file):
  workdir = str(tmp_path / "run")
  data.prepare_data(make_config(text_file), workdir)
  with pytest.raises(UserError,
                     match="made with tokenizer=word.*new --workdir"):
    data.prepare_data(make_config(text_file, tokenizer="char"), workdir)
  with pytest.raises(UserError, match="min_freq=1.*min_freq=2"):
    data.prepare_data(make_config(text_file, min_freq=2), workdir)


def test_load_eval_data_needs_a_trained_workdir(tmp_path, text_file):
  config, workdir = make_config(text_file), str(tmp_path / "run")
  with pytest.raises(UserError, match="has no tokenizer.*train first"):
    data.load_eval_data(config, workdir)
  tok, ids = data.prepare_data(config, workdir)
  tok2, ids2 = data.load_eval_data(config, workdir)
  assert tok2 == tok
  np.testing.assert_array_equal(ids2["test"], ids["test"])


def test_stream_batcher_matches_reshape():
  ids = np.arange(27, dtype=np.int32)  # 3 rows of 9, nothing trimmed
  batcher = data.StreamBatcher(ids, batch_size=3, seq_len=2)
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
  batcher = data.StreamBatcher(ids, batch_size=4, seq_len=5)  # rows of 25
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
      data.StreamBatcher(ids, 4, 5).get(3)[0], batcher.get(3)[0])


def test_stream_batcher_process_slices():
  ids = np.arange(8 * 11, dtype=np.int32)
  full_inputs, full_targets = data.StreamBatcher(ids, 8, 5).get(1)
  for p in range(4):
    local = data.StreamBatcher(ids, 8, 5, process_index=p, process_count=4)
    assert local.local_batch_size == 2
    inputs, targets = local.get(1)
    np.testing.assert_array_equal(inputs, full_inputs[2 * p:2 * p + 2])
    np.testing.assert_array_equal(targets, full_targets[2 * p:2 * p + 2])
  with pytest.raises(UserError, match="multiple of the process count 3"):
    data.StreamBatcher(ids, 8, 5, process_index=0, process_count=3)


def test_too_short_split_is_a_user_error():
  with pytest.raises(UserError, match="50 tokens.*batch_size=10.*seq_len=5"):
    data.StreamBatcher(np.arange(50, dtype=np.int32), 10, 5)  # rows of 5 < 6
  with pytest.raises(UserError, match="5 tokens.*seq_len=5"):
    data.RandomWindowBatcher(np.arange(5, dtype=np.int32), 2, 5, seed=0)


def test_random_batcher_is_deterministic_per_seed_and_index():
  ids = np.arange(1000, dtype=np.int32)
  a = data.RandomWindowBatcher(ids, batch_size=4, seq_len=8, seed=1)
  b = data.RandomWindowBatcher(ids, batch_size=4, seq_len=8, seed=1)
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
  other_seed = data.RandomWindowBatcher(ids, 4, 8, seed=2)
  assert not np.array_equal(other_seed.get(5)[0], inputs)
  local = data.RandomWindowBatcher(ids, 4, 8, seed=1, process_index=1,
                                   process_count=2)
  np.testing.assert_array_equal(local.get(5)[0], inputs[2:])


def test_make_batcher_and_position():
  config = make_config("", batching="random", batch_size=2, seq_len=3).data
  ids = np.arange(40, dtype=np.int32)
  assert isinstance(data.make_batcher(config, ids, seed=0),
                    data.RandomWindowBatcher)
  config.batching = "streams"
  assert isinstance(data.make_batcher(config, ids, seed=0), data.StreamBatcher)
  config.batching = "shuffle"
  with pytest.raises(UserError, match="data.batching 'shuffle' is unknown"):
    data.make_batcher(config, ids, seed=0)

  position = data.DataPosition()
  seen = []
  for _ in range(5):
    seen.append((position.epoch, position.index))
    position = position.advance(batches_per_epoch=2)
  assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
  assert data.DataPosition.from_dict(position.to_dict()) == position
  assert json.loads(json.dumps(position.to_dict())) == {"epoch": 2, "index": 1}
