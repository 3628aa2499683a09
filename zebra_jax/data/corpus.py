"""Where the text comes from: four sources, each cut into train/valid/test.

`open_splits(config.data)` gives {"train", "valid", "test"} -> a `Split` that
streams the split's text in pieces of a few MB (WikiText-103's 540 MB train
split is never one Python string); `load_splits` joins them for small corpora.
Tokenizing and caching ids happen later (data.py); this module only reads
text and decides which text lands in which split.

  embedded  English documentation that ships with every Python install: the
            pydoc topics plus standard-library docstrings (~2 MB). It needs no
            network, so the quickstart and the tests always have a corpus.
  wikitext  a folder in the WikiText layout (wiki.{train,valid,test}.tokens).
  text      your own files; the last lines become valid and test.
  hf        a Hugging Face `datasets` dataset, one row per line: the hub
            (default Salesforce/wikitext) or a local parquet/arrow folder
            (hf_source.py holds that part).
"""

import ast
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import textwrap
import time
from typing import Callable, Iterator
import zlib

from absl import logging

from zebra_jax.errors import UserError

SPLITS = ("train", "valid", "test")

# Bump when the embedded corpus text changes, so old caches are not reused.
_EMBEDDED_FORMAT = 1
_MIN_DOCSTRING_CHARS = 40  # shorter ones are mostly "Return self." noise
# Stdlib folders that hold tests, GUIs or vendored code rather than prose.
_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
    "lib2to3", "ensurepip", "turtledemo", "tkinter", "__pycache__",
    "pydoc_data", "__phello__", "venv",
})
_WIKITEXT_SUFFIXES = (".tokens", ".raw")
# Bytes read per piece: big enough that str.split and numpy amortise their
# call overhead, small enough that a worker's copy stays far below 1 GB.
CHUNK_BYTES = 1 << 23


@dataclasses.dataclass(frozen=True)
class Split:
  """One split's text, read in pieces on demand (every read starts afresh).

  Pieces are consecutive: joined they give the split's text, and every piece
  but the last ends with "\\n", so no line is ever cut in two.
  `size` counts `unit`s ("B", "rows" or "chars"); it only drives progress.
  """

  name: str
  size: int
  unit: str
  read: Callable[[], Iterator[tuple[str, int]]]  # yields (piece, units)

  def chunks(self) -> Iterator[str]:
    for piece, _ in self.read():
      yield piece

  def text(self) -> str:
    return "".join(self.chunks())

  def is_blank(self) -> bool:
    """True when the split holds only whitespace; stops at the first word."""
    return not any(piece.strip() for piece in self.chunks())


def in_memory_split(name: str, text: str) -> Split:
  """A Split over a str already in memory (embedded, text, tests)."""
  def read():
    start = 0
    while start < len(text):
      stop = text.find("\n", start + CHUNK_BYTES) + 1 or len(text)
      yield text[start:stop], stop - start
      start = stop
  return Split(name, len(text), "chars", read)


def load_splits(data_config) -> dict[str, str]:
  """Reads the corpus named by `data_config.source` and splits it.

  Args:
    data_config: `config.data` (source, path, valid_fraction, test_fraction;
      hf_name, hf_config, hf_cache_dir for source=hf).

  Returns:
    {"train": str, "valid": str, "test": str}. Train is never empty.
  """
  return {name: split.text()
          for name, split in open_splits(data_config).items()}


def open_splits(data_config) -> dict[str, Split]:
  """Like `load_splits`, but streamed: {"train"|"valid"|"test": Split}."""
  _check_fractions(data_config)
  if data_config.source not in _LOADERS:
    raise UserError(
        f"data.source {data_config.source!r} is unknown: set "
        f"--config.data.source to one of {', '.join(_LOADERS)}")
  splits = _LOADERS[data_config.source](data_config)
  if splits["train"].is_blank():
    raise UserError(
        f"the train split of data.source={data_config.source!r} "
        f"(path {data_config.path!r}) is empty: point --config.data.path at "
        "files holding text, or lower data.valid_fraction/test_fraction")
  return splits


