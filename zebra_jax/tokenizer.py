"""Char and word tokenizers: text <-> int32 ids, the vocabulary saved per run.

Both build their vocabulary from the TRAIN split only, so valid/test perplexity
is measured the honest way: unseen symbols become `<unk>`, as in WikiText.

  word  WikiText convention (pytorch/examples word_language_model): split each
        line on whitespace and append `<eos>`; ids 0 and 1 are `<unk>` and
        `<eos>`, then words by descending frequency (ties alphabetical), which
        is the order an adaptive softmax wants.
  char  every character (including "\\n") is a token; id 0 is `<unk>` for
        characters never seen in train.

A tokenizer is saved as `tokenizer.json` (kind, options, vocab) in
`workdir/tokenizer/`; eval and sample reload it from there.
"""

import collections
import hashlib
import json
import os

from absl import logging
import numpy as np

from zebra_jax.errors import UserError

UNK, EOS = "<unk>", "<eos>"
_FILE = "tokenizer.json"
_CHUNK_CHARS = 1 << 24  # encode big texts in pieces: bounds the UTF-32 copy


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
  def build(cls, train_text: str, min_freq: int = 1, max_vocab_size: int = 0):
    """Counts words of the train text; `min_freq`/`max_vocab_size` prune it.

    Args:
      train_text: the train split, lines separated by "\\n".
      min_freq: words seen fewer times become `<unk>`.
      max_vocab_size: total vocab size cap (with `<unk>`, `<eos>`); 0 = none.
    """
    counts = collections.Counter(train_text.split())
    counts[EOS] += len(_lines(train_text))  # one per line, like encode
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
    lookup, unk, eos = self.token_to_id.get, self.unk_id, self.eos_id
    pieces, ids = [], []
    for line in _lines(text):
      ids.extend([lookup(w, unk) for w in line.split()])
      ids.append(eos)
      if len(ids) > 1 << 20:  # a list of Python ints costs ~36 B per token
        pieces.append(np.array(ids, np.int32))
        ids = []
    pieces.append(np.array(ids, np.int32))
    return np.concatenate(pieces)

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
  def build(cls, train_text: str, min_freq: int = 1, max_vocab_size: int = 0):
    """Vocab = `<unk>` + the train characters, sorted by code point.

    `min_freq`/`max_vocab_size` prune rare characters to `<unk>` (rarely
    useful for characters, but the options mean the same for both kinds).
    """
    counts = collections.Counter()
    for start in range(0, len(train_text), _CHUNK_CHARS):
      points, n = np.unique(_codepoints(train_text[start:start + _CHUNK_CHARS]),
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


def make_tokenizer(data_config, train_text: str) -> _Tokenizer:
  """Builds the tokenizer `data_config.tokenizer` names from the train text."""
  if data_config.tokenizer not in _KINDS:
    raise UserError(f"data.tokenizer {data_config.tokenizer!r} is unknown: set "
                    f"--config.data.tokenizer to one of {', '.join(_KINDS)}")
  return _KINDS[data_config.tokenizer].build(
      train_text, min_freq=data_config.min_freq,
      max_vocab_size=data_config.max_vocab_size)


def load_tokenizer(directory: str) -> _Tokenizer:
  """Reloads `directory/tokenizer.json` written by `save`."""
  path = os.path.join(directory, _FILE)
  fix = "the workdir has no tokenizer: train first (--mode=train) with it"
  if not os.path.isfile(path):
    raise UserError(f"{path} is missing: {fix}")
  try:
    with open(path, encoding="utf-8") as f:
      spec = json.load(f)
    return _KINDS[spec["kind"]](spec["vocab"], spec["min_freq"],
                                spec["max_vocab_size"])
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(f"{path} is corrupt ({type(e).__name__}: {e}): {fix}, "
                    "or use a new --workdir") from None


def _lines(text: str) -> list[str]:
  """Lines as a file iterator sees them: split on "\\n", no trailing empty."""
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return lines


def _codepoints(text: str) -> np.ndarray:
  """uint32 [len(text)] code points, without a per-character Python loop."""
  return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
