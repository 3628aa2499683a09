"""`data.tokenizer=char`: every character (including "\\n") is a token.

Id 0 is `<unk>` for characters never seen in train; the rest are the train
characters sorted by code point. Vectorised with numpy over UTF-32 code
points, so a megabyte encodes in milliseconds.
"""

import collections
import dataclasses
from typing import ClassVar

import numpy as np

from zebra_jax.data.tokenizers import vocab as vocab_lib
from zebra_jax.errors import UserError

_CHUNK_CHARS = 1 << 24  # encode big texts in pieces: bounds the UTF-32 copy


@dataclasses.dataclass(frozen=True)
class CharSpec(vocab_lib.VocabSpec):
  kind: ClassVar[str] = "char"


class CharTokenizer(vocab_lib.VocabTokenizer):
  """One id per character."""

  Spec = CharSpec
  char_level = True        # bits per character mean something
  spaces_in_tokens = True  # " " is a token: decoded ids join as they are

  @classmethod
  def build(cls, train_text, spec: CharSpec = CharSpec()):
    """Vocab = `<unk>` + the train characters, sorted by code point.

    `spec.min_freq`/`max_vocab_size` prune rare characters to `<unk>`
    (rarely useful for characters, but the options mean the same for every
    vocabulary). `train_text` is a str or an iterable of pieces.
    """
    counts = collections.Counter()
    for piece in vocab_lib.pieces_of(train_text):
      for start in range(0, len(piece), _CHUNK_CHARS):
        points, n = np.unique(_codepoints(piece[start:start + _CHUNK_CHARS]),
                              return_counts=True)
        counts.update(dict(zip(map(chr, points.tolist()), n.tolist())))
    kept = vocab_lib.ranked(counts, spec.min_freq, spec.max_vocab_size,
                            [vocab_lib.UNK])[1:]
    return cls([vocab_lib.UNK] + sorted(kept), spec)

  def __init__(self, vocab, spec: CharSpec = CharSpec()):
    super().__init__(vocab, spec)
    # Sorted code points of the real characters and their ids, for searchsorted.
    chars = sorted((ord(t), i) for i, t in enumerate(self.vocab)
                   if t != vocab_lib.UNK)
    self._points = np.array([p for p, _ in chars], np.uint32)
    self._ids = np.array([i for _, i in chars], np.int32)
    self._decode_table = ["\ufffd" if t == vocab_lib.UNK else t
                          for t in self.vocab]

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


def _codepoints(text: str) -> np.ndarray:
  """uint32 [len(text)] code points, without a per-character Python loop."""
  return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