def source_fingerprint(data_config) -> str:
  """A short hash that changes whenever the text `load_splits` gives may change.

  Cheap: it stats files (size, mtime) instead of reading them, so data.py can
  decide to reuse cached ids without touching the corpus.
  """
  desc = {"source": data_config.source,
          "valid_fraction": float(data_config.valid_fraction),
          "test_fraction": float(data_config.test_fraction)}
  if data_config.source == "embedded":
    desc.update(python=sys.version, stdlib=_stdlib_dir(),
                format=_EMBEDDED_FORMAT)
  elif data_config.source == "hf":
    from zebra_jax.data import hf_source  # pylint: disable=g-import-not-at-top
    desc.update(hf_source.describe(data_config))
  else:
    desc["path"] = data_config.path
    files = (_wikitext_files(data_config.path)
             if data_config.source == "wikitext"
             else _text_files(data_config.path))
    desc["files"] = file_stats(files)
  blob = json.dumps(desc, sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


def file_stats(files) -> list:
  """[abspath, size, mtime_ns] per file: what a fingerprint needs to notice
  an edit without reading the file."""
  return [[os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns]
          for f in files]


# ----------------------------------------------------------------- embedded


def embedded_documents() -> list[tuple[str, str]]:
  """(name, text) per document: one per pydoc topic, one per stdlib module.

  Parsing ~560 stdlib files with `ast` takes ~4 s, so the result is cached in
  ~/.cache/zebra_jax/ (keyed by the Python build); later calls take ~50 ms.
  Modules are parsed, never imported: importing would run their code.
  """
  cache = _embedded_cache_path()
  try:
    with open(cache, encoding="utf-8") as f:
      return [tuple(doc) for doc in json.load(f)]
  except (OSError, ValueError):
    pass  # No cache yet (or a broken one): build it.
  start = time.perf_counter()
  documents = _topic_documents() + _docstring_documents(_stdlib_dir())
  logging.info("built the embedded corpus (%d documents) in %.1f s",
               len(documents), time.perf_counter() - start)
  try:  # The cache is an optimisation: a read-only home must still work.
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    tmp = f"{cache}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(documents, f)
    os.replace(tmp, cache)
  except OSError as e:
    logging.warning("could not cache the embedded corpus at %s: %s", cache, e)
  return documents


def _load_embedded(data_config) -> dict[str, Split]:
  """Assigns whole documents to splits by a hash of their name.

  The hash (crc32) is stable across runs and machines, so a document never
  moves between train and test, and adding a module only affects its own.
  """
  parts = {name: [] for name in SPLITS}
  for name, text in embedded_documents():
    u = zlib.crc32(name.encode()) / 2**32  # uniform in [0, 1)
    if u < data_config.test_fraction:
      parts["test"].append(text)
    elif u < data_config.test_fraction + data_config.valid_fraction:
      parts["valid"].append(text)
    else:
      parts["train"].append(text)
  # A blank line between documents, and every split ends with a newline.
  return {name: in_memory_split(name, "".join(doc + "\n\n" for doc in docs))
          for name, docs in parts.items()}


def _topic_documents() -> list[tuple[str, str]]:
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  return [(f"topic:{key}", topics[key].strip()) for key in sorted(topics)]


def _docstring_documents(root: str) -> list[tuple[str, str]]:
  """One document per module: its module, class and function docstrings."""
  documents = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs
                     if d not in _SKIP_DIRS and not d.startswith("config-"))
    for file in sorted(files):
      if not file.endswith(".py") or file.startswith("test_"):
        continue
      path = os.path.join(folder, file)
      try:
        with open(path, "rb") as f:
          tree = ast.parse(f.read(), filename=path)
      except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        continue  # e.g. files written for another Python version
      docs = []
      for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
          doc = ast.get_docstring(node, clean=True)  # clean = dedent
          if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
            docs.append(textwrap.dedent(doc).strip())
      if docs:
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        documents.append((f"module:{module}", "\n\n".join(docs)))
  return documents


def _stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _embedded_cache_path() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  key = hashlib.sha256(
      f"{sys.version}|{_stdlib_dir()}|{_EMBEDDED_FORMAT}".encode()
  ).hexdigest()[:12]
  version = "py{}.{}.{}".format(*sys.version_info[:3])
  return os.path.join(base, "zebra_jax", f"embedded-{version}-{key}.json")


# ----------------------------------------------------------------- wikitext


def _load_wikitext(data_config) -> dict[str, Split]:
  files = _wikitext_files(data_config.path)
  return {name: file_split(name, path) for name, path in zip(SPLITS, files)}


def file_split(name: str, path: str) -> Split:
  """Streams a UTF-8 file in pieces cut after a "\\n" ("\\r\\n" -> "\\n")."""
  def read():
    offset, carry = 0, b""  # carry: the bytes after the last "\n" so far
    with open(path, "rb") as f:
      while True:
        block = f.read(CHUNK_BYTES)
        data = carry + block
        if not block:  # end of file: the rest, maybe without a final "\n"
          if data:
            yield _decode(data, path, offset), len(data)
          return
        cut = data.rfind(b"\n") + 1  # 0: a line longer than a block so far
        piece, carry = data[:cut], data[cut:]
        if piece:
          yield _decode(piece, path, offset), len(piece)
          offset += len(piece)
  return Split(name, os.path.getsize(path), "B", read)


