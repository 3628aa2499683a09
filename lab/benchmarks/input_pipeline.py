"""How fast the input pipeline feeds the train step, on synthetic ids.

Run by `python -m lab.data_bench`.

Builds a 100M-token int32 id array as an np.memmap in a temp folder (as the
real cache is read), then times StreamBatcher.get alone and followed by
jax.device_put + block_until_ready (host -> device), at the wt103 recipe's
shapes (batch 128, seq_len 128). The batcher must outpace the train step by
10x or more so input never shows in the step time; pass the step's measured
tokens/s as --step_tokens_per_s to print the ratio.
"""

import os
import tempfile
import time

import jax
import numpy as np

from zebra_jax.data import pipeline


def synthetic_ids(path: str, num_tokens: int, vocab_size: int) -> np.memmap:
  """A read-only int32 memmap of random ids, written 16M tokens at a time."""
  ids = np.memmap(path, np.int32, "w+", shape=(num_tokens,))
  rng = np.random.default_rng(0)
  block = 1 << 24
  for start in range(0, num_tokens, block):
    stop = min(start + block, num_tokens)
    ids[start:stop] = rng.integers(0, vocab_size, stop - start, np.int32)
  ids.flush()
  del ids
  return np.memmap(path, np.int32, "r", shape=(num_tokens,))


def measure(batcher, num_batches: int, to_device: bool) -> dict:
  """Batches/s and tokens/s of `batcher.get` (+ device_put when asked)."""
  device = jax.devices()[0]
  num_batches = min(num_batches, len(batcher))
  tokens = batcher.local_batch_size * batcher.seq_len
  batcher.get(0)  # page in nothing more than one window: a fair start
  start = time.perf_counter()
  for i in range(num_batches):
    inputs, targets = batcher.get(i)
    if to_device:
      jax.block_until_ready(jax.device_put((inputs, targets), device))
  seconds = time.perf_counter() - start
  return {"batches_per_s": num_batches / seconds,
          "tokens_per_s": num_batches * tokens / seconds}


def run(num_tokens: int, batch_size: int, seq_len: int, num_batches: int,
        vocab_size: int, step_tokens_per_s: float = 0.0) -> dict:
  """The benchmark; returns {"batcher": ..., "batcher+device_put": ...}."""
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    ids = synthetic_ids(os.path.join(tmp, "ids.bin"), num_tokens, vocab_size)
    print(f"synthetic ids: {num_tokens:,} int32 in "
          f"{time.perf_counter() - start:.1f} s")
    batcher = pipeline.StreamBatcher(ids, batch_size, seq_len)
    results = {}
    for name, to_device in (("batcher", False), ("batcher+device_put", True)):
      results[name] = r = measure(batcher, num_batches, to_device)
      ratio = (f" | {r['tokens_per_s'] / step_tokens_per_s:.1f}x the step"
               if step_tokens_per_s > 0 else "")
      print(f"{name:<20} batch {batch_size}x{seq_len} | "
            f"{r['batches_per_s']:,.0f} batches/s | "
            f"{r['tokens_per_s'] / 1e6:,.1f}M tokens/s{ratio}")
    del batcher, ids  # the memmap must close before the folder goes
  return results
