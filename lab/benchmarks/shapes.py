"""The benchmark shapes and the model config each row builds from them.

Shared by every benchmark so that a row's name means one model wherever it
is measured.
"""

import ml_collections
import numpy as np

from zebra_jax.config import base

# Every process that shares a GPU with another: XLA reserves 75% of GPU
# memory at start by default, leaving a child process the rest.
NO_PREALLOCATE = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}

# The word-level shape of the word_* rows: a small LSTM under a large
# vocabulary, tokens drawn from a Zipf law (ids sorted by frequency).
_WORD = dict(hidden=256, vocab=16384, cutoffs=(2048, 8192), div_val=4)
# hidden = embed (tied head); vocab 8192 for the LM rows. native: the CPU
# shapes (float32) also time model.recurrence=native. wide_hidden: the
# kernel stage's S = 1 width past the fused kernel (gpu_kernel.wide_group).
SHAPES = {
    "A": dict(hidden=512, layers=2, batch=32, seq_len=64, vocab=8192,
              dtype="float32", stripes=(1, 2, 4, 8), lm_stripes=(1, 8),
              grouped_stripes=(2, 4, 8), word=_WORD,
              gen_tokens=256, windows=(64, 256, 1024), budget_gb=8.0,
              native=True),
    "gpu": dict(hidden=1024, layers=2, batch=64, seq_len=64, vocab=8192,
                dtype="bfloat16", stripes=(1, 2, 4, 8), lm_stripes=(1, 8),
                grouped_stripes=(2, 4, 8), word=_WORD,
                gen_tokens=256, windows=(64, 256, 1024), budget_gb=40.0,
                wide_hidden=2048),
    "quick": dict(hidden=32, layers=2, batch=4, seq_len=8, vocab=64,
                  dtype="float32", stripes=(1, 4), lm_stripes=(1,),
                  grouped_stripes=(4,),
                  word=dict(hidden=32, vocab=512, cutoffs=(64, 256),
                            div_val=4),
                  gen_tokens=8, windows=(8, 16), budget_gb=1.0, native=True,
                  wide_hidden=64),
}


def word_shape(shape: dict) -> dict:
  """The shape with the word-level hidden size, vocabulary and head."""
  return {**shape, **shape["word"], "zipf": True}


def model_config(shape: dict, stripes: int, grouped=False, head="full",
                 **overrides):
  c = dict(vocab_size=shape["vocab"], embed_size=shape["hidden"],
           hidden_size=shape["hidden"], num_layers=shape["layers"],
           num_stripes=stripes,
           stripe_input="grouped" if grouped else "dense", dropout_embed=0.0,
           dropout_hidden=0.0, dropout_output=0.0, tie_embeddings=True,
           dtype=shape["dtype"], unroll=1, remat=False, head=head,
           recurrence="scan",
           adaptive_cutoffs=tuple(shape.get("cutoffs", ())),
           adaptive_div_val=shape.get("div_val", 1), adaptive_tie=True,
           adaptive_chunk_rows=0,  # sized to the platform, as the product
           cpu_bf16_head="off")
  c.update(overrides)
  # Every other field at the product's default, so a new model field needs
  # no edit here.
  return ml_collections.ConfigDict({**base.get_config().model.to_dict(), **c})


def zipf_probs(vocab: int) -> np.ndarray:
  """p(id) proportional to 1 / (id + 1): word frequencies, ids by rank."""
  p = 1.0 / np.arange(1, vocab + 1)
  return p / p.sum()
