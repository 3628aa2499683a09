"""A WikiText-2-like folder of real English, written once, read by both sides.

The text: the embedded corpus's documents (pydoc topics, standard-library
docstrings), then the docstrings of installed packages (numpy, scipy, jax,
torch, sympy; whichever are present) until the corpus holds about
`target_tokens` tokens. Prose paragraphs only (embedded.prose), one a line;
punctuation split from words as WikiText does (" , " and " . "), case kept.
Each document goes to train, valid or test by a hash of its name. The
`vocab_size - 2` most frequent train words are kept and every other word is
written as `<unk>`, so the files carry their own closed vocabulary: PyTorch's
Corpus (which adds every word it reads) and zebra_jax's word tokenizer (train
words, min_freq 1) find the same `vocab_size` words.

The folder is named after what determines its contents (sizes, Python and
package versions) and reused when it exists: the docstrings take ~1 min to
parse on a loaded 2-core machine.
"""

import collections
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import zlib

from zebra_jax.data.sources import embedded

PACKAGES = ("numpy", "scipy", "jax", "torch", "sympy")
SPLIT_FILES = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens",
               "test": "wiki.test.tokens"}
_TOKEN = re.compile(r"\w+|[^\w\s]")
_HELD_OUT = 0.05  # valid's share and test's share of the documents


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _manifest(target_tokens: int, vocab_size: int) -> dict:
  return {"target_tokens": target_tokens, "vocab_size": vocab_size,
          "python": sys.version.split()[0], "format": 1,
          "packages": {p: _version(p) for p in PACKAGES}}


def _package_documents(package: str) -> list[tuple[str, str]]:
  root = os.path.join(sysconfig.get_paths()["purelib"], package)
  if not os.path.isdir(root):
    return []
  return [(f"{package}:{name}", embedded.prose(text))
          for name, text in embedded._docstring_documents(root)]  # pylint: disable=protected-access


def _documents():
  """(name, text) in a fixed order: the embedded corpus, then packages."""
  yield from embedded.embedded_documents()
  for package in PACKAGES:
    yield from _package_documents(package)


def tokenized_lines(text: str) -> list[list[str]]:
  """A document's paragraphs -> lines of WikiText-style tokens."""
  return [_TOKEN.findall(line) for line in text.split("\n") if line.strip()]


def split_of(name: str) -> str:
  u = zlib.crc32(name.encode()) / 2**32
  return "test" if u < _HELD_OUT else "valid" if u < 2 * _HELD_OUT else "train"


def build(folder: str, target_tokens: int, vocab_size: int) -> dict:
  """Writes the three files into folder; returns the manifest with counts."""
  lines = {split: [] for split in SPLIT_FILES}
  total = 0
  for name, text in _documents():
    if total >= target_tokens:
      break
    doc = tokenized_lines(text)
    lines[split_of(name)].extend(doc)
    total += sum(len(line) + 1 for line in doc)  # + <eos>
  counts = collections.Counter(w for line in lines["train"] for w in line)
  keep = {w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
          [:vocab_size - 2]}  # with <unk> and <eos>
  os.makedirs(folder, exist_ok=True)
  tokens = {}
  for split, file in SPLIT_FILES.items():
    with open(os.path.join(folder, file), "w", encoding="utf-8") as f:
      for line in lines[split]:
        f.write(" " + " ".join(w if w in keep else "<unk>" for w in line)
                + " \n")
    tokens[split] = sum(len(line) + 1 for line in lines[split])
  manifest = {**_manifest(target_tokens, vocab_size), "tokens": tokens,
              "words_kept": len(keep)}
  with open(os.path.join(folder, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return manifest


def prepare(target_tokens: int, vocab_size: int,
            parent: str | None = None) -> tuple[str, dict]:
  """(folder, manifest): the corpus for these sizes, built if missing."""
  key = hashlib.sha256(json.dumps(_manifest(target_tokens, vocab_size),
                                  sort_keys=True).encode()).hexdigest()[:12]
  folder = os.path.join(parent or tempfile.gettempdir(), f"zebra_wlm_{key}")
  try:
    with open(os.path.join(folder, "manifest.json")) as f:
      return folder, json.load(f)
  except (OSError, ValueError):
    pass
  building = f"{folder}.{os.getpid()}.tmp"
  manifest = build(building, target_tokens, vocab_size)
  try:
    os.replace(building, folder)
  except OSError:  # another process built it first
    shutil.rmtree(building, ignore_errors=True)
  return folder, manifest
