"""What the char and word tokenizers share: a vocabulary list and its record.

Both build their vocabulary from the TRAIN split only, so valid/test
perplexity is measured the honest way: unseen symbols become `<unk>`, as in
WikiText. `build` takes a str, or an iterable of pieces (`Split.chunks()`:
consecutive, cut after a "\\n"), so a 500 MB split is never one string.
"""

import dataclasses
import hashlib
import json
from typing import ClassVar, Iterable, Iterator

import numpy as np

from zebra_jax.data.tokenizers import saved
from zebra_jax.errors import UserError

UNK, EOS = "<unk>", "<eos>"


@dataclasses.dataclass(frozen=True)
class VocabSpec:
  """How a vocabulary is pruned: rarer tokens and those past the cap are
  `<unk>`. Subclasses only name the kind, so char and word specs differ."""

  kind: ClassVar[str] = ""
  min_freq: int = 1
  max_vocab_size: int = 0  # 0 = no cap

  def describe(self) -> str:
    return (f"tokenizer={self.kind} min_freq={self.min_freq} "
            f"max_vocab_size={self.max_vocab_size}")


class VocabTokenizer:
  """An id -> token list with `<unk>`; save/load, fingerprint, equality."""

  Spec: ClassVar[type] = VocabSpec
  char_level: ClassVar[bool] = False
  spaces_in_tokens: ClassVar[bool] = False

  def __init__(self, vocab: list[str], spec: VocabSpec):
    self.vocab = list(vocab)  # id -> token
    self.spec = spec
    self.token_to_id = {token: i for i, token in enumerate(self.vocab)}
    self.unk_id = self.token_to_id[UNK]

  @property
  def kind(self) -> str:
    return self.spec.kind

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def token_text(self, i: int) -> str:
    return self.vocab[i]

  def encode_chunks(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """`encode` piece by piece: int32 arrays that concatenate to the ids."""
    return map(self.encode, pieces)

  def fingerprint(self) -> str:
    """Hash of kind + vocab: cached ids are only valid for the same one."""
    blob = json.dumps([self.kind, self.vocab]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

  def save(self, directory: str) -> None:
    """`directory/tokenizer.zebra.json`: kind, spec and vocabulary."""
    saved.write_record(directory, {"kind": self.kind,
                                   **dataclasses.asdict(self.spec),
                                   "vocab": self.vocab})

  @classmethod
  def load(cls, directory: str, record: dict):
    """From the parsed record `save` wrote (`directory` is not read again)."""
    del directory
    spec = cls.Spec(min_freq=int(record["min_freq"]),
                    max_vocab_size=int(record["max_vocab_size"]))
    return cls(record["vocab"], spec)

  def __eq__(self, other) -> bool:
    return (type(self) is type(other) and self.vocab == other.vocab
            and self.spec == other.spec)

  def __repr__(self) -> str:
    return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def ranked(counts: dict[str, int], min_freq: int, max_size: int,
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


def pieces_of(text_or_pieces) -> Iterable[str]:
  return [text_or_pieces] if isinstance(text_or_pieces, str) else text_or_pieces
