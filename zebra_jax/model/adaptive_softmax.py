"""Adaptive softmax (Grave et al. 2017) and adaptive input, as Transformer-XL
uses them on WikiText-103: exact log-probabilities for a 267k-word vocabulary
at a fraction of a full softmax's cost.

The vocabulary must be sorted by frequency (the word tokenizer's order) and is
cut by `cutoffs` into clusters: with cutoffs (20000, 40000, 200000),

    cluster 0  ids [0, 20000)         the shortlist: in the head, width d
    cluster 1  ids [20000, 40000)     a tail: width d / div_val
    cluster 2  ids [40000, 200000)    a tail: width d / div_val**2
    cluster 3  ids [200000, V)        a tail: width d / div_val**3

The head is a softmax over [shortlist words | one logit per tail cluster];
a tail word's log-probability is its cluster's head log-probability plus its
log-softmax inside the cluster. Tail clusters read the hidden state through a
down-projection [d, d_i], so rare words cost few parameters and FLOPs.
`AdaptiveInput` holds the same per-cluster tables and projections for the
input side; `AdaptiveSoftmax(..., tied_input=embedding)` shares them, as
Transformer-XL's tie_weight + tie_projs do.

Parameters are float32; matmuls run in `dtype` with float32 accumulation and
logits, log-softmax and losses are float32. With no cutoffs the head is the
whole vocabulary: exactly a full softmax.

The loss (`nll`) is exact and reads, for each row, the head and its target's
own cluster: no full-vocabulary pass. Only accuracy (`predict`) and sampling
(`log_probs`) read every cluster. Both the loss and `predict` run in chunks
of `chunk_rows` rows, so memory holds one [chunk_rows, cluster size] block
at a time; `chunk_rows=0` sizes them to the machine (`auto_chunk_rows`).

Three switches change how the loss (`nll`) runs, never what it computes:
each is a candidate for the GPU's step, off by default.

  logits_dtype="compute"  every cluster's loss logits come out of their
      matmul in `dtype` (float32 accumulation, rounded once), and the
      log-sum-exp and softmax read them as float32: the head's
      [rows, shortlist] logits, the step's largest arrays, take half the
      bytes. One bf16 rounding of each logit: the loss moves by about
      2**-9 of a logit's size per row, much less on the mean.
  fused_xent  the head (shortlist words and cluster logits, one table) is
      scored as the tails are: in chunks of rows whose backward recomputes
      their logits (`_owned_rows_nll`), so no [rows, shortlist] array is
      kept between the forward and backward passes. Costs one more
      [rows, d] x [d, shortlist] matmul.
  tile  each cluster's loss logits padded with masked columns (zero rows,
      bias -inf) to a multiple of `tile` (128: a GPU's matmul tile), the
      head's word and cluster logits then one matmul. Padding rather than
      moving the cutoffs: no id changes cluster, no parameter changes
      shape, and WikiText-103's 267,735 words are no multiple of 128
      anyway; its head (20,000 words + 3 clusters = 20,003 logits, an odd
      row stride) and last tail (67,735) are not multiples, its 160,000-
      word tail already is (not padded). The clusters' widths (2048, 512,
      128, 32 at div_val 4) are the matmuls' contracted axis and stay:
      the 32-wide tail's logits are bound by memory, and padding it to 128
      would quadruple its table's reads.

The embedding's gradient needs no switch: the lookups are gathers
(`jnp.take`), whose transpose XLA compiles to a scatter-add into the
table, not a dot against a one-hot of the ids (tests/model/
test_adaptive_softmax.py holds the compiled step to that).
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from zebra_jax.errors import UserError
from zebra_jax.model import metrics, mixed_precision


def cluster_bounds(vocab_size: int, cutoffs: Sequence[int]) -> tuple:
  """[(start, stop)] per cluster. Cutoffs at or beyond the vocabulary are
  dropped, so one config serves a 267k vocabulary and a tiny test corpus."""
  cutoffs = [int(c) for c in cutoffs]
  if any(b <= a for a, b in zip(cutoffs, cutoffs[1:])) or any(
      c <= 0 for c in cutoffs):
    raise UserError(f"model.adaptive_cutoffs={tuple(cutoffs)} must be positive "
                    "and strictly increasing, e.g. (20000, 40000, 200000)")
  edges = [0] + [c for c in cutoffs if c < vocab_size] + [vocab_size]
  return tuple(zip(edges[:-1], edges[1:]))


def cluster_widths(d_model: int, num_clusters: int, div_val: int) -> tuple:
  """d_model // div_val**i per cluster, at least 1."""
  return tuple(max(1, d_model // int(div_val) ** i)
               for i in range(num_clusters))


# Bytes of one [chunk_rows, widest cluster] float32 block that chunk_rows=0
# aims at. A CPU's caches and its host memory (shared with everything else)
# favour small blocks: at 1024 rows a 267k vocabulary's eval blocks are 1 GB
# and peak memory doubled; accelerators want rows to fill their matmul
# units.
CHUNK_BUDGET_BYTES = {"cpu": 64 << 20}
ACCELERATOR_CHUNK_BUDGET_BYTES = 2 << 30
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 16, 1024
# The rows a tail's last, partial chunk is rounded up to, by platform. A
# tail scores its owned rows as whole chunks in a loop, then the rest as
# one piece per set bit of (rest / piece rows): 289 owned rows of 1,024-row
# chunks run as pieces of 256 and 64 rows (320 scored), where whole chunks
# scored 1,024, and 128-row chunks 384 in three loop iterations. On a CPU,
# whose time is FLOPs, that made the word-level adaptive head (lab.bench's
# head_adaptive) faster than 128-row chunks. Elsewhere the piece is the
# whole chunk: accelerators want rows
# to fill their matmul units more than they lose to padding.
PLATFORM_PIECE_ROWS = {"cpu": 32}
# At most this many rows a chunk of `predict` (accuracy), by platform, where
# chunk_rows=0: on a CPU, 1,024-row chunks of the word-level head were
# slower than 128-row ones, its [rows, 8,192] blocks outgrowing the caches.
PLATFORM_MAX_PREDICT_ROWS = {"cpu": 128}
# How the loss's logits leave their matmuls (module docstring): float32, or
# the compute dtype.
LOGITS_DTYPES = ("float32", "compute")


def auto_chunk_rows(widest: int, platform: str | None = None) -> int:
  """The power of two of rows whose [rows, widest] float32 block fits the
  platform's budget (`CHUNK_BUDGET_BYTES`), within [16, 1024].

  widest: the largest cluster (the shortlist with its cluster logits, or a
  tail). WikiText-103's 160k-word cluster gets 64 rows on a CPU, 1024 on a
  GPU; a 10k vocabulary gets 1024 on both.
  """
  platform = platform or jax.default_backend()
  budget = CHUNK_BUDGET_BYTES.get(platform, ACCELERATOR_CHUNK_BUDGET_BYTES)
  rows = max(1, budget // (4 * max(1, widest)))
  rows = 1 << (rows.bit_length() - 1)  # the power of two at or below
  return int(min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, rows)))


