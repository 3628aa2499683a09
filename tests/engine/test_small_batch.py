"""Small batches decode several blocks per call (small_batch_blocks): every
token, log-probability, finish and streamed piece equals the engine that
decodes one token per call, whichever call a row ends in."""

import dataclasses
import threading

import pytest

from zebra_jax import engine
from zebra_jax.inference import loading, sample
from tests import helpers

PROMPT = "line 7: the "
LATE_PROMPT = "the quick brown fox jumps"  # 4 prefill chunks, none cached
# Lengths no block divides, so rows end inside a call; every group of the
# decode math (filters, penalties, logit bias, allowed tokens, min_tokens,
# log-probabilities), greedy and sampled.
PARAMS = [
    engine.SamplingParams(max_new_tokens=13, temperature=0.0),
    engine.SamplingParams(max_new_tokens=11, temperature=0.9, seed=1),
    engine.SamplingParams(max_new_tokens=17, temperature=0.7, top_k=5,
                          top_p=0.8, min_p=0.05, seed=2, logprobs=3),
    engine.SamplingParams(max_new_tokens=9, temperature=1.1, seed=3,
                          repetition_penalty=1.4, presence_penalty=0.5,
                          frequency_penalty=0.3, logit_bias=((3, 2.0),),
                          logprobs=2),
    engine.SamplingParams(max_new_tokens=14, temperature=0.0,
                          allowed_token_ids=(3, 5, 9, 11, 20), logprobs=1),
    engine.SamplingParams(max_new_tokens=19, temperature=1.0, seed=4,
                          min_tokens=3, stop_token_ids=(5, 9, 14, 20)),
    engine.SamplingParams(max_new_tokens=23, temperature=0.8, seed=5,
                          stop=("e ", "o", "x"), logprobs=2),
    engine.SamplingParams(max_new_tokens=21, temperature=0.0,
                          stop=("the",), min_tokens=2),
]


@pytest.fixture(scope="module")
def model(char_run):
  cfg, workdir = char_run
  return sample.Generator(loading.load_for_inference(cfg, workdir)
                          ).engine_model()


def _engine(model, **sizes):
  options = dict(slots=4, queue=64, prefill_chunk=8, prefill_rows=2,
                 decode_block=1, small_batch_rows=4)
  return engine.Engine(model, **{**options, **sizes})


@pytest.fixture(scope="module")
def one_token(model):
  """The reference: one token per decode call."""
  e = _engine(model, small_batch_blocks=1)
  yield e
  e.close()


@pytest.fixture(scope="module")
def five_tokens(model):
  e = _engine(model, small_batch_blocks=5)
  yield e
  e.close()


def _streamed(e, rows: list[engine.Row]) -> list[tuple]:
  """Submits `rows` as one request; each row's tokens, log-probabilities,
  finish, usage and what it streamed (text, and the token ranges)."""
  pieces = [[] for _ in rows]
  rows = [dataclasses.replace(row, on_text=lambda d, t, p=p: p.append((d, t)))
          for row, p in zip(rows, pieces)]
  requests = e.submit_many(rows)
  outcomes = []
  for req, streamed in zip(requests, pieces):
    text = req.result(timeout=300)
    assert "".join(d for d, _ in streamed) == text
    released = [i for _, t in streamed for i in t]
    assert released == list(range(req.completion_tokens))
    outcomes.append((text, req.tokens, req.token_logprobs, req.top_logprobs,
                     req.finish_reason, req.stop_token,
                     req.completion_tokens))
  return outcomes


def _outcome(req) -> tuple:
  return (req.result(timeout=300), req.tokens, req.token_logprobs,
          req.top_logprobs, req.finish_reason, req.completion_tokens)


def test_the_program_count_is_stated(one_token, five_tokens):
  # prefill x2, restore, the decode variants at each block length
  variants = len(engine.params.DECODE_VARIANTS)
  assert one_token.decode_blocks() == (1,)
  assert one_token.startup_programs == 3 + variants
  assert five_tokens.decode_blocks() == (1, 5)
  assert five_tokens.startup_programs == 3 + 2 * variants
  off = _engine(one_token.model, small_batch_blocks=3, prefix_cache_bytes=0)
  try:
    assert off.startup_programs == 2 + 2 * variants
  finally:
    off.close()


def test_each_row_alone_equals_one_token_per_call(one_token, five_tokens):
  """Greedy and sampled, every feature, n=2, rows that end by length, stop
  token and stop string inside a call: the same bits, the same stream."""
  before = five_tokens.stats()["small_batch_steps"]
  for params in PARAMS:
    rows = [engine.Row(PROMPT, params, sample_index=i) for i in range(2)]
    assert _streamed(five_tokens, rows) == _streamed(one_token, rows), params
  reasons = {o[4] for p in PARAMS
             for o in _streamed(one_token, [engine.Row(PROMPT, p)])}
  assert reasons == {"length", "stop"}
  assert five_tokens.stats()["small_batch_steps"] > before


