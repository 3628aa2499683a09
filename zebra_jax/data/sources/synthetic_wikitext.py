"""A WikiText-103-shaped folder of random words, for memory and speed runs.

  python -m zebra_jax.data.sources.synthetic_wikitext /tmp/wt103syn

writes wiki.{train,valid,test}.tokens with WikiText-103's sizes (103M train
tokens with `<eos>`, 218k valid, 246k test) over a 267,735-word vocabulary
(`<unk>` and `<eos>` included) whose frequencies follow Zipf's law
(p(rank r) ~ 1 / r), in WikiText's layout: " w w w \\n" lines. Every word
of the vocabulary occurs in train, so `data.tokenizer=word` finds all of
them. The text is meaningless: it measures what the corpus's size costs, not
what a model learns.
"""

import argparse
import os
import string
import time

import numpy as np

# WikiText-103 (wikitext-103-v1): tokens with <eos>, and the vocabulary.
TRAIN_TOKENS, VALID_TOKENS, TEST_TOKENS = 103_227_021, 217_646, 245_569
VOCAB_SIZE = 267_735
_WORDS_PER_LINE = 57  # mean: 103M tokens over 1.8M lines
_BLOCK = 1 << 20      # tokens drawn and written at a time


def words(count: int) -> list[str]:
  """`count` distinct lowercase words, shortest first (frequent words are
  short, as in English): a..z, aa..zz, aaa..."""
  out, length = [], 1
  letters = string.ascii_lowercase
  while len(out) < count:
    out.extend("".join(w) for w in _product(letters, length))
    length += 1
  return out[:count]


def _product(letters: str, length: int):
  if length == 1:
    yield from letters
    return
  for head in letters:
    for tail in _product(letters, length - 1):
      yield head + tail


def write_split(path: str, num_tokens: int, vocab: np.ndarray,
                cdf: np.ndarray, rng: np.random.Generator,
                must_contain: int = 0) -> None:
  """num_tokens tokens (each "\\n" counts, as `<eos>` will) drawn by `cdf`
  over `vocab`; the first `must_contain` words of vocab appear at least once
  (appended as lines of their own where the draw missed them)."""
  seen = np.zeros(len(vocab), bool)
  eos = 1.0 / _WORDS_PER_LINE
  written = 0
  with open(path, "w", encoding="utf-8") as f:
    while written < num_tokens:
      n = min(_BLOCK, num_tokens - written)
      ids = np.searchsorted(cdf, rng.random(n), side="right")
      ids = np.minimum(ids, len(vocab) - 1)
      line_end = rng.random(n) < eos
      if written + n >= num_tokens:
        line_end[-1] = True  # the file ends with a whole line
      seen[ids[~line_end]] = True
      tokens = vocab[ids]
      tokens[line_end] = "\n"
      f.write(" " + " ".join(tokens.tolist()))
      written += n
    missing = np.flatnonzero(~seen[:must_contain])
    for start in range(0, len(missing), _WORDS_PER_LINE):
      chunk = vocab[missing[start:start + _WORDS_PER_LINE]]
      f.write(" " + " ".join(chunk.tolist()) + " \n")


def write_folder(folder: str, train_tokens: int = TRAIN_TOKENS,
                 vocab_size: int = VOCAB_SIZE, seed: int = 0) -> None:
  """The three files; vocab_size counts `<unk>` and `<eos>` as WikiText's
  does (`<unk>` is one of the frequent words in its text, as there)."""
  os.makedirs(folder, exist_ok=True)
  vocab = words(vocab_size - 2)
  vocab.insert(20, "<unk>")  # WikiText's <unk> is about its 20th word
  vocab = np.asarray(vocab, dtype=object)
  p = 1.0 / np.arange(1, len(vocab) + 1)
  cdf = np.cumsum(p / p.sum())
  rng = np.random.default_rng(seed)
  scale = train_tokens / TRAIN_TOKENS
  sizes = {"train": train_tokens,
           "valid": max(1000, round(VALID_TOKENS * min(1.0, scale * 10))),
           "test": max(1000, round(TEST_TOKENS * min(1.0, scale * 10)))}
  for split, n in sizes.items():
    start = time.perf_counter()
    path = os.path.join(folder, f"wiki.{split}.tokens")
    write_split(path, n, vocab, cdf, rng,
                must_contain=len(vocab) if split == "train" else 0)
    print(f"{path}: {n:,} tokens, {os.path.getsize(path) / 2**20:,.0f} MiB "
          f"in {time.perf_counter() - start:.0f} s", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("folder")
  parser.add_argument("--train_tokens", type=int, default=TRAIN_TOKENS)
  parser.add_argument("--vocab_size", type=int, default=VOCAB_SIZE)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  write_folder(args.folder, args.train_tokens, args.vocab_size, args.seed)


if __name__ == "__main__":
  main()
