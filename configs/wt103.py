"""ZebraLSTM on WikiText-103 (word level): the recipe for a multi-GPU node.

  python -m zebra_jax.main --config=configs/wt103.py --workdir=runs/wt103 \
      --config.data.path=/data/wikitext-103
  python -m zebra_jax.main --config=configs/wt103.py:tiny --workdir=/tmp/tiny \
      --config.data.path=tests/data/wikitext-tiny     # seconds, on CPU

`data.path` is a folder in WikiText format (wiki.train.tokens, wiki.valid.tokens,
wiki.test.tokens), e.g. the unpacked wikitext-103-v1 archive.

The recipe (a target, not yet a measured result of this project): 2 layers of
hidden 2048 in 8 stripes, 512-dim tied embedding through a projection-free
head would not fit 267k words, so the vocabulary is capped at 100k words here
until the adaptive softmax lands. Global batch 128 x 128 tokens, Adam 1e-3 with
warmup + cosine, clip 0.25. Expect test perplexity in the 36-48 band that LSTMs
of this class reach (Rae et al. 36.4; Merity et al. QRNN 33.0).
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data = dict(
      source="wikitext",        # wikitext (folder) | hf (Salesforce/wikitext or a local parquet/arrow dir) | text | embedded
      path="",                  # wikitext/text: REQUIRED, e.g. /data/wikitext-103
      hf_name="Salesforce/wikitext",  # source=hf: the hub dataset
      hf_config="wikitext-103-v1",    # source=hf: wikitext-103-v1 | wikitext-103-raw-v1 | wikitext-2-v1 | wikitext-2-raw-v1
      hf_cache_dir="",          # source=hf: datasets cache ("" = HF default); HF_HUB_OFFLINE=1 reads only this
      tokenizer="word",         # WikiText convention: whitespace tokens, <eos>
      bpe_vocab_size=32000,     # tokenizer=bpe: byte-level BPE size
      min_freq=1,
      max_vocab_size=100_000,   # full softmax over the top words (adaptive softmax: not wired in yet)
      valid_fraction=0.05,      # unused: WikiText has its own splits
      test_fraction=0.05,
      batching="streams",
      batch_size=128,           # global; split evenly over devices
      seq_len=128,              # truncated-BPTT window
  )
  c.model = dict(
      vocab_size=0,             # from the tokenizer
      embed_size=512,
      hidden_size=2048,
      num_layers=2,
      num_stripes=8,            # 8 stripes of 256: 8x fewer recurrent FLOPs
      dropout_embed=0.1,
      dropout_hidden=0.2,
      dropout_output=0.2,
      tie_embeddings=True,      # only when embed_size == hidden_size
      dtype="bfloat16",         # GPU default; parameters stay float32
      unroll=8,
      remat=False,
  )
  c.optim = dict(
      name="adam", learning_rate=1e-3, weight_decay=0.0, momentum=0.9,
      b1=0.9, b2=0.999, eps=1e-8, warmup_steps=2000, min_lr_ratio=0.01,
      clip_norm=0.25)
  c.train = dict(
      num_steps=200_000,        # ~1.6 epochs of 103M tokens at 16k tokens/step
      time_budget_minutes=0.0,
      log_every=200,
      eval_every=4000,
      eval_max_batches=0,
      report_at_end=True,
      sample_at_eval=True,      # a short sample from sample.prompt in TensorBoard
      grad_accum_steps=1,       # k micro-batches per update (same update, less memory)
      max_consecutive_skips=100,  # stop after this many non-finite steps in a row
      loss_scale=dict(          # dynamic loss scaling, used when model.dtype=float16
          initial_scale=2.0 ** 15, growth_interval=2000, growth_factor=2.0,
          backoff_factor=0.5, min_scale=1.0),
  )
  c.eval = dict(batch_size=16, seq_len=256)
  c.serve = dict(                # --mode=serve request limits
      max_body_bytes=1 << 20, max_new_tokens=1024, max_prompt_tokens=4096,
      max_rows=64, max_score_tokens=100_000)
  c.profile = dict(
      start_step=0,             # first traced step (>= 2 skips compilation)
      num_steps=0,              # steps traced into workdir/profile; 0 = off
  )
  c.checkpoint = dict(every_steps=4000, keep_latest=2, keep_best=1)
  c.sample = dict(prompt="The history of", max_new_tokens=60, temperature=0.8,
                  top_k=0, top_p=0.95, num_samples=1, seed=0,
                  repetition_penalty=1.0, stop="", stream=False, chunk=32)
  if variant == "tiny":  # same code path, shrunk for tests and smoke runs
    c.data.update(batch_size=8, seq_len=16, max_vocab_size=0)
    c.model.update(embed_size=32, hidden_size=32, num_stripes=4, unroll=1,
                   dtype="float32", dropout_embed=0.0)
    c.optim.update(warmup_steps=5, clip_norm=1.0, learning_rate=3e-2)
    c.train.update(num_steps=20, log_every=5, eval_every=10, eval_max_batches=4)
    c.eval.update(batch_size=8, seq_len=16)
    c.checkpoint.every_steps = 10
    c.sample.update(prompt="the", max_new_tokens=10)
  elif variant:
    raise ValueError(f"unknown variant {variant!r}: use configs/wt103.py or "
                     "configs/wt103.py:tiny")
  return c
