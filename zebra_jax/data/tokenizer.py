"""Char, word and BPE tokenizers: text <-> int32 ids, saved with each run.

All build their vocabulary from the TRAIN split only, so valid/test perplexity
is measured the honest way: unseen symbols become `<unk>`, as in WikiText.
`build` and `encode` take a str, or an iterable of pieces (corpus.Split
.chunks(): consecutive, cut after a "\\n") so a 500 MB split is never one
Python string; big inputs are counted and encoded in worker processes.

  word  WikiText convention (pytorch/examples word_language_model): split each
        line on whitespace and append `<eos>`; ids 0 and 1 are `<unk>` and
        `<eos>`, then words by descending frequency (ties alphabetical), which
        is the order an adaptive softmax wants.
  char  every character (including "\\n") is a token; id 0 is `<unk>` for
        characters never seen in train.
  bpe   byte-level BPE trained with HF `tokenizers` (bpe.py): no `<unk>`.

A tokenizer is saved as `tokenizer.json` (kind, options, vocab; for bpe the
HF tokenizers file) in `workdir/tokenizer/`; eval and sample reload it.
"""

import collections
import hashlib
import itertools
import json
import multiprocessing
import os
from typing import Callable, Iterable, Iterator

from absl import logging
import numpy as np

from zebra_jax.errors import UserError

UNK, EOS = "<unk>", "<eos>"
_FILE = "tokenizer.json"
_CHUNK_CHARS = 1 << 24  # encode big texts in pieces: bounds the UTF-32 copy
_MAX_WORKERS = 8  # word counting/encoding scales to about this many cores


