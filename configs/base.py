"""Every config field, defined and explained once.

Experiment configs (demo.py, wt103.py) start from `get_config()` here and
state only what differs. Any field can be overridden on the command line,
e.g. --config.model.num_stripes=8; zebra_jax.runtime.config_checks says which
values are allowed.

  python -m zebra_jax.main --config=configs/base.py   # runs as it stands
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  if variant:
    raise ValueError(f"unknown variant {variant!r}: configs/base.py has "
                     "none; use configs/demo.py:tiny or configs/wt103.py:tiny")
  c = ml_collections.ConfigDict()
  c.seed = 0                    # parameters, dropout and data order
  c.data = dict(
      source="embedded",        # embedded (offline, ships with Python) | wikitext (a folder) | text (files) | hf (a hub dataset)
      path="",                  # wikitext/text: the folder or file(s) to read
      hf_name="Salesforce/wikitext",  # source=hf: the hub dataset (or a local parquet/arrow dir)
      hf_config="wikitext-2-raw-v1",  # source=hf: wikitext-103-v1 | wikitext-103-raw-v1 | wikitext-2-v1 | wikitext-2-raw-v1
      hf_cache_dir="",          # source=hf: datasets cache ("" = HF default); HF_HUB_OFFLINE=1 reads only this
      tokenizer="char",         # char | word (whitespace tokens, <eos>) | bpe (byte-level)
      bpe_vocab_size=4096,      # tokenizer=bpe: vocabulary size to learn
      min_freq=1,               # word: rarer words become <unk>
      max_vocab_size=0,         # word: keep the most frequent words; 0 = all
      valid_fraction=0.05,      # text/embedded sources: share held out per split
      test_fraction=0.05,       # (wikitext and hf have their own splits)
      batching="streams",       # streams (truncated BPTT, carry kept) | random windows
      batch_size=32,            # global rows; split evenly over devices
      seq_len=64,               # tokens per truncated-BPTT window
  )
  c.model = dict(
      vocab_size=0,             # 0 = taken from the tokenizer
      embed_size=256,
      hidden_size=256,
      num_layers=2,
      num_stripes=4,            # hidden_size % num_stripes == 0; 1 = classic LSTM
      stripe_input="dense",     # dense: every stripe reads the whole layer input | grouped: its own 1/S slice (every matmul / S; stripes shuffled between layers)
      dropout_embed=0.0,        # on the embeddings
      dropout_hidden=0.1,       # between layers
      dropout_output=0.1,       # before the softmax head
      tie_embeddings=True,      # head=full: share the embedding when embed_size == hidden_size
      head="full",              # full softmax | adaptive (Grave et al. 2017, for large vocabularies)
      adaptive_cutoffs=(20000, 40000, 200000),  # head=adaptive: cluster edges (ids sorted by frequency); those >= vocab are dropped
      adaptive_div_val=4,       # head=adaptive: cluster i has width hidden_size // div_val**i
      adaptive_tie=True,        # head=adaptive: the input is an AdaptiveInput sharing the head's tables (needs embed_size == hidden_size)
      adaptive_chunk_rows=1024,  # head=adaptive: loss rows per tail-cluster chunk (memory: chunk x cluster size)
      dtype="float32",          # compute dtype: float32 | bfloat16 | float16; parameters stay float32
      unroll=1,                 # lax.scan unroll factor
      remat=False,              # jax.checkpoint the time step (long windows, less memory)
      recurrence="scan",        # scan (lax.scan) | pallas: one fused kernel per stripe on GPUs (interpret mode elsewhere: slow)
  )
  c.optim = dict(
      name="adam",              # adam | adamw | sgd | lamb
      learning_rate=3e-3,       # peak, after warmup
      weight_decay=0.0,         # adamw / lamb
      momentum=0.9,             # sgd only
      b1=0.9, b2=0.999, eps=1e-8,  # adam family
      warmup_steps=100,         # linear warmup from 0
      min_lr_ratio=0.1,         # cosine decays to learning_rate * this at train.num_steps
      clip_norm=1.0,            # global-norm clipping; 0 = off
  )
  c.train = dict(
      num_steps=10_000,         # optimizer updates
      time_budget_minutes=0.0,  # > 0: stop (and save) after this long
      log_every=100,            # steps between train log lines
      eval_every=1000,          # steps between valid evaluations (and best-checkpoint saves)
      eval_max_batches=0,       # valid windows per in-loop evaluation; 0 = the whole split
      report_at_end=True,       # end with valid/test evaluation and a sample
      sample_at_eval=True,      # a short sample from sample.prompt in TensorBoard
      grad_accum_steps=1,       # k micro-batches per update (same update, less memory)
      max_consecutive_skips=100,  # stop after this many non-finite steps in a row
      loss_scale=dict(          # dynamic loss scaling, used when model.dtype=float16
          initial_scale=2.0 ** 15,  # start here
          growth_interval=2000,     # finite steps before the scale grows
          growth_factor=2.0,        # > 1
          backoff_factor=0.5,       # in (0, 1): applied after a non-finite step
          min_scale=1.0),           # never below this
  )
  c.eval = dict(batch_size=16, seq_len=128)  # --mode=eval and the end-of-train report
  c.checkpoint = dict(
      every_steps=1000,         # steps between saves (evaluations save too)
      keep_latest=2,            # newest checkpoints kept for resuming
      keep_best=1,              # best-valid checkpoints kept for eval/sample/serve
  )
  c.profile = dict(
      start_step=0,             # first traced step (>= 2 skips compilation)
      num_steps=0,              # steps traced into workdir/profile; 0 = off
  )
  c.sample = dict(              # --mode=sample, the end-of-train sample, serve's defaults
      prompt="The ",            # text to continue (--prompt)
      max_new_tokens=200,       # tokens generated
      temperature=0.8,          # 0 = greedy
      top_k=0,                  # keep the k most likely tokens; 0 = off
      top_p=0.95,               # nucleus mass kept; 1 = off
      num_samples=1,            # continuations per prompt
      seed=0,
      repetition_penalty=1.0,   # > 1 discourages tokens already in the text; 1 = off
      stop="",                  # end each text before this string; "" = off
      stream=False,             # print tokens as they are generated
      chunk=32,                 # tokens per jitted call: stream and stop granularity
  )
  c.serve = dict(               # --mode=serve: what one request may ask for
      max_body_bytes=1 << 20,
      max_new_tokens=1024,
      max_prompt_tokens=4096,
      max_rows=64,              # prompts x num_samples
      max_score_tokens=100_000,
  )
  return c

