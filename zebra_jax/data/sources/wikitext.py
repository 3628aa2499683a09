"""`data.source=wikitext`: a folder in the WikiText layout.

wiki.{train,valid,test}.tokens (or .raw), each file streamed in pieces.
"""

import dataclasses
import os
from typing import ClassVar

from zebra_jax.data import splits as splits_lib
from zebra_jax.errors import UserError

_SUFFIXES = (".tokens", ".raw")


@dataclasses.dataclass(frozen=True)
class WikitextSource:
  """The three files of a WikiText folder, one per split."""

  name: ClassVar[str] = "wikitext"
  needs_path: ClassVar[bool] = True

  path: str

  def fingerprint(self) -> str:
    return splits_lib.fingerprint({
        "source": self.name, "path": self.path,
        "files": splits_lib.file_stats(self._files())})

  def open(self) -> dict[str, splits_lib.Split]:
    return {name: splits_lib.file_split(name, path)
            for name, path in zip(splits_lib.SPLITS, self._files())}

  def _files(self) -> list[str]:
    """[train, valid, test] paths; .tokens preferred, .raw accepted."""
    folder = self.path
    if not folder or not os.path.isdir(folder):
      raise UserError(
          f"data.path {folder!r} is not a folder: set --config.data.path to "
          "a folder holding wiki.train.tokens, wiki.valid.tokens, "
          "wiki.test.tokens")
    files = []
    for split in splits_lib.SPLITS:
      candidates = [os.path.join(folder, f"wiki.{split}{suffix}")
                    for suffix in _SUFFIXES]
      found = [c for c in candidates if os.path.isfile(c)]
      if not found:
        raise UserError(
            f"{candidates[0]} is missing: data.path must hold "
            f"wiki.{split}.tokens (or wiki.{split}.raw); download WikiText or "
            "fix --config.data.path")
      files.append(found[0])
    return files
