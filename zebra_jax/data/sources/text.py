"""`data.source=text`: your own UTF-8 files; the last lines become valid/test.

`path` is a file, a folder (its *.txt, sorted) or a comma-separated list of
files. Valid and test are the last lines (contiguous), so no sentence of the
held-out text is interleaved with training text.
"""

import dataclasses
import os
from typing import ClassVar

from zebra_jax.data import splits as splits_lib
from zebra_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class TextSource:
  """The files concatenated and cut at line boundaries: train | valid | test."""

  name: ClassVar[str] = "text"
  needs_path: ClassVar[bool] = True

  path: str
  valid_fraction: float
  test_fraction: float

  def fingerprint(self) -> str:
    return splits_lib.fingerprint({
        "source": self.name, "path": self.path,
        "valid_fraction": float(self.valid_fraction),
        "test_fraction": float(self.test_fraction),
        "files": splits_lib.file_stats(_files(self.path))})

  def open(self) -> dict[str, splits_lib.Split]:
    splits_lib.check_fractions(self.valid_fraction, self.test_fraction)
    lines = []
    for path in _files(self.path):
      lines.extend(_split_lines(splits_lib.read_utf8(path)))
    n = len(lines)
    n_test = splits_lib.held_out_count(n, self.test_fraction)
    n_valid = splits_lib.held_out_count(n, self.valid_fraction)
    n_train = max(n - n_valid - n_test, 0)
    chunks = {"train": lines[:n_train],
              "valid": lines[n_train:n_train + n_valid],
              "test": lines[n_train + n_valid:]}
    return {name: splits_lib.in_memory_split(
        name, "".join(line + "\n" for line in chunk))
            for name, chunk in chunks.items()}


def _split_lines(text: str) -> list[str]:
  """Lines as a file iterator sees them: on "\\n" only, no trailing empty."""
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return lines


def _files(path: str) -> list[str]:
  """A file, a folder (its *.txt, sorted) or a comma-separated list of files."""
  fix = ("set --config.data.path to a text file, a folder of .txt files or "
         "a comma-separated list of files")
  if not path:
    raise UserError(f"data.path is empty for data.source='text': {fix}")
  if os.path.isdir(path):
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if f.endswith(".txt")
                   and os.path.isfile(os.path.join(path, f)))
    if not files:
      raise UserError(f"data.path folder {path!r} holds no .txt files: {fix}")
    return files
  files = [p.strip() for p in path.split(",") if p.strip()]
  for f in files:
    if not os.path.isfile(f):
      raise UserError(f"data.path file {f!r} does not exist: {fix}")
  return files
