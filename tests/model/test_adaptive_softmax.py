"""Adaptive softmax: exact, normalised, equal to a full softmax without
cutoffs, finite gradients, a tiny model learns, tying shares parameters."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zebra_jax.errors import UserError
from zebra_jax.model import adaptive_softmax as asm
from tests.references import randomize

V, D = 50, 16
CUTOFFS = (10, 20, 35)  # clusters: 10 shortlist + 3 tails of 10, 15, 15


def make(cutoffs=CUTOFFS, div_val=2, seed=0, **kw):
  return asm.AdaptiveSoftmax(V, D, cutoffs, div_val, rngs=nnx.Rngs(seed), **kw)


def hidden(n=37, seed=2):
  return jax.random.normal(jax.random.key(seed), (n, D), jnp.float32)


def test_bounds_and_widths():
  assert asm.cluster_bounds(V, CUTOFFS) == ((0, 10), (10, 20), (20, 35),
                                            (35, 50))
  assert asm.cluster_bounds(V, (20000, 40000)) == ((0, V),)  # tiny vocab
  assert asm.cluster_widths(1024, 4, 4) == (1024, 256, 64, 16)
  with pytest.raises(UserError, match="strictly increasing"):
    asm.cluster_bounds(V, (20, 10))


@pytest.mark.parametrize("div_val", [1, 2])
def test_probabilities_sum_to_one_and_match_nll(div_val):
  head = randomize(make(div_val=div_val, chunk_rows=8))
  h = hidden()
  log_probs = head.log_probs(h)
  assert log_probs.shape == (37, V) and log_probs.dtype == jnp.float32
  np.testing.assert_allclose(jnp.exp(log_probs).sum(-1), 1.0, rtol=1e-5)
  # Every target, shortlist and tails, in chunks that are partly skipped.
  targets = jnp.arange(37) * 7 % V
  nll = head.nll(h, targets)
  expected = -jnp.take_along_axis(log_probs, targets[:, None], -1)[:, 0]
  np.testing.assert_allclose(nll, expected, rtol=1e-5, atol=1e-5)
  assert head.predict(h).tolist() == jnp.argmax(log_probs, -1).tolist()


def test_no_cutoffs_is_the_full_softmax():
  head = randomize(make(cutoffs=()))
  h = hidden()
  table, bias = head.weights.tables[0][...], head.biases[0][...]
  full = jax.nn.log_softmax(h @ table.T + bias, -1)
  np.testing.assert_allclose(head.log_probs(h), full, rtol=1e-5, atol=1e-6)
  targets = jnp.arange(37) % V
  np.testing.assert_allclose(
      head.nll(h, targets),
      optax.softmax_cross_entropy_with_integer_labels(h @ table.T + bias,
                                                      targets),
      rtol=1e-5, atol=1e-6)


def _tail_targets(owned, n, seed=5):
  """n targets in a shuffled order, owned[i] of them in tail i + 1 (CUTOFFS),
  the rest in the shortlist."""
  rng = np.random.default_rng(seed)
  bounds = asm.cluster_bounds(V, CUTOFFS)
  parts = [rng.integers(*bounds[i + 1], size=k) for i, k in enumerate(owned)]
  parts.append(rng.integers(*bounds[0], size=n - sum(owned)))
  return jnp.asarray(rng.permutation(np.concatenate(parts)))


@pytest.mark.parametrize("div_val,chunk_rows,owned", [
    (1, 4, None), (2, 4, None),
    # 221 rows: a whole 128-row chunk, then pieces of 64 and 32 rows on a
    # CPU (PLATFORM_PIECE_ROWS); 1 row: one piece; 0 rows: nothing runs.
    (2, 128, (221, 1, 0)),
    (1, 64, (64, 65, 0))])  # exactly a chunk; a chunk and one row
def test_gradients_finite_and_match_dense_reference(div_val, chunk_rows,
                                                    owned):
  """nll's hand-written tail backward against autodiff of the dense
  log-probabilities: the parameters' and the hidden states' gradients,
  with rows weighted unequally and chunks (4 rows) that the tails own,
  share and skip, or chunks and pieces of the counts `owned`; div_val=1:
  tails without projections."""
  head = randomize(make(div_val=div_val, chunk_rows=chunk_rows))
  graphdef, params = nnx.split(head)
  n = 37 if owned is None else 300
  h = hidden(n=n)
  targets = (jnp.arange(n) * 5 % V if owned is None
             else _tail_targets(owned, n))
  weights = jnp.linspace(0.5, 2.0, n)

  def loss(p, h, dense):
    m = nnx.merge(graphdef, p)
    if dense:
      lp = m.log_probs(h)
      nll = -jnp.take_along_axis(lp, targets[:, None], -1)[:, 0]
    else:
      nll = m.nll(h, targets)
    return (weights * nll).sum()

  grads = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(params, h, False)
  reference = jax.grad(loss, (0, 1))(params, h, True)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_bfloat16_compute_keeps_float32_outputs():
  head = randomize(make(dtype=jnp.bfloat16))
  lp = head.log_probs(hidden())
  assert lp.dtype == jnp.float32
  np.testing.assert_allclose(jnp.exp(lp).sum(-1), 1.0, rtol=1e-4)
  assert all(x.dtype == jnp.float32
             for x in jax.tree.leaves(nnx.state(head, nnx.Param)))


def test_tied_input_shares_tables_and_projections():
  embed = asm.AdaptiveInput(V, D, CUTOFFS, 2, rngs=nnx.Rngs(0))
  head = asm.AdaptiveSoftmax(V, D, CUTOFFS, 2, rngs=nnx.Rngs(1),
                             tied_input=embed)

  class Pair(nnx.Module):
    def __init__(self):
      self.embed, self.head = embed, head

  _, state = nnx.split(Pair())
  untied = nnx.split(make())[1]
  count = lambda s: sum(x.size for x in jax.tree.leaves(s))
  assert count(state) == count(untied)  # the tables are stored once
  ids = jnp.array([[0, 9, 10, 25, 49]])
  e = embed(ids)
  assert e.shape == (1, 5, D) and e.dtype == jnp.float32
  # id 25 is in cluster 2 (width 4): its row, projected up to D.
  row = embed.tables[2][...][25 - 20] @ embed.proj(2).T
  np.testing.assert_allclose(e[0, 3], row, rtol=1e-5)
  with pytest.raises(UserError, match="same vocab_size and cutoffs"):
    asm.AdaptiveSoftmax(V, D, (10,), 2, rngs=nnx.Rngs(1), tied_input=embed)


def test_tiny_model_loss_falls():
  """Adaptive input -> tanh layer -> adaptive softmax learns a bigram map."""

  class Tiny(nnx.Module):
    def __init__(self):
      self.embed = asm.AdaptiveInput(V, D, CUTOFFS, 2, rngs=nnx.Rngs(0))
      self.head = asm.AdaptiveSoftmax(V, D, CUTOFFS, 2, rngs=nnx.Rngs(1),
                                      tied_input=self.embed, chunk_rows=16)
      self.w = nnx.Param(jnp.eye(D))

    def __call__(self, ids, targets):
      return self.head.nll(jnp.tanh(self.embed(ids) @ self.w[...]) * 3,
                           targets).mean()

  graphdef, params = nnx.split(Tiny())
  ids = jnp.arange(64) % V
  targets = (ids * 3 + 1) % V  # a fixed next word for every word
  tx = optax.adam(0.05)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt):
    loss, grads = jax.value_and_grad(
        lambda p: nnx.merge(graphdef, p)(ids, targets))(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  losses = []
  for _ in range(60):
    params, opt, loss = step(params, opt)
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0], losses[::10]


# --------------------------- the exact loss against a float64 NumPy reference


def numpy_log_probs(head, h):
  """Every word's log-probability in float64 NumPy, from the head's
  parameters: head softmax over [shortlist | clusters], tails inside."""
  f64 = lambda a: np.asarray(a, np.float64)
  h = f64(h)
  w = head.weights

  def project(i):
    p = w.proj(i)
    return h if p is None else h @ f64(p)

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  z = project(0)
  logits = z @ f64(w.tables[0][...]).T + f64(head.biases[0][...])
  if len(head.bounds) > 1:
    clusters = z @ f64(head.cluster_w[...]).T + f64(head.cluster_b[...])
    logits = np.concatenate([logits, clusters], -1)
  top = log_softmax(logits)
  parts = [top[:, :head.shortlist]]
  for i in range(1, len(head.bounds)):
    tail = project(i) @ f64(w.tables[i][...]).T + f64(head.biases[i][...])
    parts.append(top[:, head.shortlist + i - 1, None] + log_softmax(tail))
  return np.concatenate(parts, -1)


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 64])
def test_nll_and_predict_match_a_float64_reference(chunk_rows):
  """Targets in every cluster, a chunk size that divides nothing, one
  bigger than the rows: the loss is each row's exact -log p."""
  head = randomize(make(chunk_rows=chunk_rows), seed=3)
  h = hidden(n=41, seed=4)
  want = numpy_log_probs(head, h)
  targets = np.asarray([0, 9, 10, 19, 20, 34, 35, 49] * 5 + [12])
  nll = jax.jit(head.nll)(h, jnp.asarray(targets))
  np.testing.assert_allclose(
      nll, -want[np.arange(41), targets], rtol=2e-6, atol=2e-6)
  np.testing.assert_array_equal(jax.jit(head.predict)(h), want.argmax(-1))


