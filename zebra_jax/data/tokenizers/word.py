"""`data.tokenizer=word`: the WikiText convention.

As pytorch/examples' word_language_model: split each line on whitespace and
append `<eos>`; ids 0 and 1 are `<unk>` and `<eos>`, then words by
descending frequency (ties alphabetical), which is the order an adaptive
softmax wants. Big inputs are counted and encoded in worker processes.
"""

import collections
import dataclasses
import itertools
import multiprocessing
import os
from typing import Callable, ClassVar, Iterable, Iterator

from absl import logging
import numpy as np

from zebra_jax.data.tokenizers import vocab as vocab_lib
from zebra_jax.errors import UserError

UNK, EOS = vocab_lib.UNK, vocab_lib.EOS
_MAX_WORKERS = 8  # word counting/encoding scales to about this many cores


@dataclasses.dataclass(frozen=True)
class WordSpec(vocab_lib.VocabSpec):
  kind: ClassVar[str] = "word"


class WordTokenizer(vocab_lib.VocabTokenizer):
  """Whitespace words, `<eos>` after every line, `<unk>` for the rest."""

  Spec = WordSpec
  char_level = False
  spaces_in_tokens = False  # decoded words need a " " between them

  @classmethod
  def build(cls, train_text, spec: WordSpec = WordSpec()):
    """Counts words of the train text; `spec` prunes them.

    Args:
      train_text: the train split (lines separated by "\\n"), as a str or
        an iterable of pieces cut after a "\\n".
      spec: words seen fewer than `min_freq` times become `<unk>`;
        `max_vocab_size` caps the vocab (with `<unk>`, `<eos>`), 0 = none.
    """
    counts = collections.Counter()
    for piece_counts in map_pieces(_count_words,
                                   vocab_lib.pieces_of(train_text)):
      counts.update(piece_counts)  # C loop over the piece's distinct words
    vocab = vocab_lib.ranked(counts, spec.min_freq, spec.max_vocab_size,
                             [UNK, EOS])
    return cls(vocab, spec)

  def __init__(self, vocab, spec: WordSpec = WordSpec()):
    super().__init__(vocab, spec)
    self.eos_id = self.token_to_id[EOS]

  def encode(self, text: str) -> np.ndarray:
    """Every line -> its word ids + `<eos>` (empty lines give just `<eos>`).

    Returns:
      int32 [num_tokens].
    """
    return _encode_words(text, self.token_to_id, self.unk_id)

  def encode_chunks(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """`encode` per piece, in worker processes when there are several."""
    return map_pieces(_encode_words_in_worker, pieces,
                      initializer=_set_worker_vocab,
                      initargs=(self.vocab, self.unk_id))

  def encode_prompt(self, text: str) -> np.ndarray:
    """A user prompt -> ids; no `<eos>` at its end, so generation continues
    the last line. Unknown words become `<unk>`, with a warning naming them."""
    lines = text.split("\n")
    unknown = sorted({w for line in lines for w in line.split()
                      if w not in self.token_to_id})
    if unknown:
      logging.warning("prompt words not in the vocabulary, read as %s: %s",
                      UNK, ", ".join(unknown))
    ids = self.encode(text)
    if not text.endswith("\n"):
      ids = ids[:-1]  # encode closed the last line; a prompt leaves it open
    if ids.size == 0:
      raise UserError(f"the prompt {text!r} holds no words: pass a prompt with "
                      "at least one word, e.g. --prompt='The'")
    return ids

  def decode(self, ids) -> str:
    """Words joined by spaces; `<eos>` becomes a line break."""
    out, line_start = [], True
    for i in np.asarray(ids).reshape(-1).tolist():
      if i == self.eos_id:
        out.append("\n")
        line_start = True
        continue
      if not line_start:
        out.append(" ")
      out.append(self.vocab[i])
      line_start = False
    return "".join(out)


def _line_count(piece: str) -> int:
  """Lines in a piece, the last one counted even without its "\\n"."""
  return piece.count("\n") + (1 if piece and not piece.endswith("\n") else 0)


def _count_words(piece: str) -> collections.Counter:
  counts = collections.Counter(piece.split())
  counts[EOS] += _line_count(piece)  # one per line, like encode
  return counts


def _encode_words(piece: str, token_to_id: dict, unk_id: int) -> np.ndarray:
  """Vectorised over a piece: "\\n" becomes an `<eos>` word, then one
  str.split and one C-level map of dict.get, no Python loop per word."""
  if piece and not piece.endswith("\n"):
    piece += "\n"  # a last line without "\n" still ends with <eos>
  words = piece.replace("\n", f" {EOS} ").split()
  return np.fromiter(map(token_to_id.get, words, itertools.repeat(unk_id)),
                     np.int32, count=len(words))


_worker_vocab = None  # (token_to_id, unk_id) inside a worker process


def _set_worker_vocab(vocab: list[str], unk_id: int) -> None:
  global _worker_vocab
  _worker_vocab = ({t: i for i, t in enumerate(vocab)}, unk_id)


def _encode_words_in_worker(piece: str) -> np.ndarray:
  return _encode_words(piece, *_worker_vocab)


def num_workers() -> int:
  """Processes for counting/encoding: the cores this process may use."""
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    cores = os.cpu_count() or 1
  return max(1, min(cores, _MAX_WORKERS))


def map_pieces(fn: Callable, pieces: Iterable[str], initializer=None,
               initargs=()) -> Iterator:
  """`fn` over the pieces, results in order, streamed.

  With one piece (small corpora, tests) or one core it runs here. Otherwise a
  pool of "spawn" workers does it: fork is unsafe once JAX's threads exist,
  and spawn only costs a moment to start. At most 2 pieces per worker are in
  flight, so memory stays bounded however long the split is.
  """
  pieces = iter(pieces)
  head = list(itertools.islice(pieces, 2))
  workers = num_workers()
  if len(head) < 2 or workers == 1:
    if initializer is not None:
      initializer(*initargs)
    yield from map(fn, itertools.chain(head, pieces))
    return
  context = multiprocessing.get_context("spawn")
  with context.Pool(workers, initializer, initargs) as pool:
    pending = collections.deque()
    for piece in itertools.chain(head, pieces):
      pending.append(pool.apply_async(fn, (piece,)))
      if len(pending) >= 2 * workers:
        yield pending.popleft().get()
    while pending:
      yield pending.popleft().get()
