"""The ZebraLSTM language model: embedding, striped LSTM layers, a head.

The layers are `layer.ZebraLSTMLayer`s; given a mesh of several devices
(`mesh=` on every function below), `stripe_parallel.py` splits each layer's
stripes over its "stripe" axis and the embedding's and head's rows over every
device. Parameters are float32; matmuls run in `dtype` with float32
accumulation, and the cell state `c`, the carry and the logits stay float32.

The model is an NNX module used functionally: `create` splits it into a graph
definition and a parameter `nnx.State`, and `apply` merges them inside pure,
jittable functions. `apply` gives logits [B, T, V] (exact log-probabilities
with the adaptive head); `token_sums` gives the loss sums that train and eval
steps need, which for the adaptive head never builds [B*T, V].
"""

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zebra_jax.model import adaptive_softmax as asm, metrics
from zebra_jax.model import cpu_bf16_head, cpu_fused_head, mixed_precision
from zebra_jax.model import stripe_parallel
from zebra_jax.model.dropout import dropout
from zebra_jax.model.config import DTYPES, ModelConfig
from zebra_jax.model.layer import ZebraLSTMLayer, stripe_shuffle

# One (h, c) pair per layer, each [batch, hidden] float32.
Carry = tuple[tuple[jax.Array, jax.Array], ...]


def compute_dtype(name: str) -> jnp.dtype:
  """The jnp dtype of a model.dtype name (one of config.DTYPES)."""
  if name not in DTYPES:
    raise ValueError(f"compute dtype {name!r} is not one of {DTYPES}")
  return getattr(jnp, name)


