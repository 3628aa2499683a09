"""Token ids on disk, and the batchers that cut them into training windows.

`prepare_data` tokenizes each split once and caches the ids in the workdir:

  workdir/tokenizer/tokenizer.json   the vocabulary (saved with the run)
  workdir/data/{train,valid,test}.npy  int32 ids, memory-mapped on reuse
  workdir/data/manifest.json         what the ids were made from

A later call whose source and tokenizer fingerprints match the manifest maps
the .npy files and never reads the corpus: restarting a WikiText-103 run costs
milliseconds, not minutes of tokenizing. The first call streams: the corpus
is read in pieces, each piece's ids are appended to the .npy file, and only
the header is patched at the end, so memory stays at a few pieces whatever
the corpus size. A progress bar (tqdm on a terminal, log lines otherwise)
shows how far it got.

Batchers are index -> batch functions with no hidden state, so a checkpoint
only needs a `DataPosition` to resume at exactly the next batch.
"""

import dataclasses
import io
import json
import os
import sys
import time

from absl import logging
import numpy as np

from zebra_jax.data import corpus, tokenizer as tokenizer_lib
from zebra_jax.errors import UserError

SPLITS = corpus.SPLITS
_MANIFEST_VERSION = 1
_LOG_EVERY_S = 30.0  # plain progress lines when stderr is not a terminal


def prepare_data(config, workdir: str):
  """Tokenizer + ids for every split, built once per workdir and then reused.

  Args:
    config: the full config; reads `config.data`.
    workdir: the run's folder.

  Returns:
    (tokenizer, {"train"|"valid"|"test": int32 [num_tokens]}): read-only
    memory maps of the cached .npy files.
  """
  data_config = config.data
  tokenizer_dir = os.path.join(workdir, "tokenizer")
  data_dir = os.path.join(workdir, "data")
  tokenizer = None
  if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
    tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
    _check_tokenizer_settings(tokenizer, data_config, workdir)

  source = corpus.source_fingerprint(data_config)  # stats files, reads none
  if tokenizer is not None:
    ids = _load_cached_ids(data_dir, source, tokenizer.fingerprint())
    if ids is not None:
      return tokenizer, ids
    logging.info("no matching token cache in %s: reading the corpus", data_dir)

  splits = corpus.open_splits(data_config)
  if tokenizer is None:
    start = time.perf_counter()
    tokenizer = tokenizer_lib.make_tokenizer(data_config,
                                             splits["train"].chunks())
    tokenizer.save(tokenizer_dir)
    logging.info("built the %s tokenizer (vocab %d) in %.1f s",
                 tokenizer.kind, tokenizer.vocab_size,
                 time.perf_counter() - start)
  _write_ids(data_dir, splits, source, tokenizer)
  ids = _load_cached_ids(data_dir, source, tokenizer.fingerprint())
  if ids is None:
    raise UserError(f"the token cache just written to {data_dir} does not "
                    "read back: check the disk (space, permissions) and rerun")
  return tokenizer, ids


def load_eval_data(config, workdir: str):
  """Like `prepare_data`, for eval and sample: the workdir must hold the
  tokenizer the model was trained with, since a rebuilt one could differ."""
  path = os.path.join(workdir, "tokenizer", "tokenizer.json")
  if not os.path.isfile(path):
    raise UserError(f"workdir {workdir!r} has no tokenizer ({path} is "
                    "missing): train first with --mode=train and this "
                    "--workdir")
  return prepare_data(config, workdir)


def _check_tokenizer_settings(tokenizer, data_config, workdir: str) -> None:
  saved = tokenizer.settings()
  wanted = tokenizer_lib.config_settings(data_config)
  if saved != wanted:
    show = lambda d: " ".join(f"{k}={v}" for k, v in d.items())
    raise UserError(
        f"workdir {workdir!r} was made with {show(saved)}, but the config "
        f"asks for {show(wanted)}: use a new --workdir or the same data "
        "settings")


def _load_cached_ids(data_dir: str, source: str, tokenizer_fingerprint: str):
  """The cached ids if the manifest matches, else None."""
  try:
    with open(os.path.join(data_dir, "manifest.json"), encoding="utf-8") as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  if (manifest.get("version") != _MANIFEST_VERSION
      or manifest.get("source_fingerprint") != source
      or manifest.get("tokenizer_fingerprint") != tokenizer_fingerprint):
    return None
  ids = {}
  for name in SPLITS:
    try:
      # mmap: the OS pages ids in as batches touch them; nothing is copied.
      ids[name] = np.load(os.path.join(data_dir, f"{name}.npy"), mmap_mode="r")
    except (OSError, ValueError):
      return None
    if ids[name].dtype != np.int32 or ids[name].shape != (
        manifest["num_tokens"][name],):
      return None
  return ids