def auto_predict_rows(widest: int, platform: str | None = None) -> int:
  """auto_chunk_rows within the platform's `PLATFORM_MAX_PREDICT_ROWS`."""
  platform = platform or jax.default_backend()
  return min(auto_chunk_rows(widest, platform),
             PLATFORM_MAX_PREDICT_ROWS.get(platform, MAX_CHUNK_ROWS))


def chunk_and_piece(chunk_rows: int, n: int,
                    platform: str | None = None) -> tuple[int, int]:
  """(chunk, piece) rows of a tail's loss over n rows: pieces of the
  platform's `PLATFORM_PIECE_ROWS` where that divides chunk_rows, the chunk
  no longer than n rounded up to a piece; else whole chunks of
  min(chunk_rows, n) rows, the piece a whole chunk."""
  piece = PLATFORM_PIECE_ROWS.get(platform or jax.default_backend(),
                                  chunk_rows)
  if piece >= chunk_rows or chunk_rows % piece:
    c = max(1, min(chunk_rows, n))
    return c, c
  return min(chunk_rows, -(-n // piece) * piece), piece


def _matmul(x, w, dtype, spec, low_result=False):
  if low_result:  # only then: a stand-in matmul need not know the option
    return mixed_precision.matmul(spec, x, w, dtype, low_result=True)
  return mixed_precision.matmul(spec, x, w, dtype)


def _chunk_logits(h, proj, table, bias, dtype, low_logits=False):
  """A chunk's rows h [c, d] -> (z [c, d_i], word logits [c, n_i] float32).

  low_logits: the matmul's result in `dtype` (see logits_dtype above),
  made float32 as the bias is added, in whatever reads it."""
  z = h if proj is None else _matmul(h, proj, dtype, "nd,dk->nk")
  return z, _matmul(z, table, dtype, "nk,vk->nv", low_logits) + bias


def tiled(table, bias, tile: int):
  """(table [n, k], bias [n]) with zero rows and -inf biases appended up to
  a multiple of `tile` rows (0: as they are): logits no softmax gives
  mass to, no target names, and whose gradients are sliced away."""
  extra = -bias.shape[0] % tile if tile else 0
  if not extra:
    return table, bias
  return (jnp.pad(table, ((0, extra), (0, 0))),
          jnp.concatenate([bias, jnp.full((extra,), -jnp.inf, bias.dtype)]))


@jax.custom_vjp
def _permute_rows(x, order, inverse):
  """x[order], whose gradient is g[inverse]: a gather, where autodiff's
  transpose of a gather is a scatter-add, one row at a time on a CPU (a
  visible share of the word-level adaptive head's step, for two tails)."""
  return jnp.take(x, order, axis=0)


def _permute_rows_fwd(x, order, inverse):
  return jnp.take(x, order, axis=0), inverse


def _permute_rows_bwd(inverse, g):
  return jnp.take(g, inverse, axis=0), None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _over_owned_rows(owned, c, piece, run, state):
  """state after run(start, rows, state) over rows [0, owned rounded up to
  `piece`): whole chunks of c in a loop whose trip count is known only at
  run time, then the rest as one static piece of piece * 2**k rows per set
  bit k of rest // piece, each under a cond (in no loop: 289 rows run as
  256 + 64 with c=1024 and piece=32, where whole 128-row chunks scored 384
  in three iterations). The state's arrays pass through every run."""
  total = (owned + piece - 1) // piece * piece
  whole = total // c
  state = jax.lax.fori_loop(0, whole, lambda k, s: run(k * c, c, s), state)
  start, rest = whole * c, (total - whole * c) // piece
  for k in reversed(range((c // piece - 1).bit_length())):
    taken = (rest >> k) & 1 == 1
    state = jax.lax.cond(taken, functools.partial(run, start, piece << k),
                         lambda s: s, state)
    start = start + jnp.where(taken, piece << k, 0)
  return state


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _owned_rows_nll(rows, words, owned, proj, table, bias, c, piece, dtype,
                    low_logits=False):
  """-log p(word | cluster) of the first `owned` rows of rows [M, d] whose
  local word ids are words [M] (rows past them score 0 or garbage, and are
  masked by the caller); M is a multiple of `piece`, which divides c.

  Why a hand-written backward pass: `owned` is only known at run time, and
  JAX differentiates no loop whose trip count is. Under autodiff a scan over
  every chunk had to skip the others with a cond, whose backward still
  built and summed zero gradients of the whole cluster's weights per
  skipped chunk. Here forward and backward score the same chunks and
  pieces (`_over_owned_rows`), and the backward recomputes their logits
  from their rows (nothing [M, n_i] is kept). proj None: the cluster reads
  the hidden state as it is. low_logits: see `_chunk_logits`.
  """
  return _owned_rows_nll_fwd(rows, words, owned, proj, table, bias, c, piece,
                             dtype, low_logits)[0]


def _owned_rows_nll_fwd(rows, words, owned, proj, table, bias, c, piece,
                        dtype, low_logits=False):
  def run(start, n, scores):
    h = jax.lax.dynamic_slice_in_dim(rows, start, n)
    t = jax.lax.dynamic_slice_in_dim(words, start, n)
    _, logits = _chunk_logits(h, proj, table, bias, dtype, low_logits)
    target = jnp.take_along_axis(logits, t[:, None], -1)[:, 0]
    return jax.lax.dynamic_update_slice_in_dim(
        scores, jax.nn.logsumexp(logits, -1) - target, start, 0)
  scores = _over_owned_rows(owned, c, piece, run,
                            jnp.zeros(rows.shape[:1], jnp.float32))
  return scores, (rows, words, owned, proj, table, bias)


def _owned_rows_nll_bwd(c, piece, dtype, low_logits, residuals, g):
  rows, words, owned, proj, table, bias = residuals

  def run(start, n, grads):
    d_rows, d_proj, d_table, d_bias = grads
    h = jax.lax.dynamic_slice_in_dim(rows, start, n)
    t = jax.lax.dynamic_slice_in_dim(words, start, n)
    g_k = jax.lax.dynamic_slice_in_dim(g, start, n)
    z, logits = _chunk_logits(h, proj, table, bias, dtype, low_logits)
    one_hot = jnp.arange(logits.shape[-1]) == t[:, None]
    d_logits = g_k[:, None] * (jax.nn.softmax(logits, -1) - one_hot)
    d_table = d_table + _matmul(d_logits, z, dtype, "nv,nk->vk")
    d_bias = d_bias + d_logits.sum(0)
    d_z = _matmul(d_logits, table, dtype, "nv,vk->nk")
    if proj is None:
      d_h = d_z
    else:
      d_proj = d_proj + _matmul(h, d_z, dtype, "nd,nk->dk")
      d_h = _matmul(d_z, proj, dtype, "nk,dk->nd")
    d_rows = jax.lax.dynamic_update_slice_in_dim(
        d_rows, d_h.astype(rows.dtype), start, 0)
    return d_rows, d_proj, d_table, d_bias

  zeros = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)
  d_rows, d_proj, d_table, d_bias = _over_owned_rows(
      owned, c, piece, run,
      (jnp.zeros_like(rows), zeros(proj), zeros(table), zeros(bias)))
  cast = lambda d, x: None if x is None else d.astype(x.dtype)
  return (d_rows, None, None, cast(d_proj, proj), cast(d_table, table),
          cast(d_bias, bias))


_owned_rows_nll.defvjp(_owned_rows_nll_fwd, _owned_rows_nll_bwd)


class AdaptiveInput(nnx.Module):
  """Per-cluster embedding tables [n_i, d_i] and projections [d_model, d_i]
  (none where d_i == d_model): ids -> [..., d_model] float32."""

  def __init__(self, vocab_size: int, d_model: int, cutoffs=(), div_val=1, *,
               rngs: nnx.Rngs, dtype=jnp.float32):
    self.bounds = cluster_bounds(vocab_size, cutoffs)
    self.widths = cluster_widths(d_model, len(self.bounds), div_val)
    self.d_model, self.dtype = d_model, dtype
    self.tables = nnx.List([
        nnx.Param(jax.random.uniform(rngs.params(), (stop - start, w),
                                     jnp.float32, -0.1, 0.1))
        for (start, stop), w in zip(self.bounds, self.widths)])
    # A [d_model, d_model] identity would only cost memory: skip it.
    self.projs = nnx.List([
        nnx.Param(jax.random.normal(rngs.params(), (d_model, w), jnp.float32)
                  / d_model ** 0.5)
        for w in self.widths if w != d_model])

  def proj(self, i: int):
    """Cluster i's projection [d_model, d_i], or None (identity)."""
    if self.widths[i] == self.d_model:
      return None
    return self.projs[sum(w != self.d_model for w in self.widths[:i])][...]

  def __call__(self, ids: jax.Array) -> jax.Array:
    """ids [...] int32 -> embeddings [..., d_model] float32."""
    out = jnp.zeros(ids.shape + (self.d_model,), jnp.float32)
    for i, (start, stop) in enumerate(self.bounds):
      inside = (ids >= start) & (ids < stop)
      local = jnp.clip(ids - start, 0, stop - start - 1)
      e = jnp.take(self.tables[i][...], local, axis=0)  # [..., d_i]
      p = self.proj(i)
      if p is not None:
        e = _matmul(e, p, self.dtype, "...k,dk->...d")
      out = out + jnp.where(inside[..., None], e, 0.0)
    return out


class AdaptiveSoftmax(nnx.Module):
  """The LM head: `nll(hidden, targets)` for training, `log_probs` for
  sampling, `predict` for accuracy. Hidden states are [N, d_model]."""

  def __init__(self, vocab_size: int, d_model: int, cutoffs=(), div_val=1, *,
               rngs: nnx.Rngs, dtype=jnp.float32,
               tied_input: AdaptiveInput | None = None,
               chunk_rows: int = 0, logits_dtype: str = "float32",
               fused_xent: bool = False, tile: int = 0):
    if tied_input is None:
      tied_input = AdaptiveInput(vocab_size, d_model, cutoffs, div_val,
                                 rngs=rngs, dtype=dtype)
    elif tied_input.bounds != cluster_bounds(vocab_size, cutoffs):
      raise UserError("a tied adaptive input must use the same vocab_size and "
                      "cutoffs as the adaptive softmax")
    self.weights = tied_input  # shared with the model's input when tied
    self.bounds, self.widths = tied_input.bounds, tied_input.widths
    widest = max([self.bounds[0][1] + len(self.bounds) - 1]
                 + [stop - start for start, stop in self.bounds[1:]])
    # 0: sized to this process's backend when the model is built
    self.dtype = dtype
    self.chunk_rows = int(chunk_rows) or auto_chunk_rows(widest)
    self.predict_rows = int(chunk_rows) or auto_predict_rows(widest)
    # The loss's switches (module docstring); sampling and accuracy keep
    # float32 logits as wide as the clusters.
    if logits_dtype not in LOGITS_DTYPES:
      raise ValueError(f"logits_dtype {logits_dtype!r} is not one of "
                       f"{LOGITS_DTYPES}")
    self.low_logits = logits_dtype == "compute"
    self.fused_xent, self.tile = bool(fused_xent), int(tile)
    num_tails = len(self.bounds) - 1
    self.biases = nnx.List([nnx.Param(jnp.zeros((stop - start,), jnp.float32))
                            for start, stop in self.bounds])
    if num_tails:  # zero-size arrays cannot be checkpointed: none then
      self.cluster_w = nnx.Param(jnp.zeros((num_tails, self.widths[0]),
                                           jnp.float32))  # [tails, d_0]
      self.cluster_b = nnx.Param(jnp.zeros((num_tails,), jnp.float32))

  @property
  def shortlist(self) -> int:
    return self.bounds[0][1]

  def _cluster_logits(self, hidden, i, low_logits=False):
    """hidden [n, d] -> (z [n, d_i], cluster i's word logits [n, n_i])."""
    return _chunk_logits(hidden, self.weights.proj(i),
                         self.weights.tables[i][...], self.biases[i][...],
                         self.dtype, low_logits)

  def _head_logits(self, hidden, low_logits=False):
    """hidden [N, d] -> (shortlist logits [N, shortlist], cluster logits
    [N, tails] or None without tails)."""
    z, words = self._cluster_logits(hidden, 0, low_logits)
    if len(self.bounds) == 1:
      return words, None
    return words, (_matmul(z, self.cluster_w[...], self.dtype, "nk,ck->nc",
                           low_logits) + self.cluster_b[...])

  def _head_table(self):
    """The head's word and cluster logits as one table: ([shortlist + tails
    rounded up to `tile`, d], its bias), cluster i - 1's row after the
    words (`tiled`)."""
    table, bias = self.weights.tables[0][...], self.biases[0][...]
    if len(self.bounds) > 1:
      table = jnp.concatenate([table, self.cluster_w[...]])
      bias = jnp.concatenate([bias, self.cluster_b[...]])
    return tiled(table, bias, self.tile)

  def head_log_probs(self, hidden: jax.Array) -> jax.Array:
    """[N, d] -> [N, shortlist + tails] float32: words, then clusters."""
    words, clusters = self._head_logits(hidden)
    if clusters is None:
      return jax.nn.log_softmax(words, -1)
    return jax.nn.log_softmax(jnp.concatenate([words, clusters], -1), -1)

  def log_probs(self, hidden: jax.Array) -> jax.Array:
    """Every word's log-probability: [N, d] -> [N, V] float32 (sampling)."""
    head = self.head_log_probs(hidden)
    parts = [head[:, :self.shortlist]]
    for i in range(1, len(self.bounds)):
      tail = jax.nn.log_softmax(self._cluster_logits(hidden, i)[1], -1)
      parts.append(head[:, self.shortlist + i - 1, None] + tail)
    return jnp.concatenate(parts, -1)

  def nll(self, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """-log p(target) per row: hidden [N, d], targets [N] int -> [N] float32.

    Tail clusters never build [N, n_i]: each tail sorts its rows to the front
    and scores them in chunks of `chunk_rows`, in a loop that stops after
    the last whole chunk of rows it owns, then the rest in power-of-two
    pieces (`_owned_rows_nll`), forward and backward, so memory is one
    [chunk_rows, n_i] block per cluster and the rows a tail does not own
    cost at most a piece.
    """
    tail_id = sum((targets >= start).astype(jnp.int32)
                  for start, _ in self.bounds[1:])  # 0 = shortlist
    nll = self._head_nll(hidden, targets, tail_id)
    for i in range(1, len(self.bounds)):
      start, stop = self.bounds[i]
      local = jnp.clip(targets - start, 0, stop - start - 1)
      nll = nll + self._tail_nll(hidden, local, tail_id == i, i)
    return nll

  def _head_nll(self, hidden, targets, tail_id):
    """-log p(word or cluster) in the head's softmax: [N]. The same value
    as `head_log_probs` gives, without concatenating the words' and the
    clusters' logits into one [N, shortlist + tails] array (and slicing
    its gradient apart again): their log-sum-exps combine. With fused_xent
    or a tile, one table (`_head_table`) scores both instead."""
    if self.fused_xent or self.tile:
      return self._one_table_head_nll(hidden, targets, tail_id)
    words, clusters = self._head_logits(hidden, self.low_logits)
    lse = jax.nn.logsumexp(words, -1)
    picked = jnp.take_along_axis(
        words, jnp.clip(targets, 0, self.shortlist - 1)[:, None], -1)[:, 0]
    if clusters is not None:
      lse = jnp.logaddexp(lse, jax.nn.logsumexp(clusters, -1))
      cluster = jnp.take_along_axis(
          clusters, jnp.maximum(tail_id - 1, 0)[:, None], -1)[:, 0]
      picked = jnp.where(tail_id == 0, picked, cluster)
    return lse - picked

  def _one_table_head_nll(self, hidden, targets, tail_id):
    """_head_nll through `_head_table`: whole (tile alone), or as the tails
    score their rows, every row owned (fused_xent)."""
    table, bias = self._head_table()
    picked = jnp.where(tail_id == 0, targets, self.shortlist + tail_id - 1)
    if not self.fused_xent:
      _, logits = _chunk_logits(hidden, None, table, bias, self.dtype,
                                self.low_logits)
      return (jax.nn.logsumexp(logits, -1)
              - jnp.take_along_axis(logits, picked[:, None], -1)[:, 0])
    n = hidden.shape[0]
    c, piece = chunk_and_piece(self.chunk_rows, n)
    padded = -(-n // piece) * piece
    scores = _owned_rows_nll(
        jnp.pad(hidden, ((0, padded - n), (0, 0))),
        jnp.pad(picked, (0, padded - n)), jnp.asarray(n, jnp.int32), None,
        table, bias, c, piece, self.dtype, self.low_logits)
    return scores[:n]

  def _tail_nll(self, hidden, local, inside, i):
    """-log p(word | cluster i) for rows `inside`, 0 elsewhere: [N]."""
    n = hidden.shape[0]
    c, piece = chunk_and_piece(self.chunk_rows, n)
    padded = -(-n // piece) * piece
    # Owned rows first, each side in its order: row r goes to inverse[r]
    # (counts, not a sort: on a CPU an argsort of the rows is several times
    # the cumulative sums' time).
    owned = inside.astype(jnp.int32)
    inverse = jnp.where(inside, jnp.cumsum(owned) - 1,
                        owned.sum() + jnp.cumsum(1 - owned) - 1)
    order = jnp.zeros_like(inverse).at[inverse].set(
        jnp.arange(n, dtype=inverse.dtype))
    rows = jnp.pad(_permute_rows(hidden, order, inverse),
                   ((0, padded - n), (0, 0)))
    words = jnp.pad(jnp.take(local, order), (0, padded - n))
    table, bias = tiled(self.weights.tables[i][...], self.biases[i][...],
                        self.tile)
    scores = _owned_rows_nll(rows, words, owned.sum(), self.weights.proj(i),
                             table, bias, c, piece, self.dtype,
                             self.low_logits)
    scores = _permute_rows(scores[:n], inverse, order)
    return jnp.where(inside, scores, 0.0)

  def predict(self, hidden: jax.Array) -> jax.Array:
    """argmax word per row, [N, d] -> [N] int32: the first largest
    log-probability's id, as `metrics.argmax(log_probs)` gives it.

    `predict_rows` rows at a time (chunk_rows, or with chunk_rows=0 at
    most the platform's `PLATFORM_MAX_PREDICT_ROWS`), one cluster at a
    time: only a [rows, cluster size] block exists at once, never [rows, V].
    """
    n = hidden.shape[0]
    c = max(1, min(self.predict_rows, n))
    num_chunks = -(-n // c)
    rows = jnp.pad(hidden, ((0, num_chunks * c - n), (0, 0)))
    best = jax.lax.map(self._predict_chunk, rows.reshape(num_chunks, c, -1))
    return best.reshape(-1)[:n]

  def _predict_chunk(self, h):
    head = self.head_log_probs(h)
    words = head[:, :self.shortlist]
    best_id = metrics.argmax(words)
    best = jnp.take_along_axis(words, best_id[:, None], -1)[:, 0]
    for i in range(1, len(self.bounds)):
      start = self.bounds[i][0]
      tail = (head[:, self.shortlist + i - 1, None]
              + jax.nn.log_softmax(self._cluster_logits(h, i)[1], -1))
      tail_id = metrics.argmax(tail)
      value = jnp.take_along_axis(tail, tail_id[:, None], -1)[:, 0]
      # Earlier ids win ties; the first NaN wins, as in one argmax over V.
      better = (value > best) | (jnp.isnan(value) & ~jnp.isnan(best))
      best = jnp.where(better, value, best)
      best_id = jnp.where(better, start + tail_id, best_id)
    return best_id
