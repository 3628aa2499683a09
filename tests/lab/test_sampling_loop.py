"""The model-level sampling loop (lab/sampling_loop.py) against fake models
with a known next token.

Modelled on flax temperature_sampler_test. Expected values come from plain
numpy, never from the loop itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.errors import UserError
from lab.benchmarks import sampling_loop as sampling
from tests.references import numpy_nucleus, random_logits

VOCAB = 11


def _successor_step(params, carry, tokens):
  """All mass on (token + 1) % VOCAB; the carry counts steps, keeps input."""
  next_tokens = (tokens + 1) % VOCAB
  logits = params["margin"] * jax.nn.one_hot(next_tokens, VOCAB)  # [b, vocab]
  return logits, {"steps": carry["steps"] + 1, "last": tokens}


def _bigram_step(params, carry, tokens):
  """A random bigram table: next logits depend only on the token drawn."""
  return params["table"][tokens], carry


def _flat_step(params, carry, tokens):
  del params
  return jnp.zeros((tokens.shape[0], VOCAB)), carry


def _filter(logits, **options):
  return np.asarray(sampling.filter_logits(jnp.asarray(logits), **options))


def test_greedy_follows_the_successor_rule_for_a_batch_of_prompts():
  last_prompt_tokens = np.array([3, 7, 0, VOCAB - 1])
  last_logits = 10.0 * jax.nn.one_hot((last_prompt_tokens + 1) % VOCAB, VOCAB)
  carry = {"steps": jnp.zeros((), jnp.int32), "last": jnp.zeros(4, jnp.int32)}
  tokens, final = sampling.generate(
      _successor_step, {"margin": 10.0}, carry, last_logits,
      jax.random.key(0), num_new_tokens=6, temperature=0.0)
  expected = (last_prompt_tokens[:, None] + 1 + np.arange(6)) % VOCAB
  assert tokens.dtype == jnp.int32 and tokens.shape == (4, 6)
  np.testing.assert_array_equal(tokens, expected)
  assert int(final["steps"]) == 6
  # The carry has consumed the last returned token too.
  np.testing.assert_array_equal(final["last"], expected[:, -1])


def test_fixed_key_reproduces_and_different_keys_differ():
  def run(seed):
    return np.asarray(sampling.generate(
        _flat_step, {}, (), jnp.zeros((4, VOCAB)), jax.random.key(seed),
        num_new_tokens=16)[0])

  np.testing.assert_array_equal(run(1), run(1))
  assert not np.array_equal(run(1), run(2))
  # fold_in per step: the steps are not copies of each other.
  assert len({tuple(column) for column in run(1).T}) > 1


def test_tiny_temperature_equals_greedy_on_random_bigrams():
  table = random_logits(0, (VOCAB, VOCAB))
  start = np.array([0, 4, 9])
  expected = np.zeros((3, 8), int)
  row = start
  for i in range(8):  # the greedy walk through the table, in numpy
    row = table[row].argmax(-1)
    expected[:, i] = row
  tokens, _ = sampling.generate(
      _bigram_step, {"table": jnp.asarray(table)}, (), table[start],
      jax.random.key(3), num_new_tokens=8, temperature=1e-4)
  np.testing.assert_array_equal(tokens, expected)
  logits = random_logits(1, (64, 50))
  tokens = sampling.sample_next(
      jax.random.key(0), logits, temperature=1e-4, top_k=0, top_p=1.0)
  np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_top_k_samples_stay_in_each_rows_top_k():
  logits = random_logits(2, (2000, 30))
  tokens = np.asarray(sampling.sample_next(
      jax.random.key(0), logits, temperature=1.0, top_k=5, top_p=1.0))
  top5 = np.argsort(-logits, axis=-1)[:, :5]
  assert (top5 == tokens[:, None]).any(-1).all()
  # Not too strict either: one row at a high temperature shows all 5.
  same_row = np.repeat(logits[:1], 2000, axis=0)
  tokens = sampling.sample_next(
      jax.random.key(1), same_row, temperature=3.0, top_k=5, top_p=1.0)
  assert set(np.asarray(tokens).tolist()) == set(top5[0].tolist())


def test_top_p_matchesnumpy_nucleus():
  logits = random_logits(3, (2000, 30))
  nucleus = numpy_nucleus(logits, 0.7)
  filtered = _filter(logits, temperature=1.0, top_k=0, top_p=0.7)
  np.testing.assert_array_equal(np.isfinite(filtered), nucleus)
  tokens = np.asarray(sampling.sample_next(
      jax.random.key(0), logits, temperature=1.0, top_k=0, top_p=0.7))
  assert nucleus[np.arange(2000), tokens].all()
  assert (nucleus.sum(-1) > 1).any()  # else the test above were vacuous


def test_top_p_keeps_ties_and_skips_masked_tokens_in_a_large_vocab():
  # Logits on a coarse grid tie often; a third of each row is masked out
  # (-inf, as top-k or a caller leaves them). Reference in float64: sort,
  # keep tokens while the mass before them is below top_p, and every token
  # tied with the last one kept.
  logits = np.round(random_logits(7, (64, 5000), scale=3.0) * 2) / 2
  logits[:, ::3] = -np.inf
  for top_p in (0.3, 0.6, 0.9):
    x = logits.astype(np.float64)
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.zeros(x.shape, bool)
    for row in range(len(x)):
      order = np.argsort(-x[row], kind="stable")
      before = np.cumsum(probs[row, order]) - probs[row, order]
      last = order[int((before < top_p).sum()) - 1]
      expected[row] = x[row] >= x[row, last]
    filtered = _filter(logits, temperature=1.0, top_k=0, top_p=top_p)
    np.testing.assert_array_equal(np.isfinite(filtered), expected)
    cut = np.where(expected, x, np.inf).min(-1, keepdims=True)
    assert ((expected & (x == cut)).sum(-1) > 1).any()  # ties at the cut
    assert (expected.sum(-1) > 1).mean() > 0.5


def test_top_p_after_top_k_uses_the_renormalised_top_k():
  logits = random_logits(4, (200, 30))
  fifth = np.sort(logits, -1)[:, -5:-4]
  top5 = np.where(logits >= fifth, logits, -np.inf)
  filtered = _filter(logits, temperature=1.0, top_k=5, top_p=0.8)
  np.testing.assert_array_equal(
      np.isfinite(filtered), numpy_nucleus(top5, 0.8))


def test_no_filters_only_scale_by_temperature():
  logits = random_logits(5, (8, 30))
  filtered = _filter(logits, temperature=0.5, top_k=0, top_p=1.0)
  np.testing.assert_allclose(filtered, logits / 0.5, rtol=1e-6)


def test_tiny_top_p_and_zero_temperature_keep_exactly_the_argmax():
  logits = random_logits(6, (64, 30))
  expected = np.full_like(logits, -np.inf)
  expected[np.arange(64), logits.argmax(-1)] = logits.max(-1)
  filtered = _filter(logits, temperature=1.0, top_k=0, top_p=1e-6)
  np.testing.assert_array_equal(filtered, expected)
  greedy = _filter(logits, temperature=0.0, top_k=0, top_p=1.0)
  np.testing.assert_array_equal(np.isfinite(greedy), np.isfinite(expected))


def test_same_options_compile_once():
  traces = []

  def counting_step(params, carry, tokens):
    traces.append(1)  # Python runs only while tracing
    return _successor_step(params, carry, tokens)

  carry = {"steps": jnp.zeros((), jnp.int32), "last": jnp.zeros(2, jnp.int32)}
  for seed in range(3):
    sampling.generate(
        counting_step, {"margin": 10.0}, carry, jnp.zeros((2, VOCAB)),
        jax.random.key(seed), num_new_tokens=3, temperature=0.0)
  assert len(traces) == 1


@pytest.mark.parametrize("options, bad", [
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=-3), "top_k=-3"),
    (dict(top_k=2.5), "top_k=2.5"),
    (dict(top_k=float("inf")), "top_k=inf"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(num_new_tokens=0), "num_new_tokens=0"),
])
def test_invalid_options_raise_user_error(options, bad):
  kwargs = dict(num_new_tokens=2, temperature=1.0, top_k=0, top_p=1.0)
  kwargs.update(options)
  with pytest.raises(UserError, match=bad.replace(".", r"\.")) as error:
    sampling.generate(_flat_step, {}, (), jnp.zeros((1, VOCAB)),
                      jax.random.key(0), **kwargs)
  assert "\n" not in str(error.value)
  del kwargs["num_new_tokens"]
  if "num_new_tokens" not in options:
    with pytest.raises(UserError, match=bad.replace(".", r"\.")):
      sampling.filter_logits(jnp.zeros((1, VOCAB)), **kwargs)


def test_repetition_penalty_matches_numpy_and_skips_unseen():
  logits = random_logits(7, (4, VOCAB))
  seen = np.zeros((4, VOCAB), bool)
  seen[:, ::3] = True
  got = np.asarray(sampling.penalize_repeats(jnp.asarray(logits),
                                             jnp.asarray(seen), 2.0))
  expected = np.where(seen, np.where(logits > 0, logits / 2, logits * 2),
                      logits)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  same = sampling.penalize_repeats(jnp.asarray(logits), jnp.asarray(seen), 1.0)
  np.testing.assert_array_equal(np.asarray(same), logits)
  assert sampling.seen_tokens([[1, 1, 4], []], VOCAB).sum(-1).tolist() == [2, 0]


def test_huge_repetition_penalty_never_repeats_under_greedy():
  # The successor rule would cycle through the vocab; a bigram table that
  # always prefers token 0 would repeat it forever without the penalty.
  table = np.full((VOCAB, VOCAB), 1.0, np.float32)
  table[:, 0] = 5.0
  table += np.linspace(0, 1, VOCAB, dtype=np.float32)  # a strict order
  start = np.array([3])
  plain, _ = sampling.generate(
      _bigram_step, {"table": jnp.asarray(table)}, (), table[start],
      jax.random.key(0), num_new_tokens=6, temperature=0.0)
  assert np.asarray(plain).tolist() == [[0] * 6]
  seen = sampling.seen_tokens([start], VOCAB)
  tokens, _ = sampling.generate(
      _bigram_step, {"table": jnp.asarray(table)}, (), table[start],
      jax.random.key(0), num_new_tokens=6, temperature=0.0,
      repetition_penalty=1e3, seen=seen)
  row = np.asarray(tokens)[0].tolist()
  assert len(set(row)) == 6 and 3 not in row  # nor the prompt's token


def test_chunks_continue_where_the_last_one_stopped():
  table = random_logits(8, (VOCAB, VOCAB))
  params, start = {"table": jnp.asarray(table)}, np.array([1, 5])
  whole, _ = sampling.generate(_bigram_step, params, (), table[start],
                               jax.random.key(4), num_new_tokens=9)
  state = sampling.start_state((), table[start])
  pieces = []
  for offset in (0, 3, 6):
    tokens, state = sampling.generate_chunk(
        _bigram_step, params, state, jax.random.key(4), offset,
        num_new_tokens=3)
    pieces.append(np.asarray(tokens))
  np.testing.assert_array_equal(np.concatenate(pieces, 1), whole)
