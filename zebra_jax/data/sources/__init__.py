"""Where the text comes from: sources chosen by name (`data.source`).

A source is a frozen dataclass whose fields are the `config.data` options it
reads (same names); `pipeline` fills them in, nothing below reads the config.
Each source has:

  fingerprint()  a short hash that changes whenever its text may change;
                 cheap (stats files, reads none), so cached ids can be reused
                 without touching the corpus.
  open()         {"train"|"valid"|"test": splits.Split}, streamed.

Adding a source: one module here and one line in `SOURCES`.
"""

from typing import ClassVar, Protocol

from zebra_jax.data import splits as splits_lib
from zebra_jax.data.sources.embedded import EmbeddedSource
from zebra_jax.data.sources.hf import HFSource
from zebra_jax.data.sources.text import TextSource
from zebra_jax.data.sources.tfds import TFDSSource
from zebra_jax.data.sources.wikitext import WikitextSource
from zebra_jax.errors import UserError


class Source(Protocol):
  name: ClassVar[str]          # the data.source value that picks it
  needs_path: ClassVar[bool]   # data.path must be set

  def fingerprint(self) -> str: ...

  def open(self) -> dict[str, splits_lib.Split]: ...


SOURCES: dict[str, type] = {cls.name: cls for cls in (
    EmbeddedSource, WikitextSource, TextSource, HFSource, TFDSSource)}


def source_class(name: str) -> type:
  """The class `data.source=name` picks; an unknown name is a UserError."""
  if name not in SOURCES:
    raise UserError(f"data.source {name!r} is unknown: set "
                    f"--config.data.source to one of {', '.join(SOURCES)}")
  return SOURCES[name]


def open_splits(source: Source) -> dict[str, splits_lib.Split]:
  """`source.open()`, refusing a train split with no text in it."""
  splits = source.open()
  if splits["train"].is_blank():
    raise UserError(
        f"the train split of data.source={source.name!r} "
        f"({source}) is empty: point --config.data.path at files holding "
        "text, or lower data.valid_fraction/test_fraction")
  return splits


def load_splits(source: Source) -> dict[str, str]:
  """The whole text of every split (small corpora, tests)."""
  return {name: split.text() for name, split in open_splits(source).items()}
