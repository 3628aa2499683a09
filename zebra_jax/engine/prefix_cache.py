"""Prompt prefixes' model state, so a request starts where another stopped.

After any prefix an LSTM's whole context is its carry ((h, c) per layer)
and the next token's logits: a few KiB whatever the prefix's length. An
entry sits at a chunk boundary of a prompt (a multiple of the engine's
prefill chunk, or the prompt's end), so a prefill resumed from it consumes
the very chunks a cold prefill would, through the same program, and rounds
identically. Keys chain like vLLM's block hashes, digest(parent key, chunk
tokens): one key names the whole prefix before it. Host memory only, LRU,
bounded by bytes; the engine clears it when the weights change.
"""

import collections
import dataclasses
import hashlib
import threading
from typing import Any

import jax
import numpy as np

_ROOT = b"zebra-prefix"


def chunk_keys(ids: np.ndarray, chunk: int) -> list[bytes]:
  """Key j names ids[:(j + 1) * chunk] (the last: the whole prompt)."""
  ids = np.ascontiguousarray(ids, np.int32)
  keys, parent = [], _ROOT
  for start in range(0, len(ids), chunk):
    parent = hashlib.blake2b(parent + ids[start:start + chunk].tobytes(),
                             digest_size=16).digest()
    keys.append(parent)
  return keys


@dataclasses.dataclass
class Entry:
  """The state after a prefix, and its last chunk's prompt logprobs."""
  carry: tuple            # one row's carry: its leaves, host arrays
  logits: np.ndarray      # float32 [V]: the next token's
  tokens: int             # tokens in the prefix's last chunk
  logprobs: tuple | None  # that chunk's (logprob, top ids, top logprobs,
                          # rank), when the row that computed it asked
  # Counted once: put and eviction read it for every entry they move.
  nbytes: int = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    arrays = jax.tree.leaves((self.carry, self.logits, self.logprobs))
    self.nbytes = sum(a.nbytes for a in arrays)


class PrefixCache:
  """Entries by key, least recently used first out, at most `max_bytes`.

  `queries` counts prompt tokens looked up, `hits` those found (vLLM's
  prefix-cache counters); neither resets on `clear`.
  """

  def __init__(self, max_bytes: int):
    self.max_bytes = max_bytes
    self.bytes = self.queries = self.hits = 0
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()  # the engine's thread writes, stats read

  def __len__(self) -> int:
    return len(self._entries)

  def get(self, key: bytes, with_logprobs: bool) -> Entry | None:
    """The entry (now the most recent), if held with logprobs when asked."""
    with self._lock:
      entry = self._entries.get(key)
      if entry is None or (with_logprobs and entry.logprobs is None):
        return None
      self._entries.move_to_end(key)
      return entry

  def has(self, key: bytes, with_logprobs: bool) -> bool:
    return not self.missing([key], [with_logprobs])

  def missing(self, keys: list, with_logprobs: list) -> list[int]:
    """The indices of the keys not held (or held without logprobs where
    asked): one lock for a prefill call's rows."""
    with self._lock:
      entries = [self._entries.get(key) for key in keys]
    return [i for i, (entry, wants) in enumerate(zip(entries, with_logprobs))
            if entry is None or (wants and entry.logprobs is None)]

  def put(self, key: bytes, entry: Entry) -> None:
    """Holds `entry` (replacing one without logprobs), evicting the least
    recently used until the bound holds; one larger than the bound is
    dropped."""
    size = entry.nbytes
    with self._lock:
      old = self._entries.pop(key, None)
      if old is not None:
        self.bytes -= old.nbytes
        if old.logprobs is not None and entry.logprobs is None:
          entry, size = old, old.nbytes
      if size > self.max_bytes:
        return
      self._entries[key] = entry
      self.bytes += size
      while self.bytes > self.max_bytes:
        _, evicted = self._entries.popitem(last=False)
        self.bytes -= evicted.nbytes

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()
      self.bytes = 0

  def stats(self) -> dict:
    with self._lock:
      return {"prefix_cache_queries": self.queries,
              "prefix_cache_hits": self.hits,
              "prefix_cache_bytes": self.bytes,
              "prefix_cache_entries": len(self._entries)}
