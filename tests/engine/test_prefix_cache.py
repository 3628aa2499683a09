"""The prefix state cache: a cached start equals a cold one bit for bit,
the byte bound holds in LRU order, shared prefixes are computed once, and
new weights empty it."""

import dataclasses

import jax
import numpy as np
import pytest

from zebra_jax import engine
from zebra_jax.engine import prefix_cache, programs
from zebra_jax.inference import loading, sample

TEXT = "line 7: the quick brown fox jumps over the lazy dog. " * 3
CHUNK = 8


@pytest.fixture(scope="module")
def model(char_run):
  cfg, workdir = char_run
  return sample.Generator(loading.load_for_inference(cfg, workdir)
                          ).engine_model()


def _engine(model, cache_bytes, **sizes):
  options = dict(slots=6, queue=64, prefill_chunk=CHUNK, prefill_rows=3,
                 decode_block=3, prefix_cache_bytes=cache_bytes)
  return engine.Engine(model, **{**options, **sizes})


@pytest.fixture(scope="module")
def cold(model):
  e = _engine(model, 0)
  yield e
  e.close()


def _outcome(req) -> tuple:
  req.result(timeout=300)
  return (req.tokens, req.token_logprobs, req.top_logprobs,
          req.prompt_logprobs, req.prompt_top, req.prompt_ranks,
          req.finish_reason)


def _ids(n: int) -> np.ndarray:
  return np.frombuffer(TEXT.encode(), np.uint8)[:n].astype(np.int32) % 40


SAMPLED = engine.SamplingParams(max_new_tokens=9, temperature=1.0, seed=5,
                                logprobs=4, prompt_logprobs=3,
                                repetition_penalty=1.3)


def test_a_cached_start_equals_a_cold_start_bit_for_bit(model, cold):
  """Prompts sharing prefixes of every length around the chunk boundaries,
  each sent twice (the second starts from the cache), sampled with
  penalties and log-probabilities: every token, logprob and prompt logprob
  equals the cache-off engine's."""
  warm = _engine(model, 1 << 24)
  try:
    lengths = (5, 8, 9, 16, 17, 24, 31, 40, 41, 64, 100)
    kinds = (SAMPLED, dataclasses.replace(SAMPLED, prompt_logprobs=None),
             engine.SamplingParams(max_new_tokens=7, temperature=0.0))
    for params in kinds:
      for n in lengths:
        expected = _outcome(cold.submit("", params, ids=_ids(n)))
        for _ in range(2):
          got = _outcome(warm.submit("", params, ids=_ids(n)))
          assert got == expected, (n, params)
    stats = warm.stats()
    assert stats["prefix_cache_hits"] > sum(lengths)
    # prefill x2, restore, the decode variants at 1 token and at 4
    assert stats["compiled_programs"] == stats["startup_programs"] == (
        2 + 2 * len(engine.params.DECODE_VARIANTS) + 1)
  finally:
    warm.close()


def test_scoring_rows_take_their_prompt_logprobs_from_the_cache(model, cold):
  """max_new_tokens=0 with prompt logprobs (echo scoring): four choices
  after one context; the context is computed once and every choice's
  prompt logprobs equal a cold engine's."""
  warm = _engine(model, 1 << 24)
  try:
    params = engine.SamplingParams(max_new_tokens=0, prompt_logprobs=1)
    context = list(_ids(45))
    for choice in range(4):
      ids = np.array(context + [choice + 1, choice + 2])
      assert (_outcome(warm.submit("", params, ids=ids))
              == _outcome(cold.submit("", params, ids=ids)))
    # The first computes its 47 tokens, each other choice its last 7 (the
    # context's 40 in whole chunks come from the cache).
    assert warm.stats()["prefill_tokens"] == 47 + 3 * 7
  finally:
    warm.close()


def test_n_rows_and_shared_prefixes_are_prefilled_once(model, cold):
  warm = _engine(model, 1 << 24)
  try:
    rows = [engine.Row("", SAMPLED, ids=_ids(30), sample_index=i)
            for i in range(4)]
    together = [_outcome(r) for r in warm.submit_many(rows)]
    assert warm.stats()["prefill_tokens"] == 30
    assert together == [_outcome(r) for r in cold.submit_many(rows)]
    assert len({tuple(x[0]) for x in together}) > 1  # rows differ
    # Two prompts sharing 27 tokens: the shared 24 in whole chunks once.
    shared = list((_ids(27) + 1) % 40)  # not cached yet
    rows = [engine.Row("", SAMPLED, ids=np.array(shared + tail))
            for tail in ([3, 4], [5], [6, 7, 8])]
    before = warm.stats()["prefill_tokens"]
    together = [_outcome(r) for r in warm.submit_many(rows)]
    assert warm.stats()["prefill_tokens"] - before == 24 + 5 + 4 + 6
    assert together == [_outcome(r) for r in cold.submit_many(rows)]
  finally:
    warm.close()


def test_queries_and_hits_count_prompt_tokens(model):
  warm = _engine(model, 1 << 24)
  try:
    greedy = engine.SamplingParams(max_new_tokens=2, temperature=0.0)
    counts = lambda: tuple(warm.stats()[k] for k in (
        "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_entries"))
    warm.submit("", greedy, ids=_ids(20)).result(timeout=300)
    assert counts() == (20, 0, 3)  # ends at 8, 16 and the prompt's 20
    warm.submit("", greedy, ids=_ids(20)).result(timeout=300)
    assert counts() == (40, 20, 3)
    warm.submit("", greedy, ids=_ids(25)).result(timeout=300)
    assert counts() == (65, 36, 5)  # 16 found; new: 24 and the end, 25
    stats = warm.stats()
    assert stats["prompt_tokens"] == 65 and stats["prefill_tokens"] == 29
  finally:
    warm.close()


