"""The serving engine: a bounded set of compiled programs, and a request's
text independent of what runs beside it."""

import concurrent.futures
import dataclasses
import itertools
import threading

import jax
import numpy as np
import pytest

from zebra_jax import engine
from zebra_jax.inference import loading, sample, score
from tests import helpers, references

TEXT = "line 7: the quick brown fox jumps over the lazy dog. "
# prefill (with and without prompt log-probabilities), the decode variants
# at one token, at decode_block and at the small batch's longer block
# (serve's default small_batch_blocks is 4), the prefix cache's restore
PROGRAMS = 2 + 3 * len(engine.params.DECODE_VARIANTS) + 1


@pytest.fixture(scope="module")
def gen(char_run):
  cfg, workdir = char_run
  # Small shapes, so prompts span several prefill chunks and requests queue.
  g = sample.Generator(loading.load_for_inference(cfg, workdir), slots=6,
                       queue=64, prefill_chunk=8, prefill_rows=3,
                       decode_block=3)
  yield g
  g.close()


class _Lowerings:
  """Counts programs jax lowers (each new program, compiled or read from
  the persistent cache, is lowered once)."""

  def __init__(self):
    self.count, self.on = 0, True

  def __call__(self, name, *args, **kwargs):
    if self.on and name == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      self.count += 1


def test_compiled_programs_are_the_startup_set(gen):
  e = gen.engine
  assert e.decode_blocks() == (1, 3, 12)
  assert e.stats()["compiled_programs"] == e.startup_programs == PROGRAMS
  lowerings = _Lowerings()
  jax.monitoring.register_event_duration_secs_listener(lowerings)
  try:
    done = []
    for length in range(1, 31):
      for i, temperature in enumerate((0.0, 0.3, 0.7, 1.0, 1.7)):
        done.append(e.submit(TEXT[:length], engine.SamplingParams(
            max_new_tokens=1 + (length + i) % 5, temperature=temperature,
            top_k=(0, 3, 0, 50, 1)[i], top_p=(1.0, 1.0, 0.9, 0.5, 1.0)[i],
            repetition_penalty=(1.0, 1.3, 1.0, 0.8, 1.0)[i], seed=length,
            stop=("e",) if i == 2 else ()), block=True))
    assert all(c.result(timeout=300) is not None for c in done)
  finally:
    lowerings.on = False
    jax.monitoring.unregister_event_duration_listener(lowerings)
  assert lowerings.count == 0
  stats = e.stats()
  assert stats["compiled_programs"] == stats["startup_programs"] == PROGRAMS
  assert stats["busy"] == stats["queued"] == 0
  assert {c.finish_reason for c in done} == {"length", "stop"}


REQUESTS = [(TEXT[:n], engine.SamplingParams(
    max_new_tokens=5 + n % 7, temperature=t, top_k=k, top_p=p,
    repetition_penalty=r, seed=s))
            for n, t, k, p, r, s in [
                (1, 0.0, 0, 1.0, 1.0, 0), (3, 0.0, 0, 1.0, 1.3, 0),
                (9, 0.0, 0, 1.0, 1.0, 0), (17, 0.0, 0, 1.0, 1.0, 0),
                (25, 0.0, 5, 0.5, 1.0, 0), (40, 0.0, 0, 1.0, 2.0, 0),
                (2, 1.0, 0, 1.0, 1.0, 1), (2, 1.0, 0, 1.0, 1.0, 2),
                (11, 0.8, 4, 1.0, 1.0, 3), (16, 1.2, 0, 0.9, 1.0, 4),
                (33, 1.0, 10, 0.8, 1.4, 5), (8, 0.5, 0, 1.0, 1.0, 6),
                (5, 1.0, 0, 1.0, 1.0, -7), (21, 1.0, 1, 1.0, 1.0, 2**40),
                (13, 0.0, 0, 1.0, 1.0, 9), (29, 2.0, 0, 0.95, 1.0, 10)]]


