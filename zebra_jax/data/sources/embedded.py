"""`data.source=embedded`: English documentation that ships with every Python.

The pydoc topics plus standard-library docstrings, kept to their prose
(~1.3 MB). It needs no network, so the quickstart and the tests always have a
corpus.

Only prose paragraphs are kept, each on one line with single spaces: code
blocks, doctests, grammar productions, tables and headings go. Left in, their
indentation taught a small character model that runs of spaces are the most
likely text, and its samples were mostly blank.
"""

import ast
import dataclasses
import hashlib
import json
import os
import re
import sys
import sysconfig
import textwrap
import time
from typing import ClassVar
import zlib

from absl import logging

from zebra_jax.data import splits as splits_lib

# Bump when the embedded corpus text changes, so old caches are not reused.
_FORMAT = 2
_RULE = re.compile(r"^[\s*=~\-^#+]+$")  # reST heading underlines
_MIN_PARAGRAPH_WORDS = 6  # shorter paragraphs are names and signatures
_MIN_LETTER_SHARE = 0.85  # below it: option tables, lists of symbols
_MIN_DOCSTRING_CHARS = 40  # shorter ones are mostly "Return self." noise
# Stdlib folders that hold tests, GUIs or vendored code rather than prose.
_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
    "lib2to3", "ensurepip", "turtledemo", "tkinter", "__pycache__",
    "pydoc_data", "__phello__", "venv",
})


@dataclasses.dataclass(frozen=True)
class EmbeddedSource:
  """Whole documents assigned to splits by a hash of their name."""

  name: ClassVar[str] = "embedded"
  needs_path: ClassVar[bool] = False

  valid_fraction: float
  test_fraction: float

  def fingerprint(self) -> str:
    return splits_lib.fingerprint({
        "source": self.name, "valid_fraction": float(self.valid_fraction),
        "test_fraction": float(self.test_fraction), "python": sys.version,
        "stdlib": _stdlib_dir(), "format": _FORMAT})

  def open(self) -> dict[str, splits_lib.Split]:
    """The hash (crc32) is stable across runs and machines, so a document
    never moves between train and test, and adding a module only affects
    its own."""
    splits_lib.check_fractions(self.valid_fraction, self.test_fraction)
    parts = {name: [] for name in splits_lib.SPLITS}
    for name, text in embedded_documents():
      u = zlib.crc32(name.encode()) / 2**32  # uniform in [0, 1)
      if u < self.test_fraction:
        parts["test"].append(text)
      elif u < self.test_fraction + self.valid_fraction:
        parts["valid"].append(text)
      else:
        parts["train"].append(text)
    # A blank line between documents, and every split ends with a newline.
    return {name: splits_lib.in_memory_split(
        name, "".join(doc + "\n\n" for doc in docs))
            for name, docs in parts.items()}


def embedded_documents() -> list[tuple[str, str]]:
  """(name, text) per document: one per pydoc topic, one per stdlib module.

  Parsing the stdlib's files with `ast` takes seconds, so the result is
  cached in ~/.cache/zebra_jax/ (keyed by the Python build); later calls
  only read it.
  Modules are parsed, never imported: importing would run their code.
  """
  cache = _cache_path()
  try:
    with open(cache, encoding="utf-8") as f:
      return [tuple(doc) for doc in json.load(f)]
  except (OSError, ValueError):
    pass  # No cache yet (or a broken one): build it.
  start = time.perf_counter()
  documents = [(name, prose(text)) for name, text in
               _topic_documents() + _docstring_documents(_stdlib_dir())]
  documents = [(name, text) for name, text in documents if text]
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


def prose(text: str) -> str:
  """The prose paragraphs of a docstring or help topic, one line each.

  A paragraph with an indented line (code, grammar, a table, quoted output),
  a heading rule or a doctest is dropped, and so is one that is mostly not
  letters; the rest are unwrapped and their space runs collapsed.
  """
  keep = []
  for paragraph in re.split(r"\n\s*\n", text):
    lines = [line for line in paragraph.split("\n") if line.strip()]
    if not lines or any(line[:1].isspace() for line in lines):
      continue
    if (any(_RULE.match(line) for line in lines) or ">>>" in paragraph
        or "::=" in paragraph):
      continue
    words = " ".join(lines).split()
    flat = " ".join(words)
    letters = sum(ch.isalpha() or ch == " " for ch in flat)
    if len(words) >= _MIN_PARAGRAPH_WORDS and (
        letters >= _MIN_LETTER_SHARE * len(flat)):
      keep.append(flat)
  return "\n\n".join(keep)


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


def _cache_path() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  key = hashlib.sha256(
      f"{sys.version}|{_stdlib_dir()}|{_FORMAT}".encode()).hexdigest()[:12]
  version = "py{}.{}.{}".format(*sys.version_info[:3])
  return os.path.join(base, "zebra_jax", f"embedded-{version}-{key}.json")
