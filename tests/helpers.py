"""Shared test fixtures: small corpora and tiny trained workdirs."""

import os

import numpy as np

from configs import demo, wt103
from zebra_jax.training import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the cat sat on a mat while the dog ran to the park and the bird sang "
         "in a tree near the old house by the river").split()


def write_wikitext(folder, seed=0):
  """A WikiText-format folder of simple, learnable sentences."""
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  for split, lines in (("train", 400), ("valid", 60), ("test", 60)):
    with open(os.path.join(folder, f"wiki.{split}.tokens"), "w") as f:
      for _ in range(lines):
        start = rng.integers(0, len(WORDS) - 8)
        f.write(" " + " ".join(WORDS[start:start + 8]) + " . \n")
  return folder


def tiny_word_config(data_dir, head=None):
  """wt103.py:tiny (the adaptive head) on `data_dir`. head="full" is for tests
  of mechanics the head does not touch: its compiles take half the time."""
  cfg = wt103.get_config("tiny")
  cfg.data.path = str(data_dir)
  if head is not None:
    cfg.model.head = head
  return cfg


def trained_char_run(tmp_path_factory):
  """demo.py:tiny on a small text file: trained once per session and shared
  by the test modules that need a char-level workdir (same config, path)."""
  base = tmp_path_factory.getbasetemp() / "char_tiny_20_steps"
  cfg = demo.get_config("tiny")
  cfg.data.source, cfg.data.path = "text", str(base / "story.txt")
  cfg.train.eval_every = 1000  # no mid-run eval: the fixture stays fast
  workdir = str(base / "run")
  if not (base / "run" / "checkpoints").is_dir():
    base.mkdir(exist_ok=True)
    (base / "story.txt").write_text("".join(
        f"line {i}: the quick brown fox jumps over the lazy dog.\n"
        for i in range(300)))
    loop.run(cfg, workdir)
  return cfg, workdir