# Rows that each use some groups of the decode math (params.Features).
MIXES = [
    engine.SamplingParams(temperature=0.0),
    engine.SamplingParams(temperature=0.9, seed=1),
    engine.SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=2),
    engine.SamplingParams(temperature=1.2, min_p=0.1, seed=3),
    engine.SamplingParams(temperature=0.0, repetition_penalty=1.4,
                          logit_bias=((3, 2.0),)),
    engine.SamplingParams(temperature=0.8, presence_penalty=0.5,
                          frequency_penalty=0.3, seed=4, logprobs=2),
    engine.SamplingParams(temperature=0.0, allowed_token_ids=(3, 5, 9, 11)),
    engine.SamplingParams(temperature=1.0, min_tokens=3,
                          stop_token_ids=(5, 9), seed=5),
    engine.SamplingParams(temperature=0.0, logprobs=3),
    engine.SamplingParams(temperature=0.5, top_k=2, repetition_penalty=0.8,
                          allowed_token_ids=(1, 2, 3, 4, 5, 6), logprobs=1,
                          seed=6),
]


@pytest.mark.slow
def test_every_decode_variant_gives_a_row_the_all_features_bits(gen):
  """A row's tokens and log-probabilities in any decode variant that covers
  its groups equal, to the bit, those of the program with every group (in
  which the groups it does not use are neutral for it): what a row gets
  never depends on what its neighbours use."""
  from zebra_jax.engine import programs
  e, params = gen.engine, engine.params
  slots, vocab = len(MIXES), e.model.vocab_size
  rng = np.random.default_rng(0)
  state = programs.initial_state(e.model.init_carry, slots, vocab)
  state = state._replace(
      logits=rng.normal(0, 3, (slots, vocab)).astype(np.float32),
      seen=rng.random((slots, vocab)) < 0.3,
      counts=rng.integers(0, 3, (slots, vocab)).astype(np.int32),
      key=rng.integers(0, 2**32, (slots, 2), dtype=np.uint32),
      step=rng.integers(0, 2, slots).astype(np.int32),
      row=params.packed_batch([params.packed_row(p) for p in MIXES], slots))
  needs = [params.features(p) for p in MIXES]
  decode = jax.jit(lambda state, active, features: programs.decode(
      e.model.params, state, active, step_fn=e.model.step_fn, block=3,
      features=features), static_argnums=2)
  mixes = 0
  # Every set of groups, compiled by the engine or not: the property holds
  # for any program the groups make.
  for variant in {params.Features(*bits) for bits in itertools.product(
      (False, True), repeat=len(params.Features._fields))}:
    active = np.array([variant.covers(n) for n in needs])
    if not active.any():
      continue
    mixes += 1
    _, tokens, logprobs = decode(state, active, variant)
    _, want_tokens, want_logprobs = decode(state, active,
                                           params.ALL_FEATURES)
    np.testing.assert_array_equal(np.asarray(tokens)[active],
                                  np.asarray(want_tokens)[active])
    if variant.logprobs:
      for got, want in zip(logprobs, want_logprobs):
        np.testing.assert_array_equal(np.asarray(got)[active],
                                      np.asarray(want)[active])
  assert mixes == 2 ** len(params.Features._fields)
  # The engine runs the plain program for plain rows, the full one as soon
  # as one row uses a group.
  plain = params.features(params.SamplingParams(temperature=0.7, seed=1))
  assert params.variant_for(plain) == params.DECODE_VARIANTS[0]
  assert params.variant_for(plain | params.Features(logprobs=True)) \
      == params.ALL_FEATURES


def test_a_request_in_a_busy_batch_equals_it_alone(gen):
  """16 threads at once (6 slots: rows join and leave mid-run, others wait
  in the queue); every text, greedy or sampled, equals the same request
  sent alone."""
  e = gen.engine
  barrier = threading.Barrier(len(REQUESTS))

  def send(request):
    barrier.wait()
    return e.submit(*request).result(timeout=300)

  with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
    together = list(pool.map(send, REQUESTS))
  alone = [e.submit(*r).result(timeout=300) for r in REQUESTS]
  assert together == alone
  assert len(set(together[6:8])) == 2  # seeds 1 and 2 differ
  assert all(len(t) == r[1].max_new_tokens for t, r in zip(alone, REQUESTS))