class _Tokenizer:
  """What both kinds share: options, vocab lookup, save/load, fingerprint."""

  kind = ""

  def __init__(self, vocab: list[str], min_freq: int = 1,
               max_vocab_size: int = 0):
    self.vocab = list(vocab)  # id -> token
    self.min_freq, self.max_vocab_size = int(min_freq), int(max_vocab_size)
    self.token_to_id = {token: i for i, token in enumerate(self.vocab)}
    self.unk_id = self.token_to_id[UNK]

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def settings(self) -> dict:
    """The config values it was built with (data.py checks them on reuse)."""
    return {"tokenizer": self.kind, "min_freq": self.min_freq,
            "max_vocab_size": self.max_vocab_size}

  def encode_chunks(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """`encode` piece by piece: int32 arrays that concatenate to the ids."""
    return map(self.encode, pieces)

  def fingerprint(self) -> str:
    """Hash of kind + vocab: cached ids are only valid for the same one."""
    blob = json.dumps([self.kind, self.vocab]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

  def save(self, directory: str) -> None:
    """Writes `directory/tokenizer.json` atomically (tmp file + rename)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump({"kind": self.kind, "min_freq": self.min_freq,
                 "max_vocab_size": self.max_vocab_size, "vocab": self.vocab},
                f, ensure_ascii=False)
    os.replace(tmp, path)

  @classmethod
  def load(cls, directory: str):
    tokenizer = load_tokenizer(directory)
    if not isinstance(tokenizer, cls):
      raise UserError(
          f"{directory} holds a {tokenizer.kind} tokenizer, not {cls.kind}: "
          f"use a workdir made with tokenizer={cls.kind}")
    return tokenizer

  def __eq__(self, other) -> bool:
    return (type(self) is type(other) and self.vocab == other.vocab
            and self.min_freq == other.min_freq
            and self.max_vocab_size == other.max_vocab_size)

  def __repr__(self) -> str:
    return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def _ranked(counts: dict[str, int], min_freq: int, max_size: int,
            reserved: list[str]) -> list[str]:
  """`reserved` first, then tokens by (-count, token), filtered and capped."""
  if max_size and max_size < len(reserved) + 1:
    raise UserError(f"data.max_vocab_size={max_size} leaves no room next to "
                    f"{reserved}: use 0 (no limit) or at least "
                    f"{len(reserved) + 1}")
  kept = sorted((t for t, c in counts.items()
                 if c >= min_freq and t not in reserved),
                key=lambda t: (-counts[t], t))
  if max_size:
    kept = kept[:max_size - len(reserved)]
  return reserved + kept


class WordTokenizer(_Tokenizer):
  """Whitespace words, `<eos>` after every line, `<unk>` for the rest."""

  kind = "word"

  @classmethod
  def build(cls, train_text, min_freq: int = 1, max_vocab_size: int = 0):
    """Counts words of the train text; `min_freq`/`max_vocab_size` prune it.

    Args:
      train_text: the train split (lines separated by "\\n"), as a str or
        an iterable of pieces cut after a "\\n".
      min_freq: words seen fewer times become `<unk>`.
      max_vocab_size: total vocab size cap (with `<unk>`, `<eos>`); 0 = none.
    """
    counts = collections.Counter()
    for piece_counts in map_pieces(_count_words, _pieces(train_text)):
      counts.update(piece_counts)  # C loop over the piece's distinct words
    vocab = _ranked(counts, min_freq, max_vocab_size, [UNK, EOS])
    return cls(vocab, min_freq, max_vocab_size)

  def __init__(self, vocab, min_freq=1, max_vocab_size=0):
    super().__init__(vocab, min_freq, max_vocab_size)
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


class CharTokenizer(_Tokenizer):
  """One id per character; vectorised with numpy over UTF-32 code points."""

  kind = "char"

  @classmethod
  def build(cls, train_text, min_freq: int = 1, max_vocab_size: int = 0):
    """Vocab = `<unk>` + the train characters, sorted by code point.

    `min_freq`/`max_vocab_size` prune rare characters to `<unk>` (rarely
    useful for characters, but the options mean the same for both kinds).
    `train_text` is a str or an iterable of pieces.
    """
    counts = collections.Counter()
    for piece in _pieces(train_text):
      for start in range(0, len(piece), _CHUNK_CHARS):
        points, n = np.unique(_codepoints(piece[start:start + _CHUNK_CHARS]),
                              return_counts=True)
        counts.update(dict(zip(map(chr, points.tolist()), n.tolist())))
    kept = _ranked(counts, min_freq, max_vocab_size, [UNK])[1:]
    return cls([UNK] + sorted(kept), min_freq, max_vocab_size)

  def __init__(self, vocab, min_freq=1, max_vocab_size=0):
    super().__init__(vocab, min_freq, max_vocab_size)
    # Sorted code points of the real characters and their ids, for searchsorted.
    chars = [(ord(t), i) for i, t in enumerate(self.vocab) if t != UNK]
    chars.sort()
    self._points = np.array([p for p, _ in chars], np.uint32)
    self._ids = np.array([i for _, i in chars], np.int32)
    self._decode_table = ["\ufffd" if t == UNK else t for t in self.vocab]

  def encode(self, text: str) -> np.ndarray:
    """Characters -> ids; characters absent from train -> `<unk>`.

    Returns:
      int32 [len(text)].
    """
    pieces = [self._lookup(_codepoints(text[s:s + _CHUNK_CHARS]))
              for s in range(0, len(text), _CHUNK_CHARS)]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)

  def encode_prompt(self, text: str) -> np.ndarray:
    """Like `encode`, but a character never seen in training is an error:
    silently turning it into `<unk>` would change what the user asked for."""
    unknown = sorted({c for c in text if c not in self.token_to_id})
    if unknown:
      raise UserError(
          f"the prompt uses characters not seen in training: "
          f"{', '.join(map(repr, unknown))}: the prompt may only use "
          "characters seen in training")
    if not text:
      raise UserError("the prompt is empty: pass at least one character, "
                      "e.g. --prompt='The '")
    return self.encode(text)

  def decode(self, ids) -> str:
    """Ids -> text; `<unk>` decodes as U+FFFD so every id stays one char."""
    table = self._decode_table
    return "".join(table[i] for i in np.asarray(ids).reshape(-1).tolist())

  def _lookup(self, points: np.ndarray) -> np.ndarray:
    if self._points.size == 0:
      return np.full(points.shape, self.unk_id, np.int32)
    pos = np.minimum(np.searchsorted(self._points, points),
                     self._points.size - 1)
    return np.where(self._points[pos] == points, self._ids[pos],
                    self.unk_id).astype(np.int32)


_KINDS = {"char": CharTokenizer, "word": WordTokenizer}
KINDS = ("char", "word", "bpe")


def make_tokenizer(data_config, train_text) -> _Tokenizer:
  """Builds the tokenizer `data_config.tokenizer` names from the train text
  (a str, or an iterable of pieces such as `corpus.Split.chunks()`)."""
  kind = data_config.tokenizer
  if kind not in KINDS:
    raise UserError(f"data.tokenizer {kind!r} is unknown: set "
                    f"--config.data.tokenizer to one of {', '.join(KINDS)}")
  if kind == "bpe":
    from zebra_jax.data import bpe  # pylint: disable=g-import-not-at-top
    return bpe.BPETokenizer.build(_pieces(train_text),
                                  vocab_size=data_config.bpe_vocab_size)
  return _KINDS[kind].build(
      train_text, min_freq=data_config.min_freq,
      max_vocab_size=data_config.max_vocab_size)


def config_settings(data_config) -> dict:
  """What `settings()` of the tokenizer this config builds would return."""
  if data_config.tokenizer == "bpe":
    return {"tokenizer": "bpe",
            "bpe_vocab_size": int(data_config.bpe_vocab_size)}
  return {"tokenizer": data_config.tokenizer,
          "min_freq": int(data_config.min_freq),
          "max_vocab_size": int(data_config.max_vocab_size)}


def load_tokenizer(directory: str) -> _Tokenizer:
  """Reloads `directory/tokenizer.json` written by `save`."""
  path = os.path.join(directory, _FILE)
  fix = "the workdir has no tokenizer: train first (--mode=train) with it"
  if not os.path.isfile(path):
    raise UserError(f"{path} is missing: {fix}")
  try:
    with open(path, encoding="utf-8") as f:
      spec = json.load(f)
    if "kind" not in spec and "model" in spec:  # an HF tokenizers file
      from zebra_jax.data import bpe  # pylint: disable=g-import-not-at-top
      return bpe.BPETokenizer.load_file(directory, spec)
    return _KINDS[spec["kind"]](spec["vocab"], spec["min_freq"],
                                spec["max_vocab_size"])
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(f"{path} is corrupt ({type(e).__name__}: {e}): {fix}, "
                    "or use a new --workdir") from None


def _codepoints(text: str) -> np.ndarray:
  """uint32 [len(text)] code points, without a per-character Python loop."""
  return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


def _pieces(text_or_pieces) -> Iterable[str]:
  return [text_or_pieces] if isinstance(text_or_pieces, str) else text_or_pieces


def _line_count(piece: str) -> int:
  """Lines in a piece, the last one counted even without its "\\n"."""
  return piece.count("\n") + (1 if piece and not piece.endswith("\n") else 0)


def _count_words(piece: str) -> collections.Counter:
  counts = collections.Counter(piece.split())
  counts[EOS] += _line_count(piece)  # one per line, like encode
  return counts


def _encode_words(piece: str, token_to_id: dict, unk_id: int) -> np.ndarray:
  """Vectorised over a piece: "\\n" becomes an `<eos>` word, then one
  str.split and one C-level map of dict.get (~1.3M tokens/s per core)."""
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
  and spawn only costs ~0.5 s to start. At most 2 pieces per worker are in
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
