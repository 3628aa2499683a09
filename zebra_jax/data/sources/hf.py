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
                 subfolder, then a `data` one, is looked in first, as in a
                 hub repo's layout).
  the hub cache  offline (HF_HUB_OFFLINE=1, or the hub unreachable): the
                 snapshot huggingface_hub downloaded the repo's files to
                 (HF_HOME/hub/datasets--ORG--NAME/snapshots/REV/), read as
                 a local folder: `datasets` itself looks only in its own
                 arrow cache when offline, not there.
  the hub        `load_dataset(hf_name, hf_config, cache_dir=hf_cache_dir)`;
                 with HF_HUB_OFFLINE=1, datasets' own cache only.

Before the hub is asked, one TCP connect to its endpoint (2 s at most) says
whether it is reachable: huggingface_hub would otherwise retry an unreachable
one for ~20 s, a log line per try, before failing.

Rows of `data.hf_text_column` are the lines. A dataset without a validation
(or test) split holds out the last `data.valid_fraction` (`test_fraction`) of
its train rows instead, and a warning line says so.

`datasets` is optional (`pip install zebra_jax[data]`): imported here only.
"""

import dataclasses
import glob
import os
import socket
import threading
from typing import ClassVar
from urllib import parse

from absl import logging

from zebra_jax.data import splits as splits_lib
from zebra_jax.errors import UserError

# Our split names -> the names datasets use (WikiText says "validation").
_HF_SPLITS = {"train": ("train",), "valid": ("validation", "valid"),
              "test": ("test",)}
_ROWS_PER_PIECE = 20_000  # ~2.5 MB of WikiText per piece
_EXTENSIONS = (("parquet", "parquet"), ("arrow", "arrow"))
# Where push_to_hub puts a dataset's files: a config's own folder, or `data`.
_DEFAULT_DATA_FOLDER = "data"
_PROBE_SECONDS = 2.0
_OFFLINE_HINT = (
    "Offline alternatives: set HF_HUB_OFFLINE=1 to read the copy a run "
    "where the hub was reachable left in the hub cache (HF_HOME/hub) or in "
    "--config.data.hf_cache_dir; or point --config.data.path at a local "
    "parquet/arrow copy; or use --config.data.source=wikitext "
    "--config.data.path=DIR with wiki.{train,valid,test}.tokens")


@dataclasses.dataclass(frozen=True)
class HFSource:
  """A `datasets` DatasetDict's text column, a row a line."""

  name: ClassVar[str] = "hf"
  needs_path: ClassVar[bool] = False

  path: str
  hf_name: str
  hf_config: str
  hf_cache_dir: str
  hf_text_column: str
  valid_fraction: float   # held out of train when the dataset has no valid
  test_fraction: float    # likewise for test

  def fingerprint(self) -> str:
    """What identifies the text: the names, and the local files' stats."""
    desc = {"source": self.name, "hf_name": self.hf_name,
            "hf_config": self.hf_config, "path": self.path,
            "text_column": self.hf_text_column,
            "valid_fraction": float(self.valid_fraction),
            "test_fraction": float(self.test_fraction)}
    if self.path:
      folder = _local_folder(self.path, self.hf_config)
      files = sorted(f for f in glob.glob(os.path.join(folder, "**", "*"),
                                          recursive=True) if os.path.isfile(f))
      desc["files"] = splits_lib.file_stats(files)
    return splits_lib.fingerprint(desc)

  def open(self) -> dict[str, splits_lib.Split]:
    """{"train"|"valid"|"test": Split} streaming the dataset's text column."""
    chosen = _choose_splits(_open(self), self)
    return {name: _dataset_split(name, split, self.hf_text_column)
            for name, split in chosen.items()}

  def describe(self) -> str:
    """How error lines name the dataset: the user's folder, else the hub's."""
    return f"data.path {self.path!r}" if self.path else repr(self.hf_name)


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
    return _open_local(datasets, source.path, source)
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  unreachable = None if constants.HF_HUB_OFFLINE else _unreachable(
      constants.ENDPOINT)
  cached = ""  # what the hub cache holds, when it was looked in
  if constants.HF_HUB_OFFLINE or unreachable:
    snapshot = _cached_snapshot(source)
    if snapshot and _has_config(snapshot, source.hf_config):
      logging.warning("%s: reading the hub cache's copy in %s",
                      "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else
                      f"the hub is unreachable ({unreachable})", snapshot)
      return _open_local(datasets, snapshot, source)
    if unreachable:
      raise UserError(
          f"could not load {source.hf_name!r} ({source.hf_config}): the "
          f"Hugging Face hub at {constants.ENDPOINT} is unreachable "
          f"({unreachable}) and the hub cache holds "
          f"{_cache_contents(snapshot, source)}. {_OFFLINE_HINT}")
    cached = f"; the hub cache holds {_cache_contents(snapshot, source)}"
  name, config = source.hf_name, source.hf_config or None
  try:
    return datasets.load_dataset(name, config,
                                 cache_dir=source.hf_cache_dir or None)
  except (ConnectionError, TimeoutError, OSError) as e:
    raise UserError(
        f"could not load {name!r} ({config}) from the Hugging Face hub: "
        f"{type(e).__name__}: {_one_line(e)}{cached}. {_OFFLINE_HINT}"
    ) from e
  except ValueError as e:  # e.g. an unknown config, or one not cached
    raise UserError(f"datasets could not load {name!r} ({config}): "
                    f"{_one_line(e)}{cached}: check data.hf_name and "
                    "data.hf_config") from e


