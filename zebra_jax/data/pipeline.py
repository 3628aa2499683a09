"""Data preparation in one direction: the only reader of `config.data`.

  config.data ─> source (sources/)        fingerprint(), open() -> splits
              ─> tokenizer spec (tokenizers/)  frozen, compared by value
              ─> IdCache (id_cache.py)    workdir/data/*.npy + manifest.json
              ─> batcher (batching.py)    index -> (inputs, targets)

`prepare_data` tokenizes each split once and caches the ids in the workdir:

  workdir/tokenizer/  the tokenizer (tokenizer.zebra.json; BPE adds the HF
                      tokenizer.json), saved with the run
  workdir/data/       {train,valid,test}.npy, manifest.json

A later call whose source and tokenizer fingerprints match the manifest maps
the .npy files and never reads the corpus. Nothing below this module sees the
config: sources and specs are frozen dataclasses filled in here, field by
field, from the `config.data` options of the same names.
"""

import dataclasses
import gc
import os
import sys
import time

from absl import logging
import numpy as np

from zebra_jax.data import batching, id_cache, sources, tokenizers
from zebra_jax.data.batching import (DataPosition, RandomWindowBatcher,
                                     StreamBatcher)
from zebra_jax.data.splits import SPLITS
from zebra_jax.errors import UserError
from zebra_jax import progress

__all__ = ["prepare_data", "load_eval_data", "make_source", "tokenizer_spec",
           "same_corpus", "read_with", "encode_split",
           "make_batcher", "DataPosition", "StreamBatcher",
           "RandomWindowBatcher", "SPLITS"]

_LINE_EVERY_S = 10.0  # progress lines off a terminal while reading a corpus


def _from_options(cls, data_config):
  """`cls` (a frozen dataclass) with each field taken from config.data."""
  return cls(**{f.name: data_config[f.name]
                for f in dataclasses.fields(cls) if f.init})


def make_source(data_config) -> sources.Source:
  """The source `data.source` names, with its options."""
  return _from_options(sources.source_class(data_config.source), data_config)


def tokenizer_spec(data_config):
  """The frozen spec of the tokenizer `data.tokenizer` names."""
  return _from_options(tokenizers.tokenizer_class(data_config.tokenizer).Spec,
                       data_config)


def make_batcher(data_config, ids, seed: int, process_index: int = 0,
                 process_count: int = 1):
  """The batcher `data.batching` names, over one split's ids."""
  return batching.make_batcher(data_config.batching, ids,
                               data_config.batch_size, data_config.seq_len,
                               seed, process_index, process_count)


def prepare_data(config, workdir: str):
  """Tokenizer + ids for every split, built once per workdir and then reused.

  Args:
    config: the full config; reads `config.data`.
    workdir: the run's folder.

  Returns:
    (tokenizer, {"train"|"valid"|"test": int32 [num_tokens]}): read-only
    memory maps of the cached .npy files.
  """
  source = make_source(config.data)
  spec = tokenizer_spec(config.data)
  tokenizer_dir = os.path.join(workdir, "tokenizer")
  cache = id_cache.IdCache(os.path.join(workdir, "data"))
  tokenizer = None
  if tokenizers.has_saved(tokenizer_dir):
    tokenizer = tokenizers.load(tokenizer_dir)
    if tokenizer.spec != spec:
      raise UserError(
          f"workdir {workdir!r} was made with {tokenizer.spec.describe()}, "
          f"but the config asks for {spec.describe()}: use a new --workdir "
          "or the same data settings")

  source_fingerprint = source.fingerprint()  # stats files, reads none
  if tokenizer is not None:
    ids = cache.load(source_fingerprint, tokenizer.fingerprint())
    if ids is not None:
      return tokenizer, ids
    logging.info("no matching token cache in %s: reading the corpus",
                 cache.folder)

  splits = sources.open_splits(source)
  if tokenizer is None:
    start = time.perf_counter()
    tokenizer = _collected_on_error(_build_tokenizer, spec, splits["train"])
    tokenizer.save(tokenizer_dir)
    logging.info("built the %s tokenizer (vocab %d) in %.1f s",
                 tokenizer.kind, tokenizer.vocab_size,
                 time.perf_counter() - start)
  _collected_on_error(cache.write, splits, source_fingerprint, tokenizer)
  ids = cache.load(source_fingerprint, tokenizer.fingerprint())
  if ids is None:
    raise UserError(f"the token cache just written to {cache.folder} does "
                    "not read back: check the disk (space, permissions) and "
                    "rerun")
  return tokenizer, ids


def _build_tokenizer(spec, train):
  """The tokenizer `spec` names, learnt from the train split, with progress
  (WikiText-103's word count reads 0.5 GB: tens of seconds on 2 cores)."""
  with progress.Progress(train.size, desc=f"{spec.kind} vocabulary",
                         unit=train.unit, file=sys.stderr,
                         lines_every_s=_LINE_EVERY_S) as bar:
    def pieces():
      done = 0
      for piece, units in train.read():
        yield piece
        done += units  # counted when the next piece is asked for
        bar.update(done)
    return tokenizers.build(spec, pieces())


def _collected_on_error(fn, *args):
  """fn(*args); a UserError (a bad byte in the corpus) leaves with the
  tokenizer's worker pool already collected.

  main exits with os._exit after the error line, skipping multiprocessing's
  exit hooks: a pool still held by the error's traceback would leave its
  semaphores to the resource tracker, which then warns about them.
  """
  try:
    return fn(*args)
  except UserError as e:
    message = str(e)
  gc.collect()  # the traceback is gone: the pool's reference cycles go too
  raise UserError(message)


def load_eval_data(config, workdir: str):
  """Like `prepare_data`, for eval and sample: the workdir must hold the
  tokenizer the model was trained with, since a rebuilt one could differ."""
  folder = os.path.join(workdir, "tokenizer")
  if not tokenizers.has_saved(folder):
    raise UserError(f"workdir {workdir!r} has no tokenizer ({folder} holds "
                    "none): train first with --mode=train and this "
                    "--workdir")
  return prepare_data(config, workdir)


def same_corpus(data_config, trained_config) -> bool:
  """Whether two data sections name the same text: the sources compare the
  options they read (an embedded corpus has no path to differ in)."""
  return make_source(data_config) == make_source(trained_config)


def read_with(tokenizer, data_config, names) -> dict:
  """{split name: int32 ids} of the corpus `data_config` names, for the
  splits `names`, tokenized by a trained `tokenizer` in memory: the
  workdir's token cache holds the training corpus alone."""
  opened = make_source(data_config).open()
  return {name: encode_split(tokenizer, opened[name]) for name in names}


def encode_split(tokenizer, split) -> np.ndarray:
  """A split's ids, read piece by piece (a split is never one string)."""
  pieces = list(tokenizer.encode_chunks(split.chunks()))
  return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
