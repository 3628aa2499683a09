"""ZebraLSTM on the embedded offline corpus: the quickstart job, sized for a laptop CPU.

  python -m zebra_jax.main --config=configs/demo.py --workdir=runs/demo
  python -m zebra_jax.main --config=configs/demo.py --workdir=runs/demo --mode=eval
  python -m zebra_jax.main --config=configs/demo.py --workdir=runs/demo --mode=sample \
      --prompt="The module"
  python -m zebra_jax.main --config=configs/demo.py:tiny --workdir=/tmp/tiny  # seconds

The corpus is English documentation text shipped with every Python install
(pydoc topics and standard-library docstrings), so it needs no network.
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data = dict(
      source="embedded",        # embedded | wikitext (a folder) | text (files) | hf
      path="",                  # folder or file(s) for wikitext/text sources
      hf_name="Salesforce/wikitext",  # source=hf only: the hub dataset
      hf_config="wikitext-2-raw-v1",  # source=hf only: its config
      hf_cache_dir="",          # source=hf only: datasets cache ("" = HF default)
      tokenizer="char",         # char | word | bpe
      bpe_vocab_size=4096,      # tokenizer=bpe: byte-level BPE size
      min_freq=1,               # word vocab: drop rarer words to <unk>
      max_vocab_size=0,         # word vocab: keep the most frequent; 0 = all
      valid_fraction=0.05,      # text/embedded sources: share held out per split
      test_fraction=0.05,
      batching="streams",       # streams (truncated BPTT, carry kept) | random
      batch_size=32,            # global; split evenly over devices
      seq_len=64,               # tokens per truncated-BPTT window
  )
  c.model = dict(
      vocab_size=0,             # 0 = taken from the tokenizer
      embed_size=256,
      hidden_size=256,
      num_layers=2,
      num_stripes=4,            # hidden_size % num_stripes == 0; 1 = classic LSTM
      dropout_embed=0.0,
      dropout_hidden=0.1,       # between layers
      dropout_output=0.1,       # before the softmax head
      tie_embeddings=True,      # when embed_size == hidden_size
      head="full",              # full | adaptive softmax; a char vocabulary is small: full
      adaptive_cutoffs=(20000, 40000, 200000),  # head=adaptive: cluster edges (ids sorted by frequency); those >= vocab are dropped
      adaptive_div_val=4,       # head=adaptive: cluster i has width hidden_size // div_val**i
      adaptive_tie=True,        # head=adaptive: the input is an AdaptiveInput sharing the head's tables (needs embed_size == hidden_size)
      adaptive_chunk_rows=1024,  # head=adaptive: rows per tail-cluster chunk in the loss (memory: chunk x cluster size)
      dtype="float32",          # compute dtype; parameters stay float32
      unroll=1,                 # lax.scan unroll factor (>1 was slower on CPU)
      remat=False,              # jax.checkpoint the time step (long windows)
  )
  c.optim = dict(
      name="adam",              # adam | adamw | sgd | lamb
      learning_rate=3e-3,
      weight_decay=0.0,
      momentum=0.9,             # sgd only
      b1=0.9, b2=0.999, eps=1e-8,
      warmup_steps=100,
      min_lr_ratio=0.1,         # cosine decays to learning_rate * this
      clip_norm=1.0,            # global-norm clipping; 0 = off
  )
  c.train = dict(
      num_steps=1500,           # about 4 minutes on 2 CPU cores (~14k tok/s)
      time_budget_minutes=6.0,  # > 0: stop (and save) after this long
      log_every=100,
      eval_every=500,
      eval_max_batches=0,       # 0 = the whole valid split each eval
      report_at_end=True,
      sample_at_eval=True,      # a short sample from sample.prompt in TensorBoard
      grad_accum_steps=1,       # k micro-batches per update (same update, less memory)
      max_consecutive_skips=100,  # stop after this many non-finite steps in a row
      loss_scale=dict(          # dynamic loss scaling, used when model.dtype=float16
          initial_scale=2.0 ** 15, growth_interval=2000, growth_factor=2.0,
          backoff_factor=0.5, min_scale=1.0),       # --mode=train ends with valid/test eval + a sample
  )
  c.eval = dict(batch_size=16, seq_len=128)
  c.serve = dict(                # --mode=serve request limits
      max_body_bytes=1 << 20, max_new_tokens=1024, max_prompt_tokens=4096,
      max_rows=64, max_score_tokens=100_000)
  c.profile = dict(
      start_step=0,             # first traced step (>= 2 skips compilation)
      num_steps=0,              # steps traced into workdir/profile; 0 = off
  )
  c.checkpoint = dict(every_steps=500, keep_latest=2, keep_best=1)
  c.sample = dict(prompt="The ", max_new_tokens=300, temperature=0.8, top_k=0,
                  top_p=0.95, num_samples=1, seed=0,
                  repetition_penalty=1.0, stop="", stream=False, chunk=32)
  if variant == "tiny":  # same code path, shrunk for tests and smoke runs
    c.model.update(embed_size=32, hidden_size=32, num_layers=2, num_stripes=4,
                   unroll=1)
    c.data.update(batch_size=8, seq_len=16)
    c.train.update(num_steps=20, log_every=5, eval_every=10, eval_max_batches=4,
                   time_budget_minutes=0.0)
    c.eval.update(batch_size=8, seq_len=32)
    c.checkpoint.every_steps = 10
    c.sample.max_new_tokens = 20
  elif variant:
    raise ValueError(f"unknown variant {variant!r}: use configs/demo.py or configs/demo.py:tiny")
  return c
