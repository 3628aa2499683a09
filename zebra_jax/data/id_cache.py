"""Token ids on disk: tokenize each split once per workdir, then map it.

  data/{train,valid,test}.npy  int32 ids, memory-mapped on reuse
  data/manifest.json           what the ids were made from

`IdCache.load` returns the ids only when the manifest's source and tokenizer
fingerprints match, so restarting a WikiText-103 run costs milliseconds,
not minutes of tokenizing. `IdCache.write` streams: each piece's ids are
appended to the .npy file and only the header is patched at the end, so
memory stays at a few pieces whatever the corpus size. A progress bar (tqdm
on a terminal, log lines otherwise) shows how far it got.
"""

import io
import json
import os
import sys
import time

from absl import logging
import numpy as np

from zebra_jax.data.splits import SPLITS
from zebra_jax import strict_json

_MANIFEST_VERSION = 1
_LINE_EVERY_S = 10.0  # plain progress lines when stderr is not a terminal


class IdCache:
  """The ids of every split of one (source, tokenizer) pair, in a folder."""

  def __init__(self, folder: str):
    self.folder = folder
    self._manifest = os.path.join(folder, "manifest.json")

  def load(self, source_fingerprint: str, tokenizer_fingerprint: str):
    """{"train"|"valid"|"test": int32 [n] read-only memmap} if the manifest
    matches both fingerprints and every file reads back, else None."""
    try:
      with open(self._manifest, encoding="utf-8") as f:
        manifest = json.load(f)
    except (OSError, ValueError):
      return None
    if (manifest.get("version") != _MANIFEST_VERSION
        or manifest.get("source_fingerprint") != source_fingerprint
        or manifest.get("tokenizer_fingerprint") != tokenizer_fingerprint):
      return None
    ids = {}
    for name in SPLITS:
      try:
        # mmap: the OS pages ids in as batches touch them; nothing is copied.
        ids[name] = np.load(self._path(name), mmap_mode="r")
      except (OSError, ValueError):
        return None
      if ids[name].dtype != np.int32 or ids[name].shape != (
          manifest["num_tokens"][name],):
        return None
    return ids

  def write(self, splits, source_fingerprint: str, tokenizer) -> None:
    """Streams every split's ids into its .npy, then writes the manifest
    last: a crash in between leaves no manifest that vouches for half-written
    ids."""
    os.makedirs(self.folder, exist_ok=True)
    if os.path.exists(self._manifest):
      os.remove(self._manifest)
    counts, start = {}, time.perf_counter()
    for name in SPLITS:
      path = self._path(name)
      tmp = f"{path}.{os.getpid()}.tmp"
      with _Progress(f"tokenizing {name}", splits[name]) as progress:
        counts[name] = stream_npy(
            tmp, tokenizer.encode_chunks(progress.pieces()), progress)
      os.replace(tmp, path)
    seconds = time.perf_counter() - start
    total = sum(counts.values())
    logging.info("tokenized the corpus (%s tokenizer, vocab %d) in %.1f s, "
                 "%.2fM tokens/s: %s", tokenizer.kind, tokenizer.vocab_size,
                 seconds, total / max(seconds, 1e-9) / 1e6,
                 ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    manifest = {"version": _MANIFEST_VERSION,
                "source_fingerprint": source_fingerprint,
                "tokenizer_fingerprint": tokenizer.fingerprint(),
                "tokenizer": tokenizer.kind,
                "vocab_size": tokenizer.vocab_size, "num_tokens": counts}
    tmp = f"{self._manifest}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      strict_json.dump(manifest, f, indent=2)
    os.replace(tmp, self._manifest)

  def _path(self, split: str) -> str:
    return os.path.join(self.folder, f"{split}.npy")


def _npy_header(num_tokens: int) -> bytes:
  """The .npy header of an int32 [num_tokens] array. NumPy pads it to a
  fixed length whatever the count, so it can be rewritten in place."""
  buf = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      buf, {"descr": "<i4", "fortran_order": False, "shape": (num_tokens,)})
  return buf.getvalue()


def stream_npy(path: str, arrays, progress) -> int:
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
  """Progress over a Split's pieces: a tqdm bar on a terminal, else a plain
  line every `_LINE_EVERY_S` seconds (rate and ETA) and one at the end.

  The lines go to stderr with `print`, not the absl log, so a batch job's
  log shows minutes of tokenizing at any log verbosity.
  """

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
    elif time.perf_counter() - self._last > _LINE_EVERY_S:
      self._last = time.perf_counter()
      elapsed = self._last - self._start
      share = self.done / max(self.split.size, 1)
      eta = elapsed * (1 - share) / share if share > 0 else float("nan")
      print(f"{self.label}: {100 * share:.0f}% of {self.split.size:,} "
            f"{self.split.unit}, {self.tokens:,} tokens, "
            f"{self.tokens / elapsed:,.0f} tokens/s, ETA {eta:.0f} s",
            file=sys.stderr, flush=True)

  def __exit__(self, *exc):
    if self._bar is not None:
      self._bar.close()
    seconds = time.perf_counter() - self._start
    if self._bar is None and seconds > _LINE_EVERY_S:  # it printed lines
      print(f"{self.label}: {self.tokens:,} tokens in {seconds:.1f} s",
            file=sys.stderr, flush=True)