def _write_ids(data_dir: str, splits, source: str, tokenizer) -> None:
  """Streams every split's ids into its .npy, then writes the manifest last:
  a crash in between leaves no manifest that vouches for half-written ids."""
  os.makedirs(data_dir, exist_ok=True)
  manifest_path = os.path.join(data_dir, "manifest.json")
  if os.path.exists(manifest_path):
    os.remove(manifest_path)
  counts, start = {}, time.perf_counter()
  for name in SPLITS:
    path = os.path.join(data_dir, f"{name}.npy")
    tmp = f"{path}.{os.getpid()}.tmp"
    with _Progress(f"tokenizing {name}", splits[name]) as progress:
      counts[name] = _stream_npy(
          tmp, tokenizer.encode_chunks(progress.pieces()), progress)
    os.replace(tmp, path)
  seconds = time.perf_counter() - start
  total = sum(counts.values())
  logging.info("tokenized the corpus (%s tokenizer, vocab %d) in %.1f s, "
               "%.2fM tokens/s: %s", tokenizer.kind, tokenizer.vocab_size,
               seconds, total / max(seconds, 1e-9) / 1e6,
               ", ".join(f"{k} {v:,}" for k, v in counts.items()))
  manifest = {"version": _MANIFEST_VERSION, "source_fingerprint": source,
              "tokenizer_fingerprint": tokenizer.fingerprint(),
              "tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
              "num_tokens": counts}
  tmp = f"{manifest_path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=2)
  os.replace(tmp, manifest_path)


def _npy_header(num_tokens: int) -> bytes:
  """The .npy header of an int32 [num_tokens] array. NumPy pads it to a
  fixed length whatever the count, so it can be rewritten in place."""
  buf = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      buf, {"descr": "<i4", "fortran_order": False, "shape": (num_tokens,)})
  return buf.getvalue()


def _stream_npy(path: str, arrays, progress) -> int:
  """Appends int32 arrays to a .npy file at `path`; returns the count."""
  header = _npy_header(0)
  count = 0
  with open(path, "wb") as f:
    f.write(header)
    for array in arrays:
      f.write(np.ascontiguousarray(array, "<i4").tobytes())
      count += len(array)
      progress.add_tokens(len(array))
    final = _npy_header(count)
    if len(final) != len(header):  # cannot happen with NumPy's padding
      raise RuntimeError(f"npy header grew from {len(header)} to {len(final)}")
    f.seek(0)
    f.write(final)
  return count


class _Progress:
  """Progress over a Split's pieces: a tqdm bar on a terminal, else a log
  line every `_LOG_EVERY_S` seconds and one at the end."""

  def __init__(self, label: str, split):
    self.label, self.split = label, split
    self.tokens, self.done, self._last = 0, 0, time.perf_counter()
    self._start = self._last
    self._bar = None
    if sys.stderr.isatty():
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=split.size, unit=split.unit, unit_scale=True,
                       desc=label, leave=False, file=sys.stderr)

  def __enter__(self):
    return self

  def pieces(self):
    for piece, units in self.split.read():
      yield piece
      self.done += units  # counted when the next piece is asked for
      if self._bar is not None:
        self._bar.update(units)

  def add_tokens(self, n: int) -> None:
    self.tokens += n
    if self._bar is not None:
      self._bar.set_postfix(tokens=f"{self.tokens:,}", refresh=False)
    elif time.perf_counter() - self._last > _LOG_EVERY_S:
      self._last = time.perf_counter()
      logging.info("%s: %.0f%% of %s %s, %s tokens", self.label,
                   100 * self.done / max(self.split.size, 1),
                   f"{self.split.size:,}", self.split.unit, f"{self.tokens:,}")

  def __exit__(self, *exc):
    if self._bar is not None:
      self._bar.close()
    seconds = time.perf_counter() - self._start
    logging.info("%s: %s tokens in %.1f s", self.label, f"{self.tokens:,}",
                 seconds)


# ------------------------------------------------------------------ batchers


def _local_rows(batch_size: int, process_index: int, process_count: int):
  """This process's slice [start, stop) of the global batch rows."""
  if batch_size <= 0 or batch_size % process_count:
    raise UserError(
        f"data.batch_size={batch_size} must be a positive multiple of the "
        f"process count {process_count}: set --config.data.batch_size to a "
        "multiple of it")
  local = batch_size // process_count
  return process_index * local, (process_index + 1) * local