def test_rows_together_equal_one_token_per_call(one_token, five_tokens):
  """Four rows in one request (the small batch's bound): each ends where it
  ends with one token per call."""
  rows = [engine.Row(PROMPT[:3 + i], p) for i, p in enumerate(PARAMS[2:6])]
  assert _streamed(five_tokens, rows) == _streamed(one_token, rows)


def test_a_request_arriving_mid_run_waits_one_call(model, one_token):
  """A row decodes in long calls; a request with a 4-chunk prompt arrives:
  it is admitted after at most the call under way, its prompt fills
  between calls of decode_block tokens, and both rows' bits are the
  reference's."""
  e = _engine(model, small_batch_blocks=5)
  calls, arrived = [], threading.Event()
  decode, prefill = e._decode, e._prefill

  def record_decode(params, state, active, features, block):
    calls.append(("decode", block, arrived.is_set()))
    return decode(params, state, active, features, block)

  def record_prefill(*args, **kwargs):
    calls.append(("prefill", None, arrived.is_set()))
    return prefill(*args, **kwargs)

  e._decode, e._prefill = record_decode, record_prefill
  busy = engine.SamplingParams(max_new_tokens=200, temperature=0.9, seed=7,
                               logprobs=2)
  late = engine.SamplingParams(max_new_tokens=12, temperature=0.8, seed=8,
                               repetition_penalty=1.2)
  try:
    started = threading.Event()
    # Submitted once a long call has run (a streamed piece of several
    # tokens), whatever the machine's pace.
    first = e.submit(PROMPT, busy,
                     on_text=lambda d, t: len(t) > 1 and started.set())
    assert started.wait(300)
    second = e.submit(LATE_PROMPT, late)
    arrived.set()
    got = [_outcome(first), _outcome(second)]
  finally:
    e.close()
  want = [_outcome(one_token.submit(PROMPT, busy)),
          _outcome(one_token.submit(LATE_PROMPT, late))]
  assert got == want
  assert ("decode", 5, False) in calls  # the lone row ran long calls
  after = calls[[c[2] for c in calls].index(True):]
  fills = [i for i, c in enumerate(after) if c[0] == "prefill"]
  assert len(fills) == 4
  # At most the call under way before its first chunk, and decode_block
  # calls while its prompt fills.
  assert sum(c[0] == "decode" for c in after[:fills[0]]) <= 1
  assert all(c[1] == 1 for c in after[fills[0]:fills[-1]]
             if c[0] == "decode")


def test_a_stop_string_ends_the_row_at_the_token_that_completes_it():
  """Stop strings (long, short): the short one completes first though the
  long one begins earlier. One token per call stops at the short one; a
  call of several tokens sees both and must end the row there too."""
  text = helpers.counter_text("b", 40)  # cjltzxpjltzxp...
  short = next(c for c in text[3:] if text.find(c) >= 3)
  at = text.find(short)
  long = text[at - 2:at + 3]
  assert text.find(long) == at - 2  # begins before the short one
  params = engine.SamplingParams(max_new_tokens=40, temperature=0.0,
                                 stop=(long, short))
  got = []
  for blocks in (1, 8):  # 8: both complete within one call
    e = engine.Engine(helpers.counter_model(), slots=2, queue=4,
                      prefill_chunk=4, prefill_rows=1, decode_block=1,
                      small_batch_blocks=blocks)
    try:
      got.append(_streamed(e, [engine.Row("b", params)]))
    finally:
      e.close()
  assert got[0] == got[1]
  assert got[0][0][0] == text[:at] and got[0][0][1] == [
      ord(c) - 97 for c in text[:at + 1]]


def test_rows_that_lack_one_token_decode_one(model, one_token):
  """Scoring (max_tokens=1) and a row's last token run a 1-token call, not
  a decode_block one; the tokens are the 1-token engine's."""
  four = _engine(model, decode_block=4, small_batch_blocks=1)
  calls = []
  decode = four._decode
  four._decode = lambda *args: calls.append(args[-1]) or decode(*args)
  try:
    assert four.decode_blocks() == (1, 4)
    for params in (engine.SamplingParams(max_new_tokens=1, logprobs=2, seed=6),
                   engine.SamplingParams(max_new_tokens=5, temperature=0.9,
                                         seed=7)):
      calls.clear()
      rows = [engine.Row(PROMPT, params)]
      assert _streamed(four, rows) == _streamed(one_token, rows)
      assert calls == ([1] if params.max_new_tokens == 1 else [4, 1])
  finally:
    four.close()
