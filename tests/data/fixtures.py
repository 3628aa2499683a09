"""Small corpora in the layouts the data sources read, for the tests and
for docs/data.md's examples.

  python -c "from tests.data.fixtures import write_hub_cache; write_hub_cache('/tmp/hf_home')"

writes what huggingface_hub leaves in HF_HOME/hub after downloading
Salesforce/wikitext's wikitext-2-raw-v1 files, with 400/60/60 rows of
simple sentences instead of WikiText's.
"""

import os

import numpy as np

WORDS = ("the cat sat on a mat while the dog ran to the park and the bird "
         "sang in a tree near the old house by the river").split()
# A revision as the hub names them: refs/main holds it, snapshots/ a folder.
REVISION = "b08601e04326c79dfdd32d625aee71d232d685c3"


def sentences(count: int, seed: int) -> list[str]:
  """Learnable lines: 8 consecutive words of WORDS, the first capitalised
  (prompts such as demo's "The " then use only characters seen), and a
  full stop."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(WORDS) - 8, size=count)
  return [" ".join(WORDS[s:s + 8]).capitalize() + " ." for s in starts]


def wikitext_rows() -> dict[str, list[str]]:
  """{hub split: rows}, rows as Salesforce/wikitext has them: " line \\n"."""
  return {split: [f" {line} \n" for line in sentences(count, seed)]
          for seed, (split, count) in enumerate(
              (("train", 400), ("validation", 60), ("test", 60)))}


def write_hub_cache(hf_home, rows=None, configs=("wikitext-2-raw-v1",),
                    repo="Salesforce/wikitext") -> str:
  """HF_HOME/hub/datasets--ORG--NAME/{refs/main, snapshots/REVISION/
  CONFIG/SPLIT-00000-of-00001.parquet}; returns hf_home."""
  import datasets  # pylint: disable=g-import-not-at-top
  folder = os.path.join(str(hf_home), "hub",
                        "datasets--" + repo.replace("/", "--"))
  os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
  with open(os.path.join(folder, "refs", "main"), "w") as f:
    f.write(REVISION)
  for config in configs:
    target = os.path.join(folder, "snapshots", REVISION, config)
    os.makedirs(target, exist_ok=True)
    for split, split_rows in (rows or wikitext_rows()).items():
      datasets.Dataset.from_dict({"text": split_rows}).to_parquet(
          os.path.join(target, f"{split}-00000-of-00001.parquet"))
  return str(hf_home)
