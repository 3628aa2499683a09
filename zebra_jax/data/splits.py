"""A split's text, read in pieces: what every source hands to the pipeline.

Pieces are a few MB and cut after a "\\n", so WikiText-103's 540 MB train
split is never one Python string and no line is ever cut in two.
"""

import dataclasses
import hashlib
import json
import os
from typing import Callable, Iterator

from zebra_jax.errors import UserError

SPLITS = ("train", "valid", "test")
# Bytes read per piece: big enough that str.split and numpy amortise their
# call overhead, small enough that a worker's copy stays far below 1 GB.
CHUNK_BYTES = 1 << 23


@dataclasses.dataclass(frozen=True)
class Split:
  """One split's text, read in pieces on demand (every read starts afresh).

  Pieces are consecutive: joined they give the split's text, and every piece
  but the last ends with "\\n", so no line is ever cut in two.
  `size` counts `unit`s ("B", "rows" or "chars"); it only drives progress.
  """

  name: str
  size: int
  unit: str
  read: Callable[[], Iterator[tuple[str, int]]]  # yields (piece, units)

  def chunks(self) -> Iterator[str]:
    for piece, _ in self.read():
      yield piece

  def text(self) -> str:
    return "".join(self.chunks())

  def is_blank(self) -> bool:
    """True when the split holds only whitespace; stops at the first word."""
    return not any(piece.strip() for piece in self.chunks())


def in_memory_split(name: str, text: str) -> Split:
  """A Split over a str already in memory (embedded, text, tests)."""
  def read():
    start = 0
    while start < len(text):
      stop = text.find("\n", start + CHUNK_BYTES) + 1 or len(text)
      yield text[start:stop], stop - start
      start = stop
  return Split(name, len(text), "chars", read)


def file_split(name: str, path: str) -> Split:
  """Streams a UTF-8 file in pieces cut after a "\\n" ("\\r\\n" -> "\\n")."""
  def read():
    offset, carry = 0, b""  # carry: the bytes after the last "\n" so far
    with open(path, "rb") as f:
      while True:
        block = f.read(CHUNK_BYTES)
        data = carry + block
        if not block:  # end of file: the rest, maybe without a final "\n"
          if data:
            yield decode(data, path, offset), len(data)
          return
        cut = data.rfind(b"\n") + 1  # 0: a line longer than a block so far
        piece, carry = data[:cut], data[cut:]
        if piece:
          yield decode(piece, path, offset), len(piece)
          offset += len(piece)
  return Split(name, os.path.getsize(path), "B", read)


def read_utf8(path: str) -> str:
  """Reads a whole file as UTF-8, with "\\r\\n" turned into "\\n"."""
  with open(path, "rb") as f:
    return decode(f.read(), path, 0)


def decode(raw: bytes, path: str, offset: int) -> str:
  """UTF-8 bytes at `offset` of `path` -> str, BOM dropped, "\\r\\n" -> "\\n"."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(
        f"{path} is not UTF-8 (bad byte 0x{raw[e.start]:02x} at byte offset "
        f"{offset + e.start}): convert it, e.g. iconv -f latin1 -t utf-8 "
        f"{path} > out.txt") from None
  if offset == 0:
    text = text.removeprefix("\ufeff")
  return text.replace("\r\n", "\n")


def file_stats(files) -> list:
  """[abspath, size, mtime_ns] per file: what a fingerprint needs to notice
  an edit without reading the file."""
  return [[os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns]
          for f in files]


def fingerprint(description: dict) -> str:
  """A short hash of a JSON-able description."""
  blob = json.dumps(description, sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


def held_out_count(num_lines: int, fraction: float) -> int:
  """Lines (or rows) a fraction holds out: round(n * fraction), but at least
  one when asked for any, and none of a text too short to split."""
  if fraction <= 0 or num_lines < 3:
    return 0
  return max(1, round(num_lines * fraction))


def check_fractions(valid: float, test: float) -> None:
  if not (0 <= valid < 1 and 0 <= test < 1 and valid + test < 1):
    raise UserError(
        f"data.valid_fraction={valid} and data.test_fraction={test} must each "
        "be in [0, 1) and sum to less than 1: fix them in the config")
