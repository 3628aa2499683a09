"""Text <-> int32 ids: one `Tokenizer` protocol, kinds chosen by name.

A tokenizer is built from a frozen spec (its kind's `Spec` dataclass, whose
fields are the `config.data` options it reads) and the train text, saved in
`workdir/tokenizer/` and reloaded by eval, score, sample, serve and export.
Callers use the protocol's capabilities, never the kind's name.

  char  tokenizers/char.py   every character is a token
  word  tokenizers/word.py   whitespace words, `<eos>` per line (WikiText)
  bpe   tokenizers/bpe.py    byte-level BPE (HF `tokenizers`)

Adding a kind: one module here and one line in `TOKENIZERS`.
"""

import json
import os
from typing import (ClassVar, Iterable, Iterator, Protocol,
                    runtime_checkable)

import numpy as np

from zebra_jax.data.tokenizers import saved
from zebra_jax.data.tokenizers.bpe import BPESpec, BPETokenizer
from zebra_jax.data.tokenizers.char import CharSpec, CharTokenizer
from zebra_jax.data.tokenizers.word import WordSpec, WordTokenizer
from zebra_jax.errors import UserError


@runtime_checkable
class Tokenizer(Protocol):
  """What every kind offers. Capabilities (class attributes):

    char_level        one token per character: bits per character mean
                      something (eval and score report bpc).
    spaces_in_tokens  decoded tokens carry their own spaces (a char, the BPE
                      token " world"), so a continuation is joined to its
                      prompt as is; word tokens need a " " in between.
  """

  Spec: ClassVar[type]
  char_level: ClassVar[bool]
  spaces_in_tokens: ClassVar[bool]
  spec: object  # a frozen Spec: equal specs build equal tokenizers
  # What text outside the vocabulary becomes (None: byte-level, every text
  # encodes); eval counts it on a corpus other than the training one.
  unk_id: int | None

  @property
  def kind(self) -> str:
    """The spec's name, for logs, manifests and /health (not for branching)."""

  @property
  def vocab_size(self) -> int: ...

  def encode(self, text: str) -> np.ndarray:
    """Text as a split is tokenized: int32 [num_tokens]."""

  def encode_chunks(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """`encode` per piece (cut after "\\n"); concatenated, the ids."""

  def encode_prompt(self, text: str) -> np.ndarray:
    """A prompt to continue: int32 [n >= 1]; bad prompts are UserErrors."""

  def decode(self, ids) -> str: ...

  def token_text(self, i: int) -> str:
    """How token `i` reads on its own (score --verbose)."""

  def fingerprint(self) -> str:
    """Changes whenever the ids of some text would."""

  def save(self, directory: str) -> None: ...

  @classmethod
  def load(cls, directory: str, record: dict) -> "Tokenizer":
    """From `directory`, given its parsed `tokenizer.zebra.json` record."""


TOKENIZERS: dict[str, type] = {cls.Spec.kind: cls for cls in (
    CharTokenizer, WordTokenizer, BPETokenizer)}
_FIX = "the workdir has no tokenizer: train first (--mode=train) with it"


def tokenizer_class(kind: str) -> type:
  """The class `data.tokenizer=kind` picks; an unknown kind is a UserError."""
  if kind not in TOKENIZERS:
    raise UserError(f"data.tokenizer {kind!r} is unknown: set "
                    f"--config.data.tokenizer to one of "
                    f"{', '.join(TOKENIZERS)}")
  return TOKENIZERS[kind]


def build(spec, train_text) -> Tokenizer:
  """The tokenizer `spec` describes, learned from the train text (a str or
  an iterable of pieces such as `Split.chunks()`)."""
  return tokenizer_class(spec.kind).build(train_text, spec)


def has_saved(directory: str) -> bool:
  return any(os.path.isfile(os.path.join(directory, name))
             for name in (saved.RECORD, saved.HF_FILE))


def load(directory: str) -> Tokenizer:
  """Reloads what `save` wrote in `directory`.

  Also reads folders written before the record existed: a `tokenizer.json`
  holding {"kind", "vocab", ...} (char/word), or an HF file with
  `bpe_settings.json` next to it (BPE).
  """
  path = os.path.join(directory, saved.RECORD)
  try:
    record = _read_record(directory)
    if record is None:
      raise UserError(f"{path} is missing: {_FIX}")
    return tokenizer_class(record["kind"]).load(directory, record)
  except (ValueError, KeyError, TypeError, OSError) as e:
    raise UserError(f"{path} is corrupt ({type(e).__name__}: {e}): {_FIX}, "
                    "or use a new --workdir") from None


def _read_record(directory: str):
  """The parsed record, or the equivalent of an older folder, or None."""
  path = os.path.join(directory, saved.RECORD)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  hf_path = os.path.join(directory, saved.HF_FILE)
  if not os.path.isfile(hf_path):
    return None
  with open(hf_path, encoding="utf-8") as f:
    old = json.load(f)
  if "kind" in old:  # the char/word record, under the HF file's name
    return old
  record = {"kind": BPESpec.kind}
  settings = os.path.join(directory, "bpe_settings.json")
  if os.path.isfile(settings):
    with open(settings, encoding="utf-8") as f:
      record["bpe_vocab_size"] = int(json.load(f)["bpe_vocab_size"])
  return record


__all__ = ["Tokenizer", "TOKENIZERS", "tokenizer_class", "build", "load",
           "has_saved", "CharSpec", "CharTokenizer", "WordSpec",
           "WordTokenizer", "BPESpec", "BPETokenizer"]