def test_new_weights_empty_the_cache(model):
  warm = _engine(model, 1 << 24)
  try:
    greedy = engine.SamplingParams(max_new_tokens=12, temperature=0.0,
                                   logprobs=1)
    old = _outcome(warm.submit("", greedy, ids=_ids(33)))
    assert warm.stats()["prefix_cache_entries"] == 5
    noisy = jax.tree.map(lambda a: a * 1.5, model.params)
    warm.set_params(noisy)
    new = _outcome(warm.submit("", greedy, ids=_ids(33)))
    stats = warm.stats()
    assert stats["prefix_cache_hits"] == 0
    assert stats["prefix_cache_entries"] == 5  # the new weights' only
    assert new != old
    reference = _engine(dataclasses.replace(model, params=noisy), 0)
    try:
      assert new == _outcome(reference.submit("", greedy, ids=_ids(33)))
    finally:
      reference.close()
  finally:
    warm.close()


def _entry(size: int) -> prefix_cache.Entry:
  return prefix_cache.Entry(carry=(np.zeros(size // 4 - 1, np.float32),),
                            logits=np.zeros(1, np.float32), tokens=8,
                            logprobs=None)


def test_the_byte_bound_holds_in_lru_order():
  cache = prefix_cache.PrefixCache(max_bytes=1000)
  for name in "abc":
    cache.put(name.encode(), _entry(300))
  assert cache.bytes == 900 and len(cache) == 3
  assert cache.get(b"a", with_logprobs=False) is not None  # a: most recent
  cache.put(b"d", _entry(300))  # evicts b, the least recently used
  assert [k for k in b"acd" if cache.has(bytes([k]), False)] == list(b"acd")
  assert not cache.has(b"b", False) and cache.bytes == 900
  cache.put(b"e", _entry(600))  # evicts c and a
  assert cache.has(b"d", False) and cache.has(b"e", False)
  assert len(cache) == 2 and cache.bytes == 900
  cache.put(b"f", _entry(2000))  # larger than the bound: not held
  assert not cache.has(b"f", False) and cache.bytes == 900
  with_logprobs = dataclasses.replace(_entry(100), logprobs=(
      np.zeros(8, np.float32),))
  cache.put(b"g", with_logprobs)
  cache.put(b"g", _entry(100))  # keeps the entry that has logprobs
  assert cache.get(b"g", with_logprobs=True) is not None
  assert cache.bytes <= 1000
  cache.clear()
  assert cache.bytes == 0 and len(cache) == 0


def test_a_small_bound_holds_under_traffic(model, cold):
  small = _engine(model, 3000)
  try:
    greedy = engine.SamplingParams(max_new_tokens=4, temperature=0.0)
    for n in range(10, 60, 7):
      assert (_outcome(small.submit("", greedy, ids=_ids(n)))
              == _outcome(cold.submit("", greedy, ids=_ids(n))))
      stats = small.stats()
      assert 0 < stats["prefix_cache_bytes"] <= 3000
  finally:
    small.close()


def test_a_prompt_scored_from_the_cache_alone_is_not_restored(model, cold):
  """max_tokens=0 with every chunk cached (lm-eval's repeated context):
  the row ends at the lookup, equal to a cold start, with no restore call
  (its state would never be read)."""
  warm = _engine(model, 1 << 24)
  try:
    restores, restore = [], warm._restore  # pylint: disable=protected-access

    def counted(*args):
      restores.append(args)
      return restore(*args)
    warm._restore = counted  # pylint: disable=protected-access
    scoring = engine.SamplingParams(max_new_tokens=0, prompt_logprobs=2)
    expected = _outcome(cold.submit("", scoring, ids=_ids(40)))
    assert _outcome(warm.submit("", scoring, ids=_ids(40))) == expected
    assert _outcome(warm.submit("", scoring, ids=_ids(40))) == expected
    assert not restores
    assert _outcome(warm.submit("", scoring, ids=_ids(44))) == _outcome(
        cold.submit("", scoring, ids=_ids(44)))
    assert len(restores) == 1  # 40 tokens restored, the last 4 computed
  finally:
    warm.close()


def test_packed_rows_unpack_to_the_carry_and_logits_bit_for_bit():
  """A prefill call's states come back packed in one array (one fetch):
  each row unpacks to its own copies of the very bits."""
  carry = ((np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32),
            np.arange(6, dtype=np.float32).reshape(3, 2)),)
  logits = np.random.default_rng(1).normal(size=(3, 7)).astype(np.float32)
  packed = np.asarray(programs.pack_rows(carry, logits))
  for i in range(3):
    leaves, row_logits = programs.unpack_row(packed[i], carry)
    assert [leaf.tobytes() for leaf in leaves] == [
        leaf[i].tobytes() for leaf in jax.tree.leaves(carry)]
    assert row_logits.tobytes() == logits[i].tobytes()
    assert not any(np.shares_memory(a, packed) for a in (*leaves, row_logits))
