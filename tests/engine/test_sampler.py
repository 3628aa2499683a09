"""The engine's per-row sampler against NumPy, row by row: every row with its
own parameters must equal NumPy's filter, penalty or log-probability with
that row's values alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.engine import params as params_lib
from zebra_jax.engine import sampler
from zebra_jax.engine import SamplingParams
from tests.references import numpy_nucleus, random_logits


def _rows(params: list[SamplingParams]) -> dict:
  """The rows' parameters as the programs read them."""
  batch = params_lib.packed_batch([params_lib.packed_row(p) for p in params],
                                  len(params))
  return params_lib.unpack({k: jnp.asarray(v) for k, v in batch.items()})


def test_per_row_filters_match_numpy_row_by_row():
  """Temperature, top-k, top-p and min-p, one of each per row."""
  rows, vocab = 300, 40
  rng = np.random.default_rng(11)
  logits = random_logits(8, (rows, vocab))
  params = [SamplingParams(
      temperature=float(rng.choice([0.5, 1.0, 1.7])),
      top_k=int(rng.choice([0, -1, 1, 5, 17, vocab, vocab + 3])),
      top_p=float(rng.choice([1.0, 0.9, 0.5, 0.1])),
      min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3]))) for _ in range(rows)]
  got = np.asarray(sampler.filter_rows(jnp.asarray(logits), _rows(params)))
  for r, p in enumerate(params):
    x = logits[r].astype(np.float64) / p.temperature
    if 0 < p.top_k < vocab:
      x = np.where(x < np.sort(x)[-p.top_k], -np.inf, x)
    if p.top_p < 1:
      x = np.where(numpy_nucleus(x[None], p.top_p)[0], x, -np.inf)
    if p.min_p > 0:
      probs = np.exp(x - x.max())
      x = np.where(probs < p.min_p, -np.inf, x)
    np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(x), r)
    kept = np.isfinite(x)
    np.testing.assert_allclose(got[r][kept], x[kept], rtol=1e-6)
  assert len({int(np.isfinite(g).sum()) for g in got}) > 5  # not vacuous


def test_per_row_top_k_keeps_ties_with_the_kth():
  logits = np.round(random_logits(9, (64, 500), scale=3.0) * 2) / 2
  logits[:, ::4] = -np.inf
  k = np.arange(64) % 9 + 1
  got = np.isfinite(np.asarray(sampler.filter_rows(
      jnp.asarray(logits), _rows([SamplingParams(top_k=int(i)) for i in k]))))
  kth = -np.sort(-logits, -1)[np.arange(64), k - 1]
  np.testing.assert_array_equal(got, logits >= kth[:, None])
  assert (got.sum(-1) > k).any()  # ties at the k-th were kept


def test_per_row_draws_do_not_depend_on_the_other_rows():
  """Row r draws with its own key: the same token in any batch, and
  greedy rows (temperature 0) take the first argmax."""
  rows, vocab = 16, 30
  logits = random_logits(10, (rows, vocab))
  logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: first wins
  params = [SamplingParams(temperature=0.0 if r % 4 == 3 else 1.3,
                           top_k=r % 3 * 4, top_p=0.8 if r % 2 else 1.0,
                           min_p=0.02 if r % 5 == 1 else 0.0)
            for r in range(rows)]
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(5),
                                                 jnp.arange(rows))
  draw = lambda idx: np.asarray(sampler.draw_rows(
      keys[idx], jnp.asarray(logits[idx]), _rows([params[i] for i in idx])))
  together = draw(np.arange(rows))
  alone = np.concatenate([draw(np.array([r])) for r in range(rows)])
  np.testing.assert_array_equal(together, alone)
  shuffled = np.random.default_rng(0).permutation(rows)
  np.testing.assert_array_equal(draw(shuffled), together[shuffled])
  greedy = np.array([p.temperature == 0 for p in params])
  np.testing.assert_array_equal(together[greedy],
                                logits[greedy].argmax(-1))
  assert together[3] == 7


def test_penalties_and_logit_bias_match_numpy():
  """CTRL's repetition penalty over prompt + output, OpenAI's presence and
  frequency penalties over the output's counts, and logit bias, per row."""
  rows, vocab = 6, 13
  logits = random_logits(12, (rows, vocab))
  rng = np.random.default_rng(3)
  seen = rng.random((rows, vocab)) < 0.4
  counts = rng.integers(0, 4, (rows, vocab)) * seen
  params = [SamplingParams(),
            SamplingParams(repetition_penalty=2.0),
            SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
            SamplingParams(repetition_penalty=0.5, frequency_penalty=-1.0,
                           logit_bias=((0, -100.0), (12, 7.5))),
            SamplingParams(presence_penalty=-2.0, logit_bias=((5, 1.0),)),
            SamplingParams(repetition_penalty=1.3, presence_penalty=2.0)]
  got = np.asarray(sampler.penalize_rows(
      jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counts, jnp.int32),
      _rows(params)))
  for r, p in enumerate(params):
    x = logits[r].astype(np.float64)
    rep = p.repetition_penalty
    x = np.where(seen[r], np.where(x > 0, x / rep, x * rep), x)
    x = x - p.frequency_penalty * counts[r] - p.presence_penalty * (
        counts[r] > 0)
    for token, bias in p.logit_bias:
      x[token] += bias
    np.testing.assert_allclose(got[r], x, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got[0], logits[0])


def test_logprobs_are_the_models_own_with_the_top_n():
  rows, vocab = 5, 50
  logits = random_logits(13, (rows, vocab), scale=3.0)
  tokens = np.array([0, 7, 49, 3, 3], np.int32)
  chosen, top_ids, top_lp = (np.asarray(x) for x in sampler.logprob_rows(
      jnp.asarray(logits), jnp.asarray(tokens)))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  np.testing.assert_allclose(chosen, logp[np.arange(rows), tokens],
                             atol=1e-5)
  order = np.argsort(-logp, -1)[:, :top_ids.shape[1]]
  np.testing.assert_array_equal(top_ids, order)
  np.testing.assert_allclose(top_lp, np.take_along_axis(logp, order, -1),
                             atol=1e-5)
  # The chosen token's value and its entry among the top are one number.
  assert chosen[1] == top_lp[1][list(top_ids[1]).index(7)]


@pytest.mark.parametrize("field, value", [
    ("top_k", 3_000_000_000), ("temperature", float("nan")),
    ("temperature", float("inf")), ("temperature", -0.5), ("top_p", 0.0),
    ("min_p", 1.5), ("presence_penalty", 2.5), ("repetition_penalty", 0.0),
    ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("seed", 2**64),
    ("logprobs", 21), ("stop", ("",)), ("logit_bias", ((3, 101.0),)),
    ("top_k", True)])
def test_every_parameter_is_bounded_before_the_engine(field, value):
  with pytest.raises(params_lib.ParamError) as e:
    SamplingParams(**{field: value}).check()
  assert e.value.field == field


def test_a_logit_bias_outside_the_vocabulary_is_refused():
  SamplingParams(logit_bias=((9, 1.0),)).check(vocab_size=10)
  with pytest.raises(params_lib.ParamError, match="outside the vocabulary"):
    SamplingParams(logit_bias=((10, 1.0),)).check(vocab_size=10)


def test_no_seed_draws_a_fresh_one_and_a_seed_stays():
  seeds = {SamplingParams().with_seed().seed for _ in range(20)}
  assert len(seeds) == 20 and None not in seeds
  assert SamplingParams(seed=7).with_seed().seed == 7
