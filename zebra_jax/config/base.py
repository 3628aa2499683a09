"""Every config field, defined once: its default, what it may hold, what it means.

Experiment configs (zebra_jax/configs/demo.py, wt103.py) start from
`get_config()` here and state only what differs. Training takes an
override of any field on the command line, e.g.
--config.model.num_stripes=8; which fields the other modes read is
config/mode_fields.py. Validation (runtime/config_checks.py) reads each
field's rule from `FIELDS`.
"""

import ml_collections

from zebra_jax.config.rules import (
    BOOL, CHECKED_WITH_OTHERS, FRACTION, GROWTH_FACTOR, INT, NON_NEGATIVE,
    NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, RATE, RATIO, SHRINK_FACTOR,
    TEXT, Checked, Field as F, one_of)
from zebra_jax.data import batching, sources, tokenizers
from zebra_jax.engine import params as sampling
from zebra_jax.model import config as model_config


def _sampling(name: str) -> Checked:
  return Checked(lambda value: sampling.problem(name, value))


FIELDS = dict(
    seed=F(0, INT, "parameters, dropout and data order"),
    data=dict(
        source=F("embedded", one_of(sources.SOURCES), "embedded (offline, "
                 "ships with Python) | wikitext (a folder) | text (files) | hf "
                 "(a hub dataset) | tfds (a prepared TFDS dataset)"),
        path=F("", TEXT, "wikitext/text: the folder or file(s) to read; hf: "
               "a local parquet/arrow/save_to_disk folder"),
        hf_name=F("Salesforce/wikitext", TEXT, "source=hf: the hub dataset"),
        hf_config=F("wikitext-2-raw-v1", TEXT, "source=hf: wikitext-103-v1 | "
                    "wikitext-103-raw-v1 | wikitext-2-v1 | wikitext-2-raw-v1"),
        hf_cache_dir=F("", TEXT, "source=hf: datasets cache ('' = HF "
                       "default); with HF_HUB_OFFLINE=1 (or the hub "
                       "unreachable) the hub cache's snapshot, else this"),
        hf_text_column=F("text", TEXT, "source=hf: the column holding the "
                         "text, a row a line"),
        tfds_name=F("", TEXT, "source=tfds: the prepared dataset, e.g. lm1b "
                    "(or NAME/CONFIG:VERSION)"),
        tfds_data_dir=F("", TEXT, "source=tfds: where it was prepared ('' = "
                        "TFDS's default, ~/tensorflow_datasets)"),
        tfds_train_split=F("train", TEXT, "source=tfds: a TFDS split, "
                           "slicing allowed, e.g. train[:99%]"),
        tfds_valid_split=F("validation", TEXT, "source=tfds: e.g. "
                           "train[99%:] for a dataset without one"),
        tfds_test_split=F("test", TEXT, "source=tfds: e.g. test"),
        tfds_text_key=F("text", TEXT, "source=tfds: the feature holding the "
                        "text, a row a line"),
        tokenizer=F("char", one_of(tokenizers.TOKENIZERS), "char | word "
                    "(whitespace tokens, <eos>) | bpe (byte-level)"),
        bpe_vocab_size=F(4096, POSITIVE_INT,
                         "tokenizer=bpe: vocabulary size to learn"),
        min_freq=F(1, NON_NEGATIVE_INT, "word: rarer words become <unk>"),
        max_vocab_size=F(0, NON_NEGATIVE_INT,
                         "word: keep the most frequent words; 0 = all"),
        valid_fraction=F(0.05, FRACTION, "text/embedded: share held out for "
                         "valid; hf: of train's rows, when the dataset has "
                         "no validation split"),
        test_fraction=F(0.05, FRACTION, "text/embedded: share held out for "
                        "test; hf: of train's rows, when the dataset has no "
                        "test split (wikitext has its own)"),
        batching=F("streams", one_of(batching.BATCHERS), "streams (truncated "
                   "BPTT, carry kept) | random windows"),
        batch_size=F(32, POSITIVE_INT, "global rows; split evenly over "
                     "devices"),
        seq_len=F(64, POSITIVE_INT, "tokens per truncated-BPTT window"),
    ),
    model=dict(
        vocab_size=F(0, NON_NEGATIVE_INT, "0 = taken from the tokenizer"),
        embed_size=F(256, POSITIVE_INT, "width of the token embedding (the "
                     "first layer's input)"),
        hidden_size=F(256, POSITIVE_INT, "units per ZebraLSTM layer, all "
                      "stripes together"),
        num_layers=F(2, POSITIVE_INT, "stacked ZebraLSTM layers"),
        num_stripes=F(4, POSITIVE_INT, "hidden_size % num_stripes == 0; 1 = "
                      "classic LSTM"),
        stripe_input=F("dense", one_of(model_config.STRIPE_INPUTS), "dense: "
                       "every stripe reads the whole layer input | grouped: "
                       "its own 1/S slice (every matmul / S; stripes shuffled "
                       "between layers)"),
        dropout_embed=F(0.0, RATE, "on the embeddings"),
        dropout_hidden=F(0.1, RATE, "between layers"),
        dropout_output=F(0.1, RATE, "before the softmax head"),
        tie_embeddings=F(True, BOOL, "head=full: share the embedding when "
                         "embed_size == hidden_size"),
        head=F("full", one_of(model_config.HEADS), "full softmax | adaptive "
               "(Grave et al. 2017, for large vocabularies)"),
        adaptive_cutoffs=F((20000, 40000, 200000), CHECKED_WITH_OTHERS,
                           "head=adaptive: cluster edges (ids sorted by "
                           "frequency); those >= vocab are dropped"),
        adaptive_div_val=F(4, POSITIVE_INT, "head=adaptive: cluster i has "
                           "width hidden_size // div_val**i"),
        adaptive_tie=F(True, BOOL, "head=adaptive: the input is an "
                       "AdaptiveInput sharing the head's tables (needs "
                       "embed_size == hidden_size)"),
        adaptive_chunk_rows=F(0, NON_NEGATIVE_INT, "head=adaptive: rows per "
                              "loss/accuracy chunk (memory: rows x cluster "
                              "size); 0 = sized to the device (a 267k "
                              "vocabulary: 64 on a CPU, 1024 on a GPU)"),
        head_logits_dtype=F("float32", one_of(
            model_config.HEAD_LOGITS_DTYPES), "head=adaptive: the loss's "
            "logits as their matmuls return them: float32 | compute (in "
            "model.dtype, accumulated in float32 and rounded once; "
            "log-sum-exp and softmax in float32): half the bytes of the "
            "step's largest arrays"),
        head_fused_xent=F(False, BOOL, "head=adaptive: score the head's "
                          "words and clusters in chunks of "
                          "adaptive_chunk_rows rows whose backward "
                          "recomputes their logits, as the tails do: no "
                          "[rows, shortlist] logits kept for the backward, "
                          "one more matmul"),
        adaptive_tile=F(0, NON_NEGATIVE_INT, "head=adaptive: pad each "
                        "cluster's loss logits with masked columns to a "
                        "multiple of this (128: a GPU's matmul tile; the "
                        "head's words and clusters then one matmul); no id "
                        "changes cluster; 0 = off"),
        dtype=F("float32", one_of(model_config.DTYPES), "compute dtype; "
                "parameters stay float32"),
        unroll=F(1, POSITIVE_INT, "lax.scan unroll factor"),
        remat=F(False, BOOL, "recompute the gates in the backward pass (long "
                "windows, less memory)"),
        recurrence=F("auto", one_of(model_config.RECURRENCES), "auto: "
                     "native on CPUs in float32, the scan elsewhere | scan "
                     "(lax.scan) | pallas: one fused kernel per stripe on "
                     "GPUs (interpret mode elsewhere: slow) | "
                     "pallas_stream: the scan's loop with each step one "
                     "kernel tiled over the hidden units, for stripes too "
                     "wide for pallas (GPUs; interpret mode elsewhere) | "
                     "native: the "
                     "time loops as compiled C++ on CPUs, float32 (built on "
                     "first use; the scan elsewhere)"),
        cpu_bf16_head=F("off", one_of(model_config.CPU_BF16_HEADS), "the "
                        "full head's matmuls on a CPU: off (float32) | "
                        "auto: bf16 operands, float32 sums, on the CPU's "
                        "bf16 units where it has them (AVX512_BF16) and "
                        "the native library is built for them; float32 "
                        "elsewhere"),
        cpu_bf16_projections=F("off", one_of(
            model_config.CPU_BF16_PROJECTIONS), "a layer's window matmuls "
            "outside its time loop (input projection, the inputs' and "
            "weights' gradients) on a CPU: off (float32) | auto: bf16 "
            "operands, float32 sums, where cpu_bf16_head's would run and "
            "the layer runs the native recurrence with stripes too large "
            "for its in-loop products, on windows of 64 rows or more; "
            "float32 elsewhere (other recurrences, small stripes, "
            "sampling steps, no bf16 units)"),
        cpu_bf16_recurrence=F("off", one_of(
            model_config.CPU_BF16_RECURRENCE), "a layer's recurrent "
            "matmuls inside its time loops (h W_h forward, dz W_hᵀ "
            "backward) on a CPU: off (float32) | auto: h (or dz) and W_h "
            "rounded to bf16 each step, float32 sums and cell, where "
            "cpu_bf16_head's would run and the layer runs the native "
            "recurrence with stripes too large for its in-loop products; "
            "float32 elsewhere (other recurrences, small stripes, sampling "
            "steps, no bf16 units)"),
        cpu_fused_head=F("off", one_of(model_config.CPU_FUSED_HEADS),
                         "the tied full head's loss on a CPU, in training "
                         "and in eval without accuracy: off "
                         "(XLA: the [rows, vocab] logits written) | on: "
                         "logits, softmax cross-entropy and gradients by "
                         "chunks of rows in one native call (bf16 products "
                         "where cpu_bf16_head runs, else float32), where "
                         "the head is tied, model.dtype is float32 and the "
                         "native library loads; XLA elsewhere | auto: on "
                         "only with the bf16 products (float32's call is no "
                         "faster than XLA's head)"),
    ),
    optim=dict(
        name=F("adam", one_of(("adam", "adamw", "sgd", "lamb")),
               "the optax optimizer"),
        learning_rate=F(3e-3, POSITIVE, "peak, after warmup"),
        weight_decay=F(0.0, NON_NEGATIVE, "adamw / lamb"),
        momentum=F(0.9, RATE, "sgd only"),
        b1=F(0.9, RATE, "adam family: first-moment decay"),
        b2=F(0.999, RATE, "adam family: second-moment decay"),
        eps=F(1e-8, POSITIVE, "adam family: denominator floor"),
        warmup_steps=F(100, NON_NEGATIVE_INT, "linear warmup from 0"),
        min_lr_ratio=F(0.1, RATIO, "cosine decays to learning_rate * this at "
                       "train.num_steps"),
        clip_norm=F(1.0, NON_NEGATIVE, "global-norm clipping; 0 = off"),
    ),
    train=dict(
        num_steps=F(10_000, POSITIVE_INT, "optimizer updates"),
        time_budget_minutes=F(0.0, NON_NEGATIVE, "> 0: stop (and save) after "
                              "this long"),
        log_every=F(100, POSITIVE_INT, "steps between train log lines"),
        eval_every=F(1000, POSITIVE_INT, "steps between valid evaluations "
                     "(and best-checkpoint saves)"),
        eval_max_batches=F(0, NON_NEGATIVE_INT, "valid windows per in-loop "
                           "evaluation; 0 = the whole split"),
        report_at_end=F(True, BOOL, "end with valid/test evaluation and a "
                        "sample"),
        sample_at_eval=F(True, BOOL, "a short sample from sample.prompt in "
                         "TensorBoard"),
        grad_accum_steps=F(1, POSITIVE_INT, "k micro-batches per update (same "
                           "update, less memory)"),
        max_consecutive_skips=F(100, POSITIVE_INT, "stop after this many "
                                "non-finite steps in a row"),
        loss_scale=dict(  # dynamic loss scaling, used when model.dtype=float16
            initial_scale=F(2.0 ** 15, POSITIVE, "start here"),
            growth_interval=F(2000, POSITIVE_INT, "finite steps before the "
                              "scale grows"),
            growth_factor=F(2.0, GROWTH_FACTOR, "applied when it grows"),
            backoff_factor=F(0.5, SHRINK_FACTOR, "applied after a non-finite "
                             "step"),
            min_scale=F(1.0, POSITIVE, "never below this"),
        ),
    ),
    eval=dict(  # --mode=eval and the end-of-train report
        batch_size=F(16, POSITIVE_INT, "rows per evaluation batch"),
        seq_len=F(128, POSITIVE_INT, "tokens per evaluation window"),
        max_tokens=F(0, NON_NEGATIVE_INT, "tokens scored per split (the "
                     "first max_tokens / batch_size of every row), named "
                     "in the report; 0 = the whole split"),
        accuracy=F(True, BOOL, "count correct predictions; with "
                   "head=adaptive that is a full-vocabulary pass per token "
                   "(false: the exact loss alone, head + own cluster)"),
    ),
    parallel=dict(
        stripe_devices=F(1, POSITIVE_INT, "devices that share one model, each "
                         "running its share of every layer's stripes (must "
                         "divide model.num_stripes and the device count); "
                         "the rest split the batch. 1 = data parallel only"),
    ),
    checkpoint=dict(
        every_steps=F(1000, POSITIVE_INT, "steps between saves (evaluations "
                      "save too)"),
        keep_latest=F(2, POSITIVE_INT, "newest checkpoints kept for resuming"),
        keep_best=F(1, NON_NEGATIVE_INT, "best-valid checkpoints kept for "
                    "eval/sample/serve"),
    ),
    profile=dict(
        start_step=F(0, NON_NEGATIVE_INT, "first traced step (>= 2 skips "
                     "compilation); counted from the resumed step when a "
                     "resume has passed it"),
        num_steps=F(0, NON_NEGATIVE_INT, "steps traced into workdir/profile; "
                    "0 = off"),
    ),
    sample=dict(  # --mode=sample, the end-of-train sample, serve's defaults
        # The sampling parameters' bounds are the serving engine's own
        # (engine/params.py), so a config and a request agree.
        prompt=F("The ", TEXT, "text to continue (--prompt)"),
        max_new_tokens=F(200, _sampling("max_new_tokens"), "tokens generated"),
        temperature=F(0.8, _sampling("temperature"), "0 = greedy"),
        top_k=F(0, _sampling("top_k"), "keep the k most likely tokens; 0 = "
                "off"),
        top_p=F(0.95, _sampling("top_p"), "nucleus mass kept; 1 = off"),
        min_p=F(0.0, _sampling("min_p"), "drop tokens less likely than this "
                "times the most likely one; 0 = off"),
        num_samples=F(1, POSITIVE_INT, "continuations per prompt"),
        seed=F(0, INT, "row i's token j is drawn with fold_in(fold_in(seed, "
               "i), j): the same seed gives the same text (the server draws "
               "a fresh seed for a request that sends none)"),
        repetition_penalty=F(1.0, _sampling("repetition_penalty"), "> 1 "
                             "discourages tokens already in the text; 1 = "
                             "off"),
        presence_penalty=F(0.0, _sampling("presence_penalty"), "subtracted "
                           "from the logit of a token already generated; 0 "
                           "= off"),
        frequency_penalty=F(0.0, _sampling("frequency_penalty"), "subtracted "
                            "per time a token was generated; 0 = off"),
        stop=F("", TEXT, "end each text before this string ('' = off); in a "
               "--config.sample.* override, \\n and \\t mean newline and tab"),
        stream=F(False, BOOL, "print tokens as they are generated"),
        chunk=F(32, POSITIVE_INT, "tokens per decode call of the engine "
                "in --mode=sample (serve: serve.decode_block), times "
                "serve.small_batch_blocks for a small batch"),
    ),
    serve=dict(  # --mode=serve: what one request may ask for (else HTTP 400)
        max_body_bytes=F(1 << 20, POSITIVE_INT, "request body size"),
        max_new_tokens=F(1024, POSITIVE_INT, "tokens generated per row"),
        max_prompt_tokens=F(4096, POSITIVE_INT, "tokens in one prompt"),
        max_rows=F(64, POSITIVE_INT, "prompts x num_samples"),
        max_score_tokens=F(100_000, POSITIVE_INT, "tokens scored per request"),
        slots=F(64, POSITIVE_INT, "rows generating at once (the engine's "
                "running batch); more requests wait in the queue"),
        queue=F(256, NON_NEGATIVE_INT, "requests waiting for a slot; beyond "
                "it the answer is 503 with Retry-After"),
        prefill_chunk=F(16, POSITIVE_INT, "prompt tokens per row per prefill "
                        "call: the one compiled prompt shape"),
        prefill_rows=F(16, POSITIVE_INT, "prompts per prefill call (on a CPU "
                       "16 cost what 8 do: the call is overhead-bound)"),
        decode_block=F(4, POSITIVE_INT, "tokens per decode call: fewer "
                       "dispatches against a request joining or stopping up "
                       "to this many steps late"),
        small_batch_blocks=F(4, POSITIVE_INT, "decode blocks per call while "
                             "at most serve.small_batch_rows rows decode and "
                             "no prompt fills or request waits: fewer "
                             "dispatches, the same tokens; 1 = off (2 "
                             "programs fewer)"),
        small_batch_rows=F(4, POSITIVE_INT, "the most rows decoding at "
                           "which calls are serve.small_batch_blocks long"),
        prefix_cache_bytes=F(256 << 20, NON_NEGATIVE_INT, "host memory for "
                             "prompt prefixes' model states (LRU): a prompt "
                             "starts after its longest cached prefix, same "
                             "tokens as without; 0 = off"),
        api_key=F("", TEXT, "'' = none; else every route but /health and "
                  "/metrics needs 'Authorization: Bearer KEY' (or set "
                  "$ZEBRA_JAX_API_KEY)"),
        api_key_file=F("", TEXT, "a file holding the API key (when api_key "
                       "is ''): keeps the key out of the command line"),
        chat_template=F("", TEXT, "how /v1/chat/completions writes a "
                        "message: {role} and {content}; '' = '{role}: "
                        "{content}\\n' (a role-prefixed transcript)"),
        allowed_origins=F("", TEXT, "CORS: '' = off; '*' or comma-separated "
                          "origins a browser page may call from"),
        drain_seconds=F(30.0, NON_NEGATIVE, "after SIGTERM/SIGINT: how long "
                        "requests in flight may take to finish"),
        access_log=F(True, BOOL, "one stderr line per request: method, path, "
                     "status, tokens, milliseconds"),
    ),
    export=dict(  # --mode=export: the Triton model's config.pbtxt
        triton_instance=F("auto", one_of(("auto", "cpu", "gpu")), "auto (GPU "
                          "if jax sees one, else CPU) | cpu | gpu"),
        triton_gpus=F("", TEXT, "instance=gpu: GPU ids, e.g. '0,1'; '' = "
                      "one instance on every GPU"),
        triton_max_batch_size=F(64, POSITIVE_INT, "rows Triton batches"),
        triton_queue_delay_us=F(2000, NON_NEGATIVE_INT, "how long Triton "
                                "waits to merge requests into one batch"),
    ),
)


def fields(tree=None, prefix: str = ""):
  """(dotted name, Field) for every field, in definition order."""
  for key, value in (FIELDS if tree is None else tree).items():
    if isinstance(value, dict):
      yield from fields(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _defaults(tree) -> dict:
  return {key: _defaults(value) if isinstance(value, dict) else value.default
          for key, value in tree.items()}


def get_config() -> ml_collections.ConfigDict:
  """A fresh config holding every field's default."""
  return ml_collections.ConfigDict(_defaults(FIELDS))