def _dims(jaxpr):
  """Every dimension of every value a jaxpr (and its sub-jaxprs) builds."""
  out = set()
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      out.update(getattr(v.aval, "shape", ()))
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out |= _dims(inner)
  return out


def test_loss_and_accuracy_never_build_the_whole_vocabulary():
  """nll reads the head and one cluster per row; predict goes cluster by
  cluster: neither holds a [rows, V] array (log_probs does, and the check
  sees it there)."""
  head = randomize(make(chunk_rows=8))
  h, targets = hidden(), jnp.arange(37) * 7 % V
  assert V in _dims(jax.make_jaxpr(head.log_probs)(h).jaxpr)
  assert V not in _dims(jax.make_jaxpr(head.nll)(h, targets).jaxpr)
  assert V not in _dims(jax.make_jaxpr(
      jax.grad(lambda h: head.nll(h, targets).sum()))(h).jaxpr)
  assert V not in _dims(jax.make_jaxpr(head.predict)(h).jaxpr)


def test_predict_breaks_ties_and_nans_as_one_argmax_over_the_vocabulary():
  from zebra_jax.model import metrics
  head = randomize(make(chunk_rows=4))
  h = hidden(n=6).at[2].set(jnp.nan)  # a NaN row: every log-prob NaN
  # A zero shortlist: its words tie with each other, and a tail word can
  # only win by beating them all.
  tied = randomize(make(chunk_rows=4))
  tied.weights.tables[0][...] = jnp.zeros_like(tied.weights.tables[0][...])
  tied.biases[0][...] = jnp.zeros_like(tied.biases[0][...])
  for m in (head, tied):
    want = metrics.argmax(m.log_probs(h))
    assert m.predict(h).tolist() == want.tolist()
  assert head.predict(h)[2] == 0


