"""Byte-level BPE (`data.tokenizer=bpe`) on the Rust HF `tokenizers` library.

GPT-2 style: text -> UTF-8 bytes -> merges learned on the TRAIN split, so
every string encodes (no `<unk>`) and `decode(encode(text)) == text` exactly,
newlines included. Trained and encoded over pieces of a few hundred lines;
`encode_batch` spreads a piece's lines over Rust threads.

Saved as `tokenizer.json` in the HF format (loadable by `tokenizers` and
`transformers` as is) plus `bpe_settings.json` holding the vocab size asked
for, which can exceed the size reached on a small corpus.
"""

import hashlib
import json
import os
from typing import Iterable, Iterator

import numpy as np

from zebra_jax.errors import UserError

_FILE, _SETTINGS = "tokenizer.json", "bpe_settings.json"
_LINES_PER_PIECE = 256  # a batch item: whole lines, ~30 KB of WikiText


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError(
        "data.tokenizer=bpe needs the `tokenizers` package: pip install "
        "'zebra_jax[data]' (or pip install tokenizers), or use "
        "data.tokenizer=word") from None
  return tokenizers


def _line_groups(pieces: Iterable[str]) -> Iterator[list[str]]:
  """Each piece -> lists of whole lines (each keeping its "\\n")."""
  for piece in pieces:
    lines = piece.splitlines(keepends=True)
    for i in range(0, len(lines), _LINES_PER_PIECE):
      yield lines[i:i + _LINES_PER_PIECE]


def _items(pieces: Iterable[str]) -> Iterator[str]:
  """Batch items: groups of whole lines joined, the same for train and encode."""
  for group in _line_groups(pieces):
    yield "".join(group)


class BPETokenizer:
  """Byte-level BPE with the interface of tokenizer.WordTokenizer."""

  kind = "bpe"

  def __init__(self, hf_tokenizer, vocab_size_asked: int):
    self._tok = hf_tokenizer
    self.bpe_vocab_size = int(vocab_size_asked)

  @classmethod
  def build(cls, pieces: Iterable[str], vocab_size: int):
    """Learns `vocab_size` tokens (256 bytes + merges) from the train text."""
    tk = _tokenizers()
    if vocab_size < 257:
      raise UserError(f"data.bpe_vocab_size={vocab_size} leaves no merges "
                      "beyond the 256 bytes: use e.g. 32000")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=int(vocab_size), show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_items(pieces), trainer)
    return cls(tok, vocab_size)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  def settings(self) -> dict:
    return {"tokenizer": self.kind, "bpe_vocab_size": self.bpe_vocab_size}

  def fingerprint(self) -> str:
    """Hash of the whole HF tokenizer file: merges, vocab, pre-tokenizer."""
    return hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 [num_tokens]; every byte sequence is covered."""
    return _concat([np.asarray(e.ids, np.int32) for e in
                    self._tok.encode_batch(list(_items([text])))])

  def encode_chunks(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """`encode` per piece; the Rust pool parallelises each piece's lines."""
    return map(self.encode, pieces)

  def encode_prompt(self, text: str) -> np.ndarray:
    if not text:
      raise UserError("the prompt is empty: pass some text, e.g. "
                      "--prompt='The '")
    return np.asarray(self._tok.encode(text).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode(np.asarray(ids).reshape(-1).tolist(),
                            skip_special_tokens=False)

  def save(self, directory: str) -> None:
    """tokenizer.json (HF format) + bpe_settings.json, each tmp + rename."""
    os.makedirs(directory, exist_ok=True)
    for name, text in ((_SETTINGS, json.dumps(self.settings())),
                       (_FILE, self._tok.to_str())):
      path = os.path.join(directory, name)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
      os.replace(tmp, path)

  @classmethod
  def load_file(cls, directory: str, spec: dict):
    """From the parsed tokenizer.json `spec`; settings default to its size."""
    if spec.get("model", {}).get("type") != "BPE":
      raise ValueError("tokenizer.json is an HF tokenizer, but not BPE")
    tok = _tokenizers().Tokenizer.from_str(json.dumps(spec))
    asked = tok.get_vocab_size()
    try:
      with open(os.path.join(directory, _SETTINGS), encoding="utf-8") as f:
        asked = int(json.load(f)["bpe_vocab_size"])
    except FileNotFoundError:
      pass  # an HF tokenizer.json copied in by hand
    return cls(tok, asked)

  def __eq__(self, other) -> bool:
    return (type(self) is type(other)
            and self.fingerprint() == other.fingerprint())

  def __repr__(self) -> str:
    return f"BPETokenizer(vocab_size={self.vocab_size})"


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
  return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