def _wikitext_files(folder: str) -> list[str]:
  """[train, valid, test] paths; .tokens preferred, .raw accepted."""
  if not folder or not os.path.isdir(folder):
    raise UserError(
        f"data.path {folder!r} is not a folder: set --config.data.path to a "
        "folder holding wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens")
  files = []
  for split in SPLITS:
    candidates = [os.path.join(folder, f"wiki.{split}{suffix}")
                  for suffix in _WIKITEXT_SUFFIXES]
    found = [c for c in candidates if os.path.isfile(c)]
    if not found:
      raise UserError(
          f"{candidates[0]} is missing: data.path must hold "
          f"wiki.{split}.tokens (or wiki.{split}.raw); download WikiText or "
          "fix --config.data.path")
    files.append(found[0])
  return files


# ----------------------------------------------------------------- text


def _load_text(data_config) -> dict[str, Split]:
  """Concatenates the files and cuts at line boundaries: train | valid | test.

  Valid and test are the last lines (contiguous), so no sentence of the
  held-out text is interleaved with training text.
  """
  lines = []
  for path in _text_files(data_config.path):
    lines.extend(_split_lines(_read_utf8(path)))
  n = len(lines)
  n_test = _held_out_lines(n, data_config.test_fraction)
  n_valid = _held_out_lines(n, data_config.valid_fraction)
  n_train = max(n - n_valid - n_test, 0)
  chunks = {"train": lines[:n_train],
            "valid": lines[n_train:n_train + n_valid],
            "test": lines[n_train + n_valid:]}
  return {name: in_memory_split(name, "".join(line + "\n" for line in chunk))
          for name, chunk in chunks.items()}


def _held_out_lines(num_lines: int, fraction: float) -> int:
  """round(n * fraction), but at least one line when asked for any."""
  if fraction <= 0 or num_lines < 3:
    return 0
  return max(1, round(num_lines * fraction))


def _split_lines(text: str) -> list[str]:
  """Lines as a file iterator sees them: on "\\n" only, no trailing empty."""
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return lines


def _text_files(path: str) -> list[str]:
  """A file, a folder (its *.txt, sorted) or a comma-separated list of files."""
  fix = ("set --config.data.path to a text file, a folder of .txt files or "
         "a comma-separated list of files")
  if not path:
    raise UserError(f"data.path is empty for data.source='text': {fix}")
  if os.path.isdir(path):
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if f.endswith(".txt")
                   and os.path.isfile(os.path.join(path, f)))
    if not files:
      raise UserError(f"data.path folder {path!r} holds no .txt files: {fix}")
    return files
  files = [p.strip() for p in path.split(",") if p.strip()]
  for f in files:
    if not os.path.isfile(f):
      raise UserError(f"data.path file {f!r} does not exist: {fix}")
  return files


# ----------------------------------------------------------------- helpers


def _read_utf8(path: str) -> str:
  """Reads a whole file as UTF-8, with "\\r\\n" turned into "\\n"."""
  with open(path, "rb") as f:
    return _decode(f.read(), path, 0)


def _decode(raw: bytes, path: str, offset: int) -> str:
  """UTF-8 bytes at `offset` of `path` -> str, BOM dropped, "\\r\\n" -> "\\n"."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(
        f"{path} is not UTF-8 (bad byte 0x{raw[e.start]:02x} at byte offset "
        f"{offset + e.start}): convert it, e.g. iconv -f latin1 -t utf-8 "
        f"{path} > out.txt") from None
  if offset == 0:
    text = text.removeprefix("\ufeff")
  return text.replace("\r\n", "\n")


def _check_fractions(data_config) -> None:
  valid, test = data_config.valid_fraction, data_config.test_fraction
  if not (0 <= valid < 1 and 0 <= test < 1 and valid + test < 1):
    raise UserError(
        f"data.valid_fraction={valid} and data.test_fraction={test} must each "
        "be in [0, 1) and sum to less than 1: fix them in the config")


def _load_hf(data_config) -> dict[str, Split]:
  from zebra_jax.data import hf_source  # pylint: disable=g-import-not-at-top
  return hf_source.load(data_config)


_LOADERS = {"embedded": _load_embedded, "wikitext": _load_wikitext,
            "text": _load_text, "hf": _load_hf}