class StreamBatcher:
  """Contiguous streams for truncated BPTT: the carry flows between windows.

  The id stream is cut into `batch_size` rows (the tail that does not fill a
  row is dropped), and batch `i` is the i-th `seq_len` window of every row.
  With the alphabet as the stream, batch_size=4, seq_len=2:

      stream  a b c d e f g h i j k l m n o p q r s t u v w x y z
      rows    ┌ a b c d e f ┐   get(0): inputs  [[a b] [g h] [m n] [s t]]
              │ g h i j k l │           targets [[b c] [h i] [n o] [t u]]
              │ m n o p q r │   get(1): inputs  [[c d] [i j] [o p] [u v]]
              └ s t u v w x ┘           targets [[d e] [j k] [p q] [v w]]

  Row r of batch i+1 continues row r of batch i, so the model's final
  (h, c) for a row is the right start for the row's next window. Each row
  has (row_len - 1) // seq_len full windows (targets need one token more);
  the partial last window is dropped so every batch has the same shape.
  """

  def __init__(self, ids, batch_size: int, seq_len: int, process_index: int = 0,
               process_count: int = 1):
    self.batch_size, self.seq_len = int(batch_size), int(seq_len)
    start, stop = _local_rows(self.batch_size, process_index, process_count)
    row_len = len(ids) // self.batch_size if self.batch_size else 0
    if self.seq_len <= 0 or row_len < self.seq_len + 1:
      raise UserError(
          f"a split of {len(ids):,} tokens is too short for batch_size="
          f"{batch_size} rows of seq_len={seq_len}+1 tokens: lower "
          "--config.data.batch_size or --config.data.seq_len (or the eval "
          "ones)")
    rows = ids[:row_len * self.batch_size].reshape(self.batch_size, row_len)
    self._rows = rows[start:stop]  # [local_batch, row_len], a view: no copy
    self.local_batch_size = stop - start
    self.batches_per_epoch = (row_len - 1) // self.seq_len

  def __len__(self) -> int:
    return self.batches_per_epoch

  def get(self, index: int, epoch: int = 0):
    """The index-th window of every local row (`epoch` does not matter here).

    Returns:
      (inputs, targets): int32 [local_batch, seq_len] each.
    """
    del epoch  # every epoch reads the same streams in the same order
    if not 0 <= index < self.batches_per_epoch:
      raise IndexError(f"batch {index} of {self.batches_per_epoch}")
    t = index * self.seq_len
    window = np.array(self._rows[:, t:t + self.seq_len + 1], np.int32)
    return _split_window(window)


class RandomWindowBatcher:
  """`batch_size` windows at random offsets; no carry between batches.

  The offsets come from a generator seeded with (seed, epoch, index), so
  batch k is the same whether a run got there directly or resumed from a
  checkpoint. All processes draw the same global batch and keep their rows.
  """

  def __init__(self, ids, batch_size: int, seq_len: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    self.batch_size, self.seq_len, self.seed = (int(batch_size), int(seq_len),
                                                int(seed))
    self._start, self._stop = _local_rows(self.batch_size, process_index,
                                          process_count)
    if self.seq_len <= 0 or len(ids) < self.seq_len + 1:
      raise UserError(
          f"a split of {len(ids):,} tokens is too short for windows of "
          f"seq_len={seq_len}+1 tokens: lower --config.data.seq_len")
    self._ids = ids
    self.local_batch_size = self._stop - self._start
    # About one pass over the tokens; at least one batch for tiny splits.
    self.batches_per_epoch = max(
        1, len(ids) // (self.batch_size * self.seq_len))

  def __len__(self) -> int:
    return self.batches_per_epoch

  def get(self, index: int, epoch: int = 0):
    """Batch `index` of `epoch`: a pure function of (seed, epoch, index).

    Returns:
      (inputs, targets): int32 [local_batch, seq_len] each.
    """
    rng = np.random.default_rng([self.seed, int(epoch), int(index)])
    offsets = rng.integers(0, len(self._ids) - self.seq_len,
                           size=self.batch_size)[self._start:self._stop]
    positions = offsets[:, None] + np.arange(self.seq_len + 1)  # [b, T+1]
    window = np.array(self._ids[positions], np.int32)
    return _split_window(window)


def _split_window(window: np.ndarray):
  """[b, T+1] -> inputs [b, T], targets [b, T] (shifted by one), contiguous."""
  return (np.ascontiguousarray(window[:, :-1]),
          np.ascontiguousarray(window[:, 1:]))


def make_batcher(data_config, ids, seed: int, process_index: int = 0,
                 process_count: int = 1):
  """The batcher `data_config.batching` names, over one split's ids."""
  if data_config.batching == "streams":
    return StreamBatcher(ids, data_config.batch_size, data_config.seq_len,
                         process_index, process_count)
  if data_config.batching == "random":
    return RandomWindowBatcher(ids, data_config.batch_size,
                               data_config.seq_len, seed, process_index,
                               process_count)
  raise UserError(f"data.batching {data_config.batching!r} is unknown: set "
                  "--config.data.batching to streams or random")


@dataclasses.dataclass(frozen=True)
class DataPosition:
  """Where the trainer is in the data: the next batch to read is
  `batcher.get(index, epoch)`. Saved in checkpoints to resume exactly."""

  epoch: int = 0
  index: int = 0

  def advance(self, batches_per_epoch: int) -> "DataPosition":
    """The position after reading one batch; wraps into the next epoch."""
    if self.index + 1 >= batches_per_epoch:
      return DataPosition(self.epoch + 1, 0)
    return DataPosition(self.epoch, self.index + 1)

  def to_dict(self) -> dict[str, int]:
    return {"epoch": self.epoch, "index": self.index}

  @classmethod
  def from_dict(cls, d) -> "DataPosition":
    return cls(epoch=int(d["epoch"]), index=int(d["index"]))
