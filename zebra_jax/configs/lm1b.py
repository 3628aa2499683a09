"""ZebraLSTM on the One Billion Word benchmark (TFDS `lm1b`, word level).

  python -m zebra_jax.main --config=lm1b --workdir=runs/lm1b \
      --config.data.tfds_data_dir=/data/tensorflow_datasets
  python -c "from tests.data.tfds_fixture import prepare; prepare('/tmp/tfds')"
  python -m zebra_jax.main --config=lm1b:tiny --workdir=/tmp/lm1b-tiny \
      --config.data.tfds_data_dir=/tmp/tfds   # a tiny TFDS dataset: CPU, ~1 min

lm1b must be prepared as array_record (`tfds build lm1b --data_dir=DIR
--file_format=array_record`, docs/data.md); training reads it without
TensorFlow. TFDS's lm1b has train (30,301,028 sentences, ~0.8B words) and
test (all 50 held-out shards, 306,688 sentences); a row is one sentence,
which the word tokenizer ends with <eos>.

  data       valid is train's last 1% (train[99%:], ~303k sentences);
             test is TFDS's whole test split, so test perplexity is over all
             50 held-out shards, not the benchmark's single shard
             (heldout-00000) that published numbers use. min_freq=3: the
             benchmark's rule for its 793,471-word vocabulary; counted on
             99% of train, ours is ~793k words. Streams of 128 x 128 =
             16,384 tokens a step, the state carried across sentences.
  model      2 ZebraLSTM layers, hidden 2048 in 8 stripes of 256 (dense
             input), bfloat16 compute; adaptive softmax with
             Transformer-XL's lm1b cutoffs 60k/100k/640k and div_val 4
             (cluster widths 2048/512/128/32), tied to an adaptive input:
             257.3M parameters at 793,471 words, 219.6M of them the
             adaptive tables and head (counted with jax.eval_shape).
  optimizer  as wt103: Adam 1e-3, 2,000 warmup steps, cosine to 1e-5 over
             100,000 steps (1.64B tokens, ~2 epochs), clip 0.25.

Beside the G-LSTM paper's BIGLSTM baseline (Kuchaiev & Ginsburg 2017,
Factorization Tricks for LSTM Networks, after Jozefowicz et al. 2016):
2 layers of 8192 cells with a 1024-wide projection, 1024-wide embeddings
and a full 793k softmax (sampled in training), trained on a node of 8 GPUs
for a week. This recipe is sized for one GPU's memory and a day's
throughput instead, and this model has no projection layer: a layer's
output is its whole hidden state, so 8192 cells would make every layer's
input matmul 8192 x 32768 (268M weights, 16x the 2048-wide layer's) and the
head 8192 wide; striping cuts the recurrent matmul, not those. Its
perplexity and step speed are not measured yet.
"""

import ml_collections

from zebra_jax.configs import wt103


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  # wt103's recipe (model, optimizer, schedule, evaluation), on lm1b's words.
  c = wt103.get_config("tiny" if variant == "tiny" else "")
  c.data.update(
      source="tfds",
      tfds_name="lm1b",
      tfds_data_dir="",            # TFDS's default; set where it was prepared
      tfds_train_split="train[:99%]",
      tfds_valid_split="train[99%:]",  # lm1b has no validation split
      tfds_test_split="test",
      tfds_text_key="text",
      min_freq=3,                  # the benchmark's 793,471-word vocabulary
  )
  c.model.update(adaptive_cutoffs=(60000, 100000, 640000))
  c.train.update(eval_max_batches=200)  # 3.3M of valid's ~7.8M tokens
  c.sample.update(prompt="The company said")
  if variant == "tiny":  # same code path on tests/data/tfds_fixture.py
    c.data.update(tfds_name="zebra_tiny_lm", min_freq=1,
                  tfds_train_split="train[:80%]",
                  tfds_valid_split="train[80%:]")
    c.model.update(adaptive_cutoffs=(8, 16))  # its ~24 words: 3 clusters
    c.train.update(eval_max_batches=4)
    c.sample.update(prompt="the")
  elif variant:
    raise ValueError(f"unknown variant {variant!r}: use lm1b or lm1b:tiny")
  return c