def test_auto_chunk_rows_fit_the_platform_budget():
  """chunk_rows=0: the largest power of two whose [rows, widest cluster]
  float32 block fits the platform's budget, within [16, 1024]."""
  cap = asm.MAX_CHUNK_ROWS
  for platform in ("cpu", "gpu"):
    budget = asm.CHUNK_BUDGET_BYTES.get(platform,
                                        asm.ACCELERATOR_CHUNK_BUDGET_BYTES)
    for widest in (1_000, 20_003, 160_000, 10_000_000):
      rows = asm.auto_chunk_rows(widest, platform)
      assert rows & (rows - 1) == 0 and 16 <= rows <= cap
      assert rows * widest * 4 <= budget or rows == 16
      assert rows * 2 * widest * 4 > budget or rows == cap
  # WikiText-103's clusters (the 160k-word one is the widest)
  assert asm.auto_chunk_rows(160_000, "cpu") == 64
  assert asm.auto_chunk_rows(160_000, "gpu") == 1024
  # a 16,384-word vocabulary: capped, by the budget nowhere
  assert asm.auto_chunk_rows(8_192, "cpu") == 1024
  assert asm.auto_chunk_rows(8_192, "gpu") == 1024
  head = make(chunk_rows=0)  # this test's backend, this vocabulary
  assert head.chunk_rows == asm.auto_chunk_rows(13)  # head: 10 + 3 clusters
  assert head.predict_rows == asm.auto_predict_rows(13)
  assert make(chunk_rows=7).chunk_rows == make(chunk_rows=7).predict_rows == 7
  # predict's chunks: capped on a CPU (cache), as the loss's are nowhere
  assert asm.auto_predict_rows(8_192, "cpu") == 128
  assert asm.auto_predict_rows(160_000, "cpu") == 64
  assert asm.auto_predict_rows(8_192, "gpu") == 1024


def test_tails_run_pieces_on_a_cpu_and_whole_chunks_elsewhere():
  """A CPU rounds a tail's last chunk up to 32-row pieces, and no chunk
  exceeds the rows rounded up to a piece; accelerators, and chunks that
  32 does not divide, run whole chunks of at most the rows."""
  assert asm.chunk_and_piece(1024, 2048, "cpu") == (1024, 32)
  assert asm.chunk_and_piece(1024, 1000, "cpu") == (1024, 32)
  assert asm.chunk_and_piece(1024, 37, "cpu") == (64, 32)
  assert asm.chunk_and_piece(64, 2048, "cpu") == (64, 32)
  assert asm.chunk_and_piece(16, 2048, "cpu") == (16, 16)
  assert asm.chunk_and_piece(100, 2048, "cpu") == (100, 100)
  assert asm.chunk_and_piece(1024, 2048, "gpu") == (1024, 1024)
  assert asm.chunk_and_piece(1024, 37, "gpu") == (37, 37)


def test_the_embeddings_gradient_is_a_scatter_add_not_a_one_hot_dot():
  """The adaptive input's lookups are gathers: XLA compiles their gradient
  to a scatter-add into each table, and no dot yields a table-shaped
  gradient (what a product with a one-hot of the ids would be)."""
  embed = asm.AdaptiveInput(V, D, CUTOFFS, 2, rngs=nnx.Rngs(0),
                            dtype=jnp.bfloat16)
  graphdef, params = nnx.split(embed)
  ids = jnp.arange(21, dtype=jnp.int32).reshape(3, 7) * 2 % V
  weights = jax.random.normal(jax.random.key(0), (3, 7, D))

  def loss(p, ids, weights):  # arguments: constants would be folded away
    return (weights * nnx.merge(graphdef, p)(ids)).sum()
  text = jax.jit(jax.grad(loss)).lower(params, ids, weights).compile(
      ).as_text()
  tables = {f"[{stop - start},{w}]" for (start, stop), w in
            zip(embed.bounds, embed.widths)}
  assert text.count("scatter(") >= len(tables)
  dots = re.findall(r"= f32(\[[\d,]+\])\{[^}]*\} dot\(", text)
  assert dots and not tables & set(dots), dots