def _unreachable(endpoint: str) -> str | None:
  """Why the hub's endpoint takes no TCP connection within _PROBE_SECONDS
  (DNS included, which has no timeout of its own), or None when it does."""
  url = parse.urlsplit(endpoint)
  port = url.port or (443 if url.scheme == "https" else 80)
  outcome = ["no answer within %.0f s" % _PROBE_SECONDS]

  def connect():
    try:
      socket.create_connection((url.hostname, port), _PROBE_SECONDS).close()
      outcome[0] = None
    except OSError as e:
      outcome[0] = f"{type(e).__name__}: {e.strerror or e}"

  probe = threading.Thread(target=connect, daemon=True)
  probe.start()
  probe.join(_PROBE_SECONDS)
  return outcome[0]


def _cached_snapshot(source) -> str | None:
  """The folder of the hub repo's snapshot in the hub cache (or in
  data.hf_cache_dir, if it holds one), or None."""
  from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top
  from huggingface_hub.errors import LocalEntryNotFoundError  # pylint: disable=g-import-not-at-top
  for cache_dir in (source.hf_cache_dir or None, None):  # None: the default
    try:
      return snapshot_download(source.hf_name, repo_type="dataset",
                               local_files_only=True, cache_dir=cache_dir)
    except (LocalEntryNotFoundError, ValueError, OSError):
      continue
  return None


def _has_config(snapshot: str, config: str) -> bool:
  """Whether the snapshot holds the config's files: its own folder, or, in
  a repo with no config folders, its `data` folder or top level."""
  if config and os.path.isdir(os.path.join(snapshot, config)):
    return True
  return not _snapshot_configs(snapshot)


def _snapshot_configs(snapshot: str) -> list[str]:
  """The config folders of a snapshot: those holding parquet/arrow files."""
  return sorted(
      entry for entry in os.listdir(snapshot)
      if entry != _DEFAULT_DATA_FOLDER
      and os.path.isdir(os.path.join(snapshot, entry))
      and any(glob.glob(os.path.join(snapshot, entry, "**", f"*.{ext}"),
                        recursive=True) for _, ext in _EXTENSIONS))


def _cache_contents(snapshot: str | None, source) -> str:
  """What the hub cache holds of the dataset, for an error line."""
  if snapshot is None:
    return f"no copy of {source.hf_name!r}"
  return (f"configs {', '.join(_snapshot_configs(snapshot))} of "
          f"{source.hf_name!r}, not {source.hf_config!r}")


def _open_local(datasets, path: str, source):
  folder = _local_folder(path, source.hf_config)
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
      f"{folder!r} holds no dataset: for data.source=hf it must hold "
      "save_to_disk output (dataset_dict.json) or train-*.parquet, "
      "validation-*.parquet, test-*.parquet (or .arrow) files; fix "
      "--config.data.path, or leave it empty to use the hub")


def _local_folder(path: str, config: str) -> str:
  """path's config subfolder, else its `data` one (a hub repo's layouts),
  else path itself."""
  if not os.path.isdir(path):
    raise UserError(f"data.path {path!r} is not a folder: for data.source=hf "
                    "point it at a local dataset folder, or leave it empty")
  for sub in (config, _DEFAULT_DATA_FOLDER):
    if sub and os.path.isdir(os.path.join(path, sub)):
      return os.path.join(path, sub)
  return path


def _choose_splits(dataset, source) -> dict:
  """{"train"|"valid"|"test": datasets.Dataset}; a split the dataset lacks
  is held out of train's last rows (valid before test)."""
  chosen = {name: next((dataset[n] for n in hf_names if n in dataset), None)
            for name, hf_names in _HF_SPLITS.items()}
  if chosen["train"] is None:
    raise UserError(
        f"the dataset ({source.describe()}) has splits {list(dataset)}, no "
        "'train': data.source=hf needs a train split (validation and test "
        "may be held out of it)")
  _check_text_column(chosen, source)
  missing = [name for name in ("valid", "test") if chosen[name] is None]
  if missing:
    chosen.update(_hold_out(chosen["train"], missing, source))
  return chosen


def _check_text_column(chosen: dict, source) -> None:
  for name, split in chosen.items():
    if split is not None and source.hf_text_column not in split.column_names:
      raise UserError(
          f"the {name} split of {source.describe()} has columns "
          f"{split.column_names}, not {source.hf_text_column!r}: set "
          "--config.data.hf_text_column to the column holding the text")


def _hold_out(train, missing: list[str], source) -> dict:
  """train's last rows as the missing splits, the rest as train."""
  fractions = {"valid": source.valid_fraction, "test": source.test_fraction}
  counts = {name: splits_lib.held_out_count(train.num_rows, fractions[name])
            for name in missing}
  stop = train.num_rows - sum(counts.values())
  held = {"train": train.select(range(stop))}
  for name in missing:
    held[name] = train.select(range(stop, stop + counts[name]))
    stop += counts[name]
  logging.warning(
      "%s has no %s split: holding out the last %s of its %d train rows "
      "(data.valid_fraction / data.test_fraction)", source.describe(),
      " or ".join(missing), " and ".join(
          f"{counts[n]} rows as {n}" for n in missing), train.num_rows)
  return held


def _dataset_split(name: str, split, column: str) -> splits_lib.Split:
  """Rows -> lines: each row ends with exactly one "\\n" ("" is a blank line)."""
  def read():
    for batch in split.iter(batch_size=_ROWS_PER_PIECE):
      rows = batch[column]
      yield "".join(r if r.endswith("\n") else r + "\n" for r in rows), len(rows)
  return splits_lib.Split(name, split.num_rows, "rows", read)


def _one_line(error: Exception) -> str:
  """The whole message on one line (datasets' lists of cached configs
  included): error lines are one line."""
  return " ".join(str(error).split())
