"""Batchers: index -> batch functions over one split's ids, no hidden state.

A checkpoint only needs a `DataPosition` to resume at exactly the next batch.
"""

import dataclasses

import numpy as np

from zebra_jax.errors import UserError


def _local_rows(batch_size: int, process_index: int, process_count: int):
  """This process's slice [start, stop) of the global batch rows."""
  if batch_size <= 0 or batch_size % process_count:
    raise UserError(
        f"data.batch_size={batch_size} must be a positive multiple of the "
        f"process count {process_count}: set --config.data.batch_size to a "
        "multiple of it")
  local = batch_size // process_count
  return process_index * local, (process_index + 1) * local


class _Batches:
  """What the training loop asks of every batcher besides its batches."""
  batch_size: int
  seq_len: int
  batches_per_epoch: int

  def __len__(self) -> int:
    return self.batches_per_epoch

  @property
  def tokens_per_batch(self) -> int:
    """Input tokens in one global batch (every process's rows)."""
    return self.batch_size * self.seq_len


class StreamBatcher(_Batches):
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

  def starts_fresh(self, index: int) -> bool:
    """Whether batch `index` begins new streams, so the carry restarts at 0:
    the first batch of an epoch; later ones continue the previous rows."""
    return index == 0

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


class RandomWindowBatcher(_Batches):
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

  def starts_fresh(self, index: int) -> bool:
    """Every batch: random windows continue nothing, so the carry restarts."""
    del index
    return True

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


BATCHERS = {"streams": StreamBatcher, "random": RandomWindowBatcher}


def make_batcher(batching: str, ids, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
  """The batcher `batching` names ("streams" or "random") over `ids`."""
  if batching not in BATCHERS:
    raise UserError(f"data.batching {batching!r} is unknown: set "
                    f"--config.data.batching to one of "
                    f"{' or '.join(BATCHERS)}")
  if batching == "random":
    return RandomWindowBatcher(ids, batch_size, seq_len, seed, process_index,
                               process_count)
  return StreamBatcher(ids, batch_size, seq_len, process_index, process_count)


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
