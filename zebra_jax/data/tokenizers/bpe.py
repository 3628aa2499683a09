"""`data.tokenizer=bpe`: byte-level BPE on the Rust HF `tokenizers` library.

GPT-2 style: text -> UTF-8 bytes -> merges learned on the TRAIN split, so
every string encodes (no `<unk>`) and `decode(encode(text)) == text` exactly,
newlines included. Trained and encoded over pieces of a few hundred lines;
`encode_batch` spreads a piece's lines over Rust threads.

Saved as `tokenizer.json` in the HF format (loadable by `tokenizers` and
`transformers` as is) plus the record `tokenizer.zebra.json` holding the
vocab size asked for, which can exceed the size reached on a small corpus.
"""

import dataclasses
import hashlib
import json
import os
from typing import ClassVar, Iterable, Iterator

import numpy as np

from zebra_jax.data.tokenizers import saved
from zebra_jax.errors import UserError

_LINES_PER_PIECE = 256  # a batch item: whole lines, ~30 KB of WikiText


@dataclasses.dataclass(frozen=True)
class BPESpec:
  kind: ClassVar[str] = "bpe"
  bpe_vocab_size: int = 32000  # 256 bytes + merges

  def describe(self) -> str:
    return f"tokenizer={self.kind} bpe_vocab_size={self.bpe_vocab_size}"


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError(
        "data.tokenizer=bpe needs the `tokenizers` package: pip install "
        "'zebra_jax[data]' (or pip install tokenizers), or use "
        "data.tokenizer=word") from None
  return tokenizers


def _items(pieces: Iterable[str]) -> Iterator[str]:
  """Batch items: groups of whole lines joined, the same for train and encode."""
  for piece in pieces:
    lines = piece.splitlines(keepends=True)
    for i in range(0, len(lines), _LINES_PER_PIECE):
      yield "".join(lines[i:i + _LINES_PER_PIECE])


class BPETokenizer:
  """Byte-level BPE behind the `Tokenizer` protocol."""

  Spec: ClassVar[type] = BPESpec
  char_level: ClassVar[bool] = False
  spaces_in_tokens: ClassVar[bool] = True  # " world" is one token
  unk_id: ClassVar[None] = None  # bytes: every text encodes

  def __init__(self, hf_tokenizer, spec: BPESpec):
    self._tok = hf_tokenizer
    self.spec = spec

  @classmethod
  def build(cls, train_text, spec: BPESpec = BPESpec()):
    """Learns `spec.bpe_vocab_size` tokens (256 bytes + merges) from the
    train text (a str or an iterable of pieces)."""
    tk = _tokenizers()
    if spec.bpe_vocab_size < 257:
      raise UserError(f"data.bpe_vocab_size={spec.bpe_vocab_size} leaves no "
                      "merges beyond the 256 bytes: use e.g. 32000")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=int(spec.bpe_vocab_size), show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    pieces = [train_text] if isinstance(train_text, str) else train_text
    tok.train_from_iterator(_items(pieces), trainer)
    return cls(tok, spec)

  @property
  def kind(self) -> str:
    return self.spec.kind

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

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

  def token_text(self, i: int) -> str:
    """The text one token stands for (" world"); a token holding part of a
    UTF-8 character shows as U+FFFD."""
    return self.decode([i])

  def save(self, directory: str) -> None:
    """tokenizer.json (HF format) + the record, each tmp + rename."""
    saved.write_text(directory, saved.HF_FILE, self._tok.to_str())
    saved.write_record(directory, {"kind": self.kind,
                                   **dataclasses.asdict(self.spec)})

  @classmethod
  def load(cls, directory: str, record: dict):
    """From `directory/tokenizer.json`; the record gives the size asked for
    (absent for an HF tokenizer.json copied in by hand: its own size)."""
    path = os.path.join(directory, saved.HF_FILE)
    with open(path, encoding="utf-8") as f:
      spec = json.load(f)
    if spec.get("model", {}).get("type") != "BPE":
      raise ValueError(f"{path} is an HF tokenizer, but not BPE")
    tok = _tokenizers().Tokenizer.from_str(json.dumps(spec))
    asked = int(record.get("bpe_vocab_size", tok.get_vocab_size()))
    return cls(tok, BPESpec(bpe_vocab_size=asked))

  def __eq__(self, other) -> bool:
    return (type(self) is type(other) and self.spec == other.spec
            and self.fingerprint() == other.fingerprint())

  def __repr__(self) -> str:
    return f"BPETokenizer(vocab_size={self.vocab_size})"


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
  return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