def test_stop_tokens_min_tokens_and_allowed_ids_are_each_rows_own(gen):
  """Rows with stop_token_ids, min_tokens or allowed_token_ids in one batch
  with rows without: each obeys its own, and every text equals the same
  request alone."""
  e = gen.engine
  ids = lambda text: tuple(int(i) for i in e.tokenizer.encode_prompt(text))
  plain = engine.SamplingParams(max_new_tokens=24, temperature=0.0)
  greedy = e.submit(TEXT[:9], plain).result(timeout=300)
  [first], [third] = ids(greedy[0]), ids(greedy[2])
  change = lambda **kw: (TEXT[:9], dataclasses.replace(plain, **kw))
  requests = [(TEXT[:9], plain), change(stop_token_ids=(third,)),
              change(stop_token_ids=(first,), min_tokens=5),
              change(temperature=1.0, seed=3, allowed_token_ids=ids("the ")),
              change(temperature=1.0, seed=3)]
  barrier = threading.Barrier(len(requests))

  def send(request):
    barrier.wait()
    return e.submit(*request)

  with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
    rows = list(pool.map(send, requests))
  together = [r.result(timeout=300) for r in rows]
  assert together == [e.submit(*r).result(timeout=300) for r in requests]
  assert together[0] == greedy
  assert together[1] == greedy[:greedy.index(greedy[2])]
  assert rows[1].finish_reason == "stop" and rows[1].stop_token == third
  assert len(together[2]) >= 5 and greedy[0] not in together[2]
  assert len(together[3]) == 24 and set(together[3]) <= set("the ")
  assert not set(together[4]) <= set("the ")


def test_greedy_equals_the_reference(gen):
  """An independent path (references.greedy_ids): the whole prompt as one
  window, then one step per token on the host; the engine consumes prompts
  in masked chunks of one-token steps and decodes in blocks, beside
  other rows."""
  for n in (1, 8, 9, 30):
    prompt = TEXT[:n]
    got = gen.engine.submit(prompt, engine.SamplingParams(
        max_new_tokens=12, temperature=0.0)).result(timeout=300)
    assert got == references.greedy_text(gen, prompt, 12)


def test_stop_strings_streaming_and_finish_reasons(gen):
  e = gen.engine
  free = e.submit("the ", engine.SamplingParams(max_new_tokens=30, seed=1))
  text = free.result(timeout=300)
  assert free.finish_reason == "length" and len(text) == 30
  assert free.completion_tokens == 30 and free.prompt_tokens == 4
  # Two stop strings, the later-found one first: the text ends before the
  # earliest occurrence of either.
  first, second = text[6:8], text[12:14]
  expected = text[:min(text.index(first), text.index(second))]
  pieces, reasons = [], []
  stopped = e.submit("the ", engine.SamplingParams(
      max_new_tokens=30, seed=1, stop=(second, first)),
                     on_text=lambda d, t: pieces.append(d),
                     on_done=reasons.append)
  assert stopped.result(timeout=300) == expected == "".join(pieces)
  assert stopped.finish_reason == "stop" and reasons == ["stop"]
  # Tokens past the stop string were generated but are not returned.
  assert stopped.completion_tokens == len(expected) < len(stopped.tokens)
  pieces.clear()
  streamed = e.submit("the ", engine.SamplingParams(max_new_tokens=30, seed=1),
                      on_text=lambda d, t: pieces.append(d))
  assert streamed.result(timeout=300) == text == "".join(pieces)
  # As it grew: a first call of 3 tokens, then the small batch's calls of
  # 12, the last call 3 again (no more than the row needs).
  assert [len(p) for p in pieces] == [3, 12, 12, 3]


