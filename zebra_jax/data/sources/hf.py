"""`data.source=hf`: text from a Hugging Face `datasets` dataset, a row a line.

Default: `Salesforce/wikitext`, whose configs are wikitext-103-v1 (tokenised,
rare words already `<unk>`), wikitext-103-raw-v1, wikitext-2-v1 and
wikitext-2-raw-v1, with splits train / validation / test. Its rows are the
lines of the original wiki.*.tokens files ("" for a blank line), so
word-level ids match the WikiText folder source token for token.

Where the data comes from, first match wins:

  data.path      a local folder: `save_to_disk` output (dataset_dict.json),
                 or parquet / arrow files named by split (train-*.parquet,
                 validation-*.parquet, test-*.parquet; a `data.hf_config`
                 subfolder is looked in first, as in the hub repo's layout).
  the hub        `load_dataset(hf_name, hf_config, cache_dir=hf_cache_dir)`;
                 with HF_HUB_OFFLINE=1 it reads the cached copy only.

`datasets` is optional (`pip install zebra_jax[data]`): imported here only.
"""

import dataclasses
import glob
import os
from typing import ClassVar

from zebra_jax.data import splits as splits_lib
from zebra_jax.errors import UserError

# Our split names -> the names datasets use (WikiText says "validation").
_HF_SPLITS = {"train": ("train",), "valid": ("validation", "valid"),
              "test": ("test",)}
_ROWS_PER_PIECE = 20_000  # ~2.5 MB of WikiText per piece
_EXTENSIONS = (("parquet", "parquet"), ("arrow", "arrow"))
_TEXT_COLUMN = "text"



@dataclasses.dataclass(frozen=True)
class HFSource:
  """A `datasets` DatasetDict's text column, a row a line."""

  name: ClassVar[str] = "hf"
  needs_path: ClassVar[bool] = False

  path: str
  hf_name: str
  hf_config: str
  hf_cache_dir: str

  def fingerprint(self) -> str:
    """What identifies the text: the names, and the local files' stats."""
    desc = {"source": self.name, "hf_name": self.hf_name,
            "hf_config": self.hf_config, "path": self.path}
    if self.path:
      folder = _local_folder(self)
      files = sorted(f for f in glob.glob(os.path.join(folder, "**", "*"),
                                          recursive=True) if os.path.isfile(f))
      desc["files"] = splits_lib.file_stats(files)
    return splits_lib.fingerprint(desc)

  def open(self) -> dict[str, splits_lib.Split]:
    """{"train"|"valid"|"test": Split} streaming the dataset's text column."""
    dataset = _open(self)
    return {name: _dataset_split(name, _pick_split(dataset, name, self))
            for name in splits_lib.SPLITS}


def _import_datasets():
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError(
        "data.source=hf needs the `datasets` package: pip install "
        "'zebra_jax[data]' (or pip install datasets), or use "
        "data.source=wikitext with a local WikiText folder") from None
  datasets.disable_progress_bars()  # ours (the id cache's) is the one to watch
  return datasets


def _open(source):
  """The DatasetDict named by the config; network trouble -> UserError."""
  datasets = _import_datasets()
  if source.path:
    return _open_local(datasets, source)
  name, config = source.hf_name, source.hf_config or None
  try:
    return datasets.load_dataset(name, config,
                                 cache_dir=source.hf_cache_dir or None)
  except (ConnectionError, TimeoutError, OSError) as e:
    raise UserError(
        f"could not load {name!r} ({config}) from the Hugging Face hub: "
        f"{type(e).__name__}: {_first_line(e)}. Offline alternatives: "
        "run once where the hub is reachable and set HF_HUB_OFFLINE=1 with "
        "the same --config.data.hf_cache_dir; or point --config.data.path at "
        "a local parquet/arrow copy; or use --config.data.source=wikitext "
        "--config.data.path=DIR with wiki.{train,valid,test}.tokens") from e
  except ValueError as e:  # e.g. an unknown config name
    raise UserError(f"datasets could not load {name!r} ({config}): "
                    f"{_first_line(e)}: check data.hf_name and "
                    "data.hf_config") from e


def _open_local(datasets, source):
  folder = _local_folder(source)
  if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
    return datasets.load_from_disk(folder)
  for builder, ext in _EXTENSIONS:
    files = {}
    for hf_names in _HF_SPLITS.values():
      for hf_name in hf_names:
        found = sorted(glob.glob(os.path.join(folder, f"{hf_name}[-.]*{ext}"))
                       + glob.glob(os.path.join(folder, hf_name, f"*.{ext}")))
        if found:
          files[hf_name] = found
          break
    if files:
      return datasets.load_dataset(builder, data_files=files,
                                   cache_dir=source.hf_cache_dir or None)
  raise UserError(
      f"data.path {folder!r} holds no dataset: for data.source=hf it must "
      "hold save_to_disk output (dataset_dict.json) or train-*.parquet, "
      "validation-*.parquet, test-*.parquet (or .arrow) files; leave "
      "data.path empty to use the hub")


def _local_folder(source) -> str:
  """data.path, or its hf_config subfolder when it has one (hub layout)."""
  path = source.path
  if not os.path.isdir(path):
    raise UserError(f"data.path {path!r} is not a folder: for data.source=hf "
                    "point it at a local dataset folder, or leave it empty")
  sub = os.path.join(path, source.hf_config or "")
  return sub if source.hf_config and os.path.isdir(sub) else path


def _pick_split(dataset, name: str, source):
  for hf_name in _HF_SPLITS[name]:
    if hf_name in dataset:
      split = dataset[hf_name]
      if _TEXT_COLUMN not in split.column_names:
        raise UserError(
            f"split {hf_name!r} of the dataset has columns "
            f"{split.column_names}, not {_TEXT_COLUMN!r}: data.source=hf "
            "reads a 'text' column, one line per row")
      return split
  raise UserError(
      f"the dataset ({source.hf_name or source.path}) has splits "
      f"{list(dataset)}, none of {list(_HF_SPLITS[name])}: data.source=hf "
      "needs train, validation and test splits")


def _dataset_split(name: str, split) -> splits_lib.Split:
  """Rows -> lines: each row ends with exactly one "\\n" ("" is a blank line)."""
  def read():
    for batch in split.iter(batch_size=_ROWS_PER_PIECE):
      rows = batch[_TEXT_COLUMN]
      yield "".join(r if r.endswith("\n") else r + "\n" for r in rows), len(rows)
  return splits_lib.Split(name, split.num_rows, "rows", read)


def _first_line(error: Exception) -> str:
  return (str(error).strip().splitlines() or [""])[0]
