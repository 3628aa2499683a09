"""ZebraLSTM on WikiText-103 (word level): the recipe for a multi-GPU node.

  python -m zebra_jax.main --config=wt103 --workdir=runs/wt103 \
      --config.data.path=/data/wikitext-103
  python -c "from tests.helpers import write_wikitext; write_wikitext('/tmp/wt')"
  python -m zebra_jax.main --config=wt103:tiny --workdir=/tmp/tiny \
      --config.data.path=/tmp/wt     # a small WikiText-format folder: seconds, on CPU

`data.path` is a folder in WikiText format (wiki.train.tokens, wiki.valid.tokens,
wiki.test.tokens), e.g. the unpacked wikitext-103-v1 archive.

The recipe. Its step's speed is measured on a GPU (below); a full training
run is not, so the perplexity is a TARGET.

  data       every word: the 267,735-word vocabulary (max_vocab_size=0),
             streams of global batch 128 x window 128 = 16,384 tokens/step,
             the LSTM state carried across windows (truncated BPTT)
  model      2 ZebraLSTM layers, hidden 2048 in 8 stripes of 256, bfloat16
             compute with float32 parameters; adaptive softmax (Grave et al.
             2017) with Transformer-XL's cutoffs 20k/40k/200k and div_val 4
             (cluster widths 2048/512/128/32), tied to an adaptive input of
             the same tables: 113.3M parameters (75.2M of them embeddings,
             37.8M LSTM)
  dropout    0.1 on embeddings, 0.2 between layers and before the head
  optimizer  Adam 1e-3 (b2 0.999), 2,000 warmup steps, cosine to 1e-5 over
             100,000 steps (1.64B tokens, ~16 epochs), global-norm clip 0.25

MEASURED speed: `bash launch/gpu_report.sh wt103` from the repository
root times the step on one GPU (synthetic Zipf ids); lab/results-log.md
holds its reports. The head's gradient dots in bf16
(zebra_jax/model/mixed_precision.py) made the step faster than with
float32 ones, timed side by side (`python -m lab.mixed_grads`). Several
GPUs are not measured yet.

The recurrence: the recipe keeps base's model.recurrence=auto: the scan on
a GPU, the native C++ loops on a CPU (float32). On a GPU,
--config.model.recurrence=pallas runs its
stripes (G=256, bfloat16) in the fused kernel
(zebra_jax/model/recurrence/pallas.py): 16 batch rows per program, 8 warps,
U_s (512 KiB a stripe, more than a program's registers or shared memory)
re-read from L2 every step in 64-row blocks; 8 stripes x 128/16 = 64
programs a layer on one GPU, faster than the scan (the report's wt103
stage); `python -m lab.pallas_plans --groups=wt103` timed 6 plans beside
the scan and this one was the fastest (against 32-row blocks, 4 warps
and 32 batch rows).

TARGET test perplexity: 36-48, the band recurrent models of this class reach
on WikiText-103. References: Rae et al. 2018 (Fast Parametric Learning with
Activation Memorization) report test 36.4 for their LSTM baseline; Merity et
al. 2018 (An Analysis of Neural Language Modeling at Multiple Scales) reach
33.0 with a 4-layer QRNN, a bar below the band.
"""

import ml_collections

from zebra_jax.config import base


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = base.get_config()
  c.data.update(
      source="wikitext",        # or hf: Salesforce/wikitext, or a local parquet/arrow dir
      hf_config="wikitext-103-v1",  # source=hf
      tokenizer="word",         # WikiText convention: whitespace tokens, <eos>
      bpe_vocab_size=32000,     # if tokenizer=bpe
      batch_size=128,           # x seq_len = 16,384 tokens per step
      seq_len=128,
  )  # max_vocab_size=0: all 267,735 words (the adaptive softmax affords them)
  c.model.update(
      embed_size=2048,          # == hidden_size: adaptive input and softmax share tables
      hidden_size=2048,
      num_stripes=8,            # 8 stripes of 256: 8x fewer recurrent FLOPs; dense
                                # input, which tied for best at equal wall-clock on
                                # the embedded corpus's characters and words
                                # (docs/figures.md)
      dropout_embed=0.1,
      dropout_hidden=0.2,
      dropout_output=0.2,
      head="adaptive",          # base's cutoffs are Transformer-XL's WikiText-103 clusters;
                                # div_val=4 gives widths 2048/512/128/32 (74M table
                                # parameters; div_val=1 would spend 548M)
      dtype="bfloat16",         # GPU default; parameters stay float32
      unroll=8,
  )
  c.optim.update(learning_rate=1e-3, warmup_steps=2000, min_lr_ratio=0.01,
                 clip_norm=0.25)
  c.train.update(
      num_steps=100_000,        # 1.64B tokens = ~16 epochs of 103M
      log_every=200,
      eval_every=4000,
  )
  # Perplexity alone: accuracy would cost a 267k-word pass per token.
  c.eval.update(seq_len=256, accuracy=False)
  c.checkpoint.every_steps = 4000
  c.sample.update(prompt="The history of", max_new_tokens=60)
  if variant == "tiny":  # same code path, shrunk for tests and smoke runs
    c.data.update(batch_size=8, seq_len=16)
    c.model.update(embed_size=32, hidden_size=32, num_stripes=4, unroll=1,
                   dtype="float32", dropout_embed=0.0,
                   adaptive_cutoffs=(8, 16),  # a ~24-word test vocab: 3 clusters
                   adaptive_div_val=2, adaptive_chunk_rows=32)
    c.optim.update(warmup_steps=5, clip_norm=1.0, learning_rate=3e-2)
    c.train.update(num_steps=20, log_every=5, eval_every=10, eval_max_batches=4)
    c.eval.update(batch_size=8, seq_len=16, accuracy=True)  # predict's path
    c.checkpoint.every_steps = 10
    c.sample.update(prompt="the", max_new_tokens=10)
  elif variant:
    raise ValueError(f"unknown variant {variant!r}: use wt103 or wt103:tiny")
  return c