def test_queue_full_and_cancel(gen):
  small = engine.Engine(gen.engine_model(), slots=1, queue=1,
                        prefill_chunk=8, prefill_rows=1, decode_block=1)
  try:
    started = threading.Event()
    long = small.submit("the ", engine.SamplingParams(max_new_tokens=1000),
                        on_text=lambda d, t: started.set())
    assert started.wait(300)  # it holds the only slot
    waiting = small.submit("x", engine.SamplingParams(max_new_tokens=3,
                                                temperature=0.0))
    with pytest.raises(engine.QueueFull) as full:
      small.submit("x", engine.SamplingParams(max_new_tokens=3))
    assert full.value.retry_after > 0
    assert small.stats()["busy"] == 1 and small.stats()["queued"] == 1
    long.cancel()  # frees the slot at the next step
    assert len(waiting.result(timeout=300)) == 3
    assert long.finish_reason == "cancelled"
    assert len(long.text) < 1000
    queued = small.submit("the ", engine.SamplingParams(max_new_tokens=500))
    gone = small.submit("x", engine.SamplingParams(max_new_tokens=3))
    gone.cancel()  # still queued: leaves without a slot
    assert gone.result(timeout=300) == "" and gone.finish_reason == "cancelled"
    queued.cancel()
    queued.result(timeout=300)
    with pytest.raises(engine.BadPrompt, match="empty"):
      small.submit("", engine.SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
      small.submit("x", engine.SamplingParams(top_p=0.0))
  finally:
    small.close()


def test_a_failing_callback_cancels_only_its_request(gen):
  e = gen.engine

  def hang_up(delta, tokens):
    raise BrokenPipeError("client gone")

  broken = e.submit("the ", engine.SamplingParams(max_new_tokens=200),
                    on_text=hang_up)
  fine = e.submit("the ", engine.SamplingParams(max_new_tokens=20,
                                          temperature=0.0))
  broken.result(timeout=300)
  assert broken.finish_reason == "cancelled"
  assert broken.completion_tokens < 200  # its slot was freed early
  assert len(fine.result(timeout=300)) == 20


def test_rows_filling_and_decoding_together_match_the_recurrence():
  """Against numpy: prompts of up to 7 chunks fill while other rows decode
  between their chunks, rows join and leave, greedy and sampled mixed."""
  e = engine.Engine(helpers.counter_model(), slots=4, queue=64, prefill_chunk=4,
                    prefill_rows=2, decode_block=2)
  try:
    rng = np.random.default_rng(0)
    prompts = ["".join(chr(97 + c) for c in rng.integers(0, 26, n))
               for n in (1, 27, 3, 13, 5, 26, 9, 2, 17, 4)]
    busy = e.submit("q", engine.SamplingParams(max_new_tokens=10**6, seed=3))
    rows = [e.submit(p, engine.SamplingParams(max_new_tokens=5 + i,
                                        temperature=0.0))
            for i, p in enumerate(prompts)]
    for i, (p, r) in enumerate(zip(prompts, rows)):
      assert r.result(timeout=300) == helpers.counter_text(p, 5 + i)
    assert not busy.done()
    busy.cancel()
    busy.result(timeout=300)
  finally:
    e.close()


def test_categorical_draws_what_jax_random_categorical_draws():
  """The engine's draw is jax.random.categorical's, token for token, over
  many keys, with filtered (-inf) entries and near-ties; a change in either
  (a different noise, argmax's tie rule) shows up as a mismatch."""
  rng = np.random.RandomState(0)
  ours = jax.jit(jax.vmap(engine.categorical))
  jaxs = jax.jit(jax.vmap(lambda k, row: jax.random.categorical(k, row)))
  for i in range(50):
    keys = np.stack([engine.seed_key(1000 * i + r) for r in range(64)])
    logits = (rng.randn(64, 97) * rng.uniform(0.1, 8)).astype(np.float32)
    logits[:, rng.randint(0, 97, 40)] = -np.inf
    logits[::7, 3] = logits[::7, 5] = logits[::7].max(-1)  # ties at the top
    drawn = np.asarray(ours(keys, logits))
    np.testing.assert_array_equal(drawn, np.asarray(jaxs(keys, logits)))
    assert np.all(np.isfinite(logits[np.arange(64), drawn]))


def test_seed_keys_match_jax_for_32_bit_seeds():
  for seed in (0, 1, 7, 2**31, 2**32 - 1):
    np.testing.assert_array_equal(engine.seed_key(seed),
                                  np.asarray(jax.random.PRNGKey(seed)))
  assert engine.seed_key(2**40)[0] == 256  # the high word is kept
  assert not np.array_equal(engine.seed_key(-1), engine.seed_key(2**32 - 1))


def test_a_failed_step_fails_its_batch_and_the_engine_serves_on(gen):
  """A step that raises fails only the requests in the batch; queued ones
  and later ones are served from a rebuilt state, token for token as
  before the failure."""
  e = engine.Engine(gen.engine_model(), slots=2, queue=4, prefill_chunk=8,
                    prefill_rows=2, decode_block=2)
  try:
    greedy = engine.SamplingParams(max_new_tokens=6, temperature=0.0)
    before = e.submit("the ", greedy).result(timeout=300)
    decode, calls = e._decode, []

    def fail_once(*args):
      calls.append(1)
      if len(calls) == 1:
        raise RuntimeError("device lost")
      return decode(*args)

    e._decode = fail_once
    reasons = []
    hit = e.submit_many([engine.Row("the ", greedy, on_done=reasons.append),
                         engine.Row("line", greedy, on_done=reasons.append)])
    queued = e.submit("the ", greedy)  # waits: both slots are taken
    for r in hit:
      with pytest.raises(engine.StepFailed, match="device lost"):
        r.result(timeout=300)
      assert r.finish_reason == "error"
    assert reasons == ["error", "error"]
    assert queued.result(timeout=300) == before
    assert e.submit("the ", greedy).result(timeout=300) == before
    assert e.stats()["restarts"] == 1 and e.healthy
  finally:
    e.close()


def test_an_engine_that_cannot_recover_stops_and_says_so(gen):
  fatal = []
  e = engine.Engine(gen.engine_model(), slots=2, queue=4, prefill_chunk=8,
                    prefill_rows=2, decode_block=2, max_failures=1,
                    on_fatal=fatal.append)

  def fail(*args):
    raise RuntimeError("device lost")

  e._decode = fail
  for _ in range(2):  # the first failure is recovered from, the second not
    request = e.submit("the ", engine.SamplingParams(max_new_tokens=5))
    with pytest.raises(engine.StepFailed):
      request.result(timeout=300)
  e._thread.join(timeout=300)
  assert len(fatal) == 1 and not e.healthy and e.failure is fatal[0]
  with pytest.raises(engine.EngineClosed, match="could not recover"):
    e.submit("the ", engine.SamplingParams())
  e.close()


def test_a_request_is_admitted_whole_and_the_queue_counts_requests(gen):
  e = engine.Engine(gen.engine_model(), slots=2, queue=1, prefill_chunk=8,
                    prefill_rows=2, decode_block=1)
  try:
    long = engine.SamplingParams(max_new_tokens=10**6, temperature=0.0)
    # Both slots busy, so that no row of the five below can be admitted
    # while the queue is counted.
    busy = []
    for prompt in ("the ", "a "):
      started = threading.Event()
      busy.append(e.submit(prompt, long,
                           on_text=lambda d, t, s=started: s.set()))
      assert started.wait(300)
    # Five rows wait as one request: the queue holds one request.
    five = e.submit_many([engine.Row("x", engine.SamplingParams(
        max_new_tokens=2, temperature=0.0)) for _ in range(5)])
    assert e.stats()["queued"] == 5 and e.stats()["queued_requests"] == 1
    with pytest.raises(engine.QueueFull):
      e.submit_many([engine.Row("y", long), engine.Row("z", long)])
    assert e.stats()["queued"] == 5  # nothing of the refused one entered
    for request in busy:
      request.cancel()
    assert [r.result(timeout=300) for r in five] == [five[0].text] * 5
  finally:
    e.close()


def test_no_seed_is_random_and_a_seed_reproduces(gen):
  e = gen.engine
  free = engine.SamplingParams(max_new_tokens=24, temperature=1.0)
  unseeded = {e.submit("the ", free).result(timeout=300) for _ in range(3)}
  assert len(unseeded) == 3
  seeded = dataclasses.replace(free, seed=42)
  rows = [engine.Row("the ", seeded, sample_index=i) for i in range(3)]
  first = [r.result(timeout=300) for r in e.submit_many(rows)]
  again = [r.result(timeout=300) for r in e.submit_many(
      [dataclasses.replace(r, on_text=None) for r in rows])]
  assert first == again and len(set(first)) == 3  # choice i: seed and i


def test_prompt_and_token_logprobs_equal_the_scorer(gen, char_run):
  """max_new_tokens=0 with prompt log-probabilities is --mode=score's
  answer; a greedy token's log-probability is its top-1 entry."""
  cfg, workdir = char_run
  scorer = score.Scorer(loading.load_for_inference(cfg, workdir), 16)
  ids = gen.encode(TEXT[:37])
  scoring = gen.engine.submit(TEXT[:37], engine.SamplingParams(
      max_new_tokens=0, prompt_logprobs=1))
  assert scoring.result(timeout=300) == "" and scoring.tokens == []
  assert scoring.prompt_logprobs[0] is None
  np.testing.assert_allclose(scoring.prompt_logprobs[1:],
                             scorer.score_ids(ids), atol=2e-5)
  greedy = gen.engine.submit(TEXT[:37], engine.SamplingParams(
      max_new_tokens=5, temperature=0.0, logprobs=3))
  greedy.result(timeout=300)
  assert len(greedy.token_logprobs) == 5
  for token, lp, top in zip(greedy.tokens, greedy.token_logprobs,
                            greedy.top_logprobs):
    assert len(top) == 3 and top[0] == (token, lp)
  whole = scorer.score_ids(np.concatenate([ids, greedy.tokens]))
  np.testing.assert_allclose(greedy.token_logprobs, whole[-5:], atol=2e-5)


def test_a_long_prompt_filling_while_others_decode_equals_it_alone(gen):
  """A prompt of 6 prefill chunks enters while another row decodes at every
  step between its chunks: its carry must only move with its own tokens."""
  e = gen.engine
  requests = [engine.SamplingParams(max_new_tokens=10, temperature=0.0),
              engine.SamplingParams(max_new_tokens=10, seed=4,
                              repetition_penalty=1.5)]
  decoding = threading.Event()
  busy = e.submit("x", engine.SamplingParams(max_new_tokens=400, seed=1),
                  on_text=lambda d, t: decoding.set())
  assert decoding.wait(300)
  beside = [e.submit(TEXT[:45], s).result(timeout=300) for s in requests]
  assert not busy.done()  # it decoded all along
  busy.cancel()
  busy.result(timeout=300)
  assert e.stats()["busy"] == 0
  alone = [e.submit(TEXT[:45], s).result(timeout=300) for s in requests]
  assert beside == alone


def test_prompts_are_consumed_oldest_first(gen):
  """A prompt admitted earlier finishes its prefill before a later one
  starts, whatever slots they took: by slot, a long prompt in a high slot
  would wait behind every new prompt in the low ones."""
  e = engine.Engine(gen.engine_model(), slots=2, queue=4, prefill_chunk=8,
                    prefill_rows=1, decode_block=2)
  fed = []
  prefill_args = e._prefill_args
  def record(batch):  # runs on the engine's thread
    fed.extend(comp.prompt for comp in batch)
    return prefill_args(batch)
  e._prefill_args = record
  try:
    first, older, newer = "l", TEXT[:40], TEXT[1:41]
    # `first` takes slot 0 and leaves it after 2 tokens; `older` (5 chunks)
    # fills slot 1; `newer` then takes slot 0 while `older` still fills.
    done = [e.submit(p, engine.SamplingParams(max_new_tokens=2, temperature=0.0),
                     block=True) for p in (first, older, newer)]
    for c in done:
      c.result(timeout=300)
  finally:
    e.close()
  assert fed.count(older) == 5 and fed.count(newer) == 5
  assert fed.index(newer) > len(fed) - 1 - fed[::-1].index(older), fed