class ZebraLM(nnx.Module):
  """Embedding -> num_layers x ZebraLSTM -> a full or adaptive softmax head.

  head="full": an [E, V] matrix, tied to the [V, E] embedding when
  tie_embeddings and E == H (params "embed", "head_w", "head_b").
  head="adaptive": `AdaptiveSoftmax` over frequency clusters
  (params "adaptive_softmax"); with adaptive_tie and E == H the input is an
  `AdaptiveInput` sharing its tables and projections ("adaptive_input"),
  otherwise the usual "embed" table. Tying needs E == H under both heads
  because the tied tables live in the LSTM output's width.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg = ModelConfig.of(cfg)
    dt = compute_dtype(cfg.dtype)
    self.dtype = dt
    self.head = cfg.head
    self.dropout_embed = float(cfg.dropout_embed)
    self.dropout_hidden = float(cfg.dropout_hidden)
    self.dropout_output = float(cfg.dropout_output)
    same_width = cfg.embed_size == cfg.hidden_size
    if self.head == "adaptive" and cfg.adaptive_tie and same_width:
      self.adaptive_input = asm.AdaptiveInput(
          cfg.vocab_size, cfg.hidden_size, cfg.adaptive_cutoffs,
          cfg.adaptive_div_val, rngs=rngs, dtype=dt)
    else:
      self.embed = nnx.Param(jax.random.uniform(
          rngs.params(), (cfg.vocab_size, cfg.embed_size), jnp.float32,
          -0.1, 0.1))
    sizes = [cfg.embed_size] + [cfg.hidden_size] * cfg.num_layers
    s = cfg.num_stripes
    bf16_projections = cpu_bf16_head.chosen(cfg.cpu_bf16_projections,
                                            "cpu_bf16_projections")
    bf16_recurrence = cpu_bf16_head.chosen(cfg.cpu_bf16_recurrence,
                                           "cpu_bf16_recurrence")
    # grouped: every layer reads its input in stripes, the first one too when
    # embed_size divides by S (else it reads the embedding densely); the
    # layers after the first read the previous one's outputs shuffled.
    grouped = cfg.stripe_input == "grouped"
    self.shuffle_stripes = grouped and s > 1
    self.layers = nnx.List([
        ZebraLSTMLayer(sizes[i], cfg.hidden_size, s, rngs=rngs,
                       dtype=dt, unroll=cfg.unroll, remat=cfg.remat,
                       grouped=grouped and sizes[i] % s == 0,
                       kernel=cfg.recurrence,
                       bf16_projections=bf16_projections,
                       bf16_recurrence=bf16_recurrence)
        for i in range(cfg.num_layers)])
    if self.head == "adaptive":
      self.tied = hasattr(self, "adaptive_input")
      self.adaptive_softmax = asm.AdaptiveSoftmax(
          cfg.vocab_size, cfg.hidden_size, cfg.adaptive_cutoffs,
          cfg.adaptive_div_val, rngs=rngs, dtype=dt,
          tied_input=self.adaptive_input if self.tied else None,
          chunk_rows=cfg.adaptive_chunk_rows,
          logits_dtype=cfg.head_logits_dtype,
          fused_xent=cfg.head_fused_xent, tile=cfg.adaptive_tile)
      return
    self.tied = bool(cfg.tie_embeddings and same_width)
    self.bf16_head = cpu_bf16_head.chosen(cfg.cpu_bf16_head)
    # The fused loss reads the embedding as the head's matrix: tied only.
    self.fused_head = cfg.cpu_fused_head if self.tied else "off"
    if not self.tied:
      bound = 1.0 / cfg.hidden_size ** 0.5
      self.head_w = nnx.Param(jax.random.uniform(
          rngs.params(), (cfg.hidden_size, cfg.vocab_size), jnp.float32,
          -bound, bound))
    self.head_b = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32))

  def features(self, tokens: jax.Array, carry: Carry, dropout_rng=None,
               rows: stripe_parallel.Rows | None = None):
    """The last LSTM layer's outputs for a window.

    Args:
      tokens: [batch, time] int32.
      carry: one (h, c) pair per layer, each [batch, hidden] float32.
      dropout_rng: a PRNG key for training; None disables dropout.
      rows: `self.rows(batch, mesh)`, the mesh the layers split over and
        how the embedding spreads over it; None: one device.
    Returns:
      hidden [batch, time, hidden] in the compute dtype (output dropout
      applied), and the new carry.
    """
    rngs = (list(jax.random.split(dropout_rng, len(self.layers) + 1))
            if dropout_rng is not None else [None] * (len(self.layers) + 1))
    with jax.named_scope("embedding"):
      x = self._on_rows(rows, ZebraLM._embed, tokens)
      x = dropout(x, self.dropout_embed, rngs[0])
    new_carry = []
    mesh = rows.mesh if rows is not None else None
    for i, layer in enumerate(self.layers):
      with jax.named_scope(f"zebra_lstm_{i}"):
        if mesh is not None:  # the exchange between layers: sharded_layer
          exchange = (("rows" if rows and rows.copies else None) if i == 0
                      else "shuffle" if self.shuffle_stripes else "gather")
          x, layer_carry = stripe_parallel.sharded_layer(
              layer, x, carry[i], mesh, exchange)
        else:
          if i > 0 and self.shuffle_stripes:
            x = stripe_shuffle(x, layer.num_stripes)
          x, layer_carry = layer(x, carry[i])
        new_carry.append(layer_carry)
        last = i == len(self.layers) - 1
        rate = self.dropout_output if last else self.dropout_hidden
        x = dropout(x, rate, rngs[i + 1])
    # Under stripe parallelism x stays split over "stripe" along its units;
    # the head (`stripe_parallel.on_rows`) takes it re-laid out by rows.
    return x, tuple(new_carry)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    if self.head == "adaptive" and self.tied:
      return self.adaptive_input(tokens)  # [B, T, H] float32
    return jnp.take(self.embed[...], tokens, axis=0)  # [B, T, E]

  def rows(self, batch: int, mesh) -> stripe_parallel.Rows | None:
    """How one pass over `batch` rows spreads the embedding and the head
    over `mesh` (`stripe_parallel.rows`; None: no mesh, or one device)."""
    return stripe_parallel.rows(self, batch, mesh, layers="layers")

  def _on_rows(self, rows, local, x: jax.Array, *row_args, total=False):
    """`local(self, x, *row_args)` on each device's rows (as `self.rows`
    laid them out), or on all of them without a mesh."""
    return stripe_parallel.on_rows(self, rows, local, x, *row_args,
                                   total=total)

  def logits(self, hidden: jax.Array, rows=None) -> jax.Array:
    """[B, T, H] -> [B, T, V] float32: logits (full head) or exact
    log-probabilities (adaptive head; their softmax is the same distribution,
    so sampling, scoring and export need not know which head ran)."""
    return self._on_rows(rows, ZebraLM._logits, hidden)

  def _logits(self, hidden: jax.Array) -> jax.Array:
    with jax.named_scope("head"):
      if self.head == "adaptive":
        b, t, h = hidden.shape
        return self.adaptive_softmax.log_probs(
            hidden.reshape(b * t, h)).reshape(b, t, -1)
      b, t, h = hidden.shape
      flat = hidden.reshape(b * t, h)
      if self.tied:  # [V, H]: contracted on its H axis as it is stored
        w, spec = self.embed[...], "nh,vh->nv"
      else:
        w, spec = self.head_w[...], "nh,hv->nv"
      if self.bf16_head and cpu_bf16_head.runs_for(b * t):
        logits = cpu_bf16_head.logits(flat, w, self.tied)
      else:
        logits = mixed_precision.matmul(spec, flat, w, self.dtype)
      return (logits + self.head_b[...]).reshape(b, t, -1)

  def target_log_probs(self, hidden: jax.Array, targets: jax.Array,
                       rows=None) -> jax.Array:
    """log p(target): hidden [B, T, H], targets [B, T] -> [B, T] float32."""
    return self._on_rows(rows, ZebraLM._target_log_probs, hidden, targets)

  def _target_log_probs(self, hidden, targets):
    if self.head == "full":
      logp = jax.nn.log_softmax(self._logits(hidden), axis=-1)
      return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    b, t, h = hidden.shape
    with jax.named_scope("head"):
      nll = self.adaptive_softmax.nll(hidden.reshape(b * t, h),
                                      targets.reshape(b * t))
    return -nll.reshape(b, t)

  def token_sums(self, hidden: jax.Array, targets: jax.Array,
                 with_accuracy: bool = True,
                 rows=None) -> dict[str, jax.Array]:
    """metrics.token_sums for this head, from hidden [B, T, H].

    The adaptive head scores targets with the chunked `nll`, never building
    [B*T, V]; its accuracy needs a full-vocabulary `predict`. The full head
    has the logits, but its accuracy is still one more pass over them;
    without accuracy, the tied head under model.cpu_fused_head scores them
    in one native call that never writes them (`cpu_fused_head`).
    Under both, with_accuracy=False leaves "correct" out.
    """
    return self._on_rows(
        rows,
        functools.partial(ZebraLM._token_sums, with_accuracy=with_accuracy),
        hidden, targets, total=True)

  def _token_sums(self, hidden, targets, with_accuracy):
    if self.head == "full" and not with_accuracy:
      b, t, h = hidden.shape
      bf16 = self.bf16_head and cpu_bf16_head.runs_for(b * t)
      if cpu_fused_head.chosen(self.fused_head, self.dtype, bf16):
        with jax.named_scope("head"):
          # The training loss is this sum over the window's tokens: its
          # cotangent 1/(b t), when they are all the tokens (one device, no
          # micro-batches), is folded into the call's gradients.
          mean = float(np.float32(1.0) / np.float32(b * t))
          loss_sum = cpu_fused_head.loss_sum(
              hidden.reshape(b * t, h), self.embed[...], self.head_b[...],
              targets.reshape(b * t), bf16, mean)
        return {"loss_sum": loss_sum,
                "count": jnp.asarray(targets.size, jnp.float32)}
    if self.head == "full":
      logits = self._logits(hidden)
      with jax.named_scope("loss"):
        return metrics.token_sums(logits, targets, with_accuracy)
    log_probs = self._target_log_probs(hidden, targets)  # chunked nll
    with jax.named_scope("loss"):
      sums = {"loss_sum": -log_probs.sum(),
              "count": jnp.asarray(targets.size, jnp.float32)}
    if with_accuracy:
      with jax.named_scope("accuracy"):
        b, t, h = hidden.shape
        best = self.adaptive_softmax.predict(hidden.reshape(b * t, h))
        sums["correct"] = (best == targets.reshape(b * t)).astype(
            jnp.float32).sum()
    return sums

  def __call__(self, tokens: jax.Array, carry: Carry, dropout_rng=None,
               mesh=None):
    """(logits [batch, time, vocab] float32, new carry); see `logits`.
    mesh: the devices to split the model over (None: one device)."""
    rows = self.rows(tokens.shape[0], mesh)
    hidden, new_carry = self.features(tokens, carry, dropout_rng, rows)
    return self.logits(hidden, rows), new_carry


def init_carry(cfg: ModelConfig, batch_size: int) -> Carry:
  """Zero (h, c) for every layer: the state at the start of a stream."""
  cfg = ModelConfig.of(cfg)
  zeros = lambda: jnp.zeros((batch_size, cfg.hidden_size), jnp.float32)
  return tuple((zeros(), zeros()) for _ in range(cfg.num_layers))


def create(cfg: ModelConfig, seed: int):
  """Builds the model and returns (graphdef, params): params is an nnx.State."""
  return nnx.split(ZebraLM(cfg, rngs=nnx.Rngs(seed)))


def abstract(cfg: ModelConfig):
  """(graphdef, params as ShapeDtypeStructs), without allocating: for restores."""
  return nnx.split(nnx.eval_shape(lambda: ZebraLM(cfg, rngs=nnx.Rngs(0))))


def apply(graphdef, params, tokens, carry, dropout_rng=None, *, mesh=None):
  """Pure forward pass: (logits [B, T, V] float32, new carry).

  For the adaptive head the "logits" are exact log-probabilities. mesh, here
  and below: the devices the layers' stripes and the rows split over
  (`stripe_parallel`); None or one device: the whole model on one device.
  """
  return nnx.merge(graphdef, params)(tokens, carry, dropout_rng, mesh)


def last_logits(graphdef, params, tokens, carry, *, mesh=None):
  """(logits of the last position [B, V] float32, new carry), no dropout.

  What consuming a prompt needs: the head runs on one position, not T.
  """
  lm = nnx.merge(graphdef, params)
  rows = lm.rows(tokens.shape[0], mesh)
  hidden, new_carry = lm.features(tokens, carry, rows=rows)
  return lm.logits(hidden[:, -1:], rows)[:, 0], new_carry


def decode_step(params, carry, tokens, *, graphdef, mesh=None):
  """One generated token: tokens [B] -> (logits [B, V] float32, new carry).

  The one recurrent step that sampling, serving, export and the generation
  benchmark all run; bind `graphdef` (and `mesh`) with functools.partial.
  """
  logits, new_carry = apply(graphdef, params, tokens[:, None], carry,
                            mesh=mesh)
  return logits[:, 0], new_carry


def token_sums(graphdef, params, inputs, targets, carry, dropout_rng=None,
               with_accuracy: bool = True, *, mesh=None):
  """Pure loss pass: ({"loss_sum", "count"[, "correct"]} float32, new carry).

  What train and eval steps call: `metrics.token_sums(apply(...)[0],
  targets, with_accuracy)` for the full head; the chunked adaptive-softmax
  loss otherwise (`ZebraLM.token_sums`).
  """
  lm = nnx.merge(graphdef, params)
  rows = lm.rows(inputs.shape[0], mesh)
  hidden, new_carry = lm.features(inputs, carry, dropout_rng, rows)
  return lm.token_sums(hidden, targets, with_accuracy, rows), new_carry


def target_log_probs(graphdef, params, inputs, targets, carry, *,
                     mesh=None):
  """Pure scoring pass, no dropout: (log p(targets) [B, T] float32, carry).

  The adaptive head reads them off its chunked loss, without [B, T, V].
  """
  lm = nnx.merge(graphdef, params)
  rows = lm.rows(inputs.shape[0], mesh)
  hidden, new_carry = lm.features(inputs, carry, rows=rows)
  return lm.target_log_probs(hidden, targets, rows), new_carry


def num_params(params: Any) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def stripe_blocks(params, layer: int) -> Sequence[jax.Array]:
  """The recurrent blocks of one layer, [G, 4G] each (for inspection and tests)."""
  return list(params["layers"][layer]["w_h"][...])
