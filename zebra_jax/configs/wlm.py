"""PyTorch's examples/word_language_model recipe, as a zebra_jax config.

  python -m zebra_jax.main --config=wlm --workdir=runs/wlm \
      --config.data.path=/data/wikitext-2
  python -m zebra_jax.main --config=wlm:grouped8 --workdir=runs/wlm8 \
      --config.data.path=/data/wikitext-2
  python -m lab.wlm_compare --seconds=180   # both, side by side with PyTorch

The example's defaults (its main.py): a 2-layer LSTM of 200 units over
200-wide embeddings tied to the decoder, dropout 0.2 on the embeddings,
between the layers and before the decoder, batch 20, bptt 35, plain SGD at
lr 20 with global-norm clipping 0.25, 40 epochs, evaluation batch 10.

What differs, and why:
  schedule   the example divides lr by 4 after an epoch whose valid loss did
             not improve; zebra_jax has no plateau rule, so lr stays 20
             (warmup 0, min_lr_ratio 1: a constant schedule)
  init       zebra_jax's own initialisers, not nn.LSTM's uniform(+-1/sqrt(H))
  head       on a CPU, the tied head's training loss in one native call
             (model.cpu_fused_head=auto: no [700, 10k] logits written) with
             bf16 products and float32 sums where the CPU has AVX512_BF16
             (model.cpu_bf16_head=auto; float32 elsewhere): its loss within
             1e-3 of float32's, the step faster (lab/results-log.md,
             2026-11-28); XLA's float32 head on a GPU or without the library
  layers     on such a CPU, a dense layer's window matmuls outside its time
             loop (projection, input and weight gradients) in bf16 with
             float32 sums too (model.cpu_bf16_projections=auto; grouped8's
             small stripes keep their in-loop float32 products): the
             dense1 step 1-5% faster, interleaved with float32's (lab/
             results-log.md, 2026-11-28); and the time loops' recurrent
             products in bf16 (model.cpu_bf16_recurrence=auto, h or dz
             rounded each step as oneDNN's bf16 LSTM does): the dense1
             step's recurrence 4.4 against 6.3 ms; float32 elsewhere

Variants: "" is the example's classic LSTM (dense, 1 stripe); grouped8 is
8 stripes of 25 units, each reading its own 1/8 of the layer input (every
matmul of the layers / 8); tiny shrinks it for tests.

Its time loops: base's model.recurrence=auto, native C++ on a CPU.
Measured against the example's loop at equal wall-clock: docs/figures.md.
"""

import ml_collections

from zebra_jax.config import base


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = base.get_config()
  c.data.update(
      source="wikitext",   # wiki.{train,valid,test}.tokens under data.path
      tokenizer="word",    # whitespace words + <eos>, as the example's Corpus
      min_freq=1,          # WikiText's files carry their own <unk>
      max_vocab_size=0,
      batch_size=20,
      seq_len=35,
  )
  c.model.update(
      embed_size=200,
      hidden_size=200,
      num_layers=2,
      num_stripes=1,
      stripe_input="dense",
      dropout_embed=0.2,
      dropout_hidden=0.2,
      dropout_output=0.2,
      tie_embeddings=True,
      head="full",
      cpu_fused_head="auto",
      cpu_bf16_head="auto",
      cpu_bf16_projections="auto",
      cpu_bf16_recurrence="auto",
  )
  c.optim.update(name="sgd", learning_rate=20.0, momentum=0.0, warmup_steps=0,
                 min_lr_ratio=1.0, clip_norm=0.25)
  c.train.update(
      num_steps=120_000,   # ~40 epochs of WikiText-2 (2,983 batches each)
      log_every=200,
      eval_every=3_000,    # ~once an epoch of WikiText-2
  )
  c.eval.update(batch_size=10, seq_len=35)  # the example's evaluate()
  c.checkpoint.every_steps = 3_000
  c.sample.update(prompt="The", max_new_tokens=60)
  if variant == "grouped8":
    c.model.update(num_stripes=8, stripe_input="grouped")
  elif variant == "tiny":  # same code path, shrunk for tests and smoke runs
    c.data.update(batch_size=8, seq_len=8)
    c.model.update(embed_size=16, hidden_size=16)
    c.train.update(num_steps=10, log_every=5, eval_every=5, eval_max_batches=2)
    c.eval.update(batch_size=8, seq_len=8)
    c.checkpoint.every_steps = 5
    c.sample.update(max_new_tokens=5)
  elif variant:
    raise ValueError(f"unknown variant {variant!r}: use wlm, wlm:grouped8 or "
                     "wlm:tiny")
  return c
