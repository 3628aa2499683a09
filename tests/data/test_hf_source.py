"""data.source=hf, offline: small local datasets written by the tests, never
the network. Rows are lines, as in Salesforce/wikitext."""

import builtins
import json
import os

import ml_collections
import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from zebra_jax.data import pipeline, sources  # pylint: disable=g-import-not-at-top
from zebra_jax.data.splits import SPLITS  # pylint: disable=g-import-not-at-top
from zebra_jax.errors import UserError

# WikiText rows: non-empty lines keep their "\n", blank lines are "".
ROWS = {"train": ["", " = Title = \n", "", " the cat sat <unk> \n",
                  " the cat \n"],
        "validation": ["", " the dog \n"],
        "test": [" a cat \n"]}
TEXTS = {"train": "\n = Title = \n\n the cat sat <unk> \n the cat \n",
         "valid": "\n the dog \n", "test": " a cat \n"}


def hf_config(path="", **overrides) -> ml_collections.ConfigDict:
  d = dict(source="hf", path=str(path), hf_name="Salesforce/wikitext",
           hf_config="wikitext-103-v1", hf_cache_dir="", tokenizer="word",
           min_freq=1, max_vocab_size=0, valid_fraction=0.05,
           test_fraction=0.05)
  d.update(overrides)
  return ml_collections.ConfigDict(d)


def load_splits(data_config) -> dict[str, str]:
  return sources.load_splits(pipeline.make_source(data_config))


def source_fingerprint(data_config) -> str:
  return pipeline.make_source(data_config).fingerprint()


def write_parquet(folder, subfolder="wikitext-103-v1"):
  """The hub repo's layout: <config>/<split>-00000-of-00001.parquet."""
  target = folder / subfolder if subfolder else folder
  target.mkdir(parents=True)
  for split, rows in ROWS.items():
    datasets.Dataset.from_dict({"text": rows}).to_parquet(
        str(target / f"{split}-00000-of-00001.parquet"))
  return folder


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.mark.parametrize("subfolder", ["wikitext-103-v1", ""])
def test_local_parquet_rows_become_lines(tmp_path, subfolder):
  path = write_parquet(tmp_path / "wt", subfolder)
  config = hf_config(path, hf_cache_dir=str(tmp_path / "cache"))
  assert load_splits(config) == TEXTS
  assert pipeline.make_source(config).open()["train"].unit == "rows"


def test_save_to_disk_folder(tmp_path):
  dd = datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v})
                             for k, v in ROWS.items()})
  dd.save_to_disk(str(tmp_path / "saved"))
  assert load_splits(hf_config(tmp_path / "saved")) == TEXTS


def test_matches_the_wikitext_folder_token_for_token(tmp_path):
  """HF rows and wiki.*.tokens files give the same word ids."""
  path = write_parquet(tmp_path / "hf")
  folder = tmp_path / "wt"
  folder.mkdir()
  names = {"train": "train", "valid": "validation", "test": "test"}
  for ours, theirs in names.items():  # files keep " \n" for blank lines
    text = "".join(r if r else " \n" for r in ROWS[theirs])
    (folder / f"wiki.{ours}.tokens").write_text(text, encoding="utf-8")
  wt = ml_collections.ConfigDict(dict(data=dict(
      hf_config(folder, source="wikitext"))))
  hf = ml_collections.ConfigDict(dict(data=dict(hf_config(path))))
  tok_a, ids_a = pipeline.prepare_data(wt, str(tmp_path / "run_a"))
  tok_b, ids_b = pipeline.prepare_data(hf, str(tmp_path / "run_b"))
  assert tok_a == tok_b
  for name in SPLITS:
    np.testing.assert_array_equal(ids_a[name], ids_b[name])
  assert ids_b["train"][-3:].tolist() == [tok_b.token_to_id["the"],
                                          tok_b.token_to_id["cat"],
                                          tok_b.eos_id]
  # Reuse: the fingerprint the id cache recorded when it tokenized equals
  # one taken afresh from the parquet files' stats, so a rerun maps its ids.
  manifest = json.loads((tmp_path / "run_b" / "data" / "manifest.json")
                        .read_text())
  assert manifest["source_fingerprint"] == source_fingerprint(hf.data)


def test_fingerprint_tracks_config_and_files(tmp_path):
  path = write_parquet(tmp_path / "wt")
  before = source_fingerprint(hf_config(path))
  assert before != source_fingerprint(
      hf_config(path, hf_config="wikitext-2-v1"))
  assert (source_fingerprint(hf_config())
          != source_fingerprint(hf_config(hf_config="wikitext-2-v1")))
  datasets.Dataset.from_dict({"text": ["changed\n"] * 3}).to_parquet(
      str(path / "wikitext-103-v1" / "test-00000-of-00001.parquet"))
  assert source_fingerprint(hf_config(path)) != before


def test_unreachable_hub_names_offline_alternatives(monkeypatch):
  def no_network(*args, **kwargs):
    raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub "
                          "(LocalEntryNotFoundError)")

  monkeypatch.setattr(datasets, "load_dataset", no_network)
  with pytest.raises(UserError) as info:
    load_splits(hf_config())
  message = str(info.value)
  for hint in ("Couldn't reach", "HF_HUB_OFFLINE=1", "hf_cache_dir",
               "data.source=wikitext", "data.path"):
    assert hint in message, hint
  assert "\n" not in message


def test_hub_call_passes_name_config_and_cache(monkeypatch, tmp_path):
  calls = []

  def fake_load(name, config, cache_dir=None):
    calls.append((name, config, cache_dir))
    return datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v})
                                 for k, v in ROWS.items()})

  monkeypatch.setattr(datasets, "load_dataset", fake_load)
  config = hf_config(hf_config="wikitext-2-raw-v1",
                     hf_cache_dir=str(tmp_path / "c"))
  assert load_splits(config) == TEXTS
  assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1",
                    str(tmp_path / "c"))]


def test_bad_local_folders(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match="holds no dataset.*train-\\*.parquet"):
    load_splits(hf_config(tmp_path / "empty"))
  with pytest.raises(UserError, match="is not a folder"):
    load_splits(hf_config(tmp_path / "missing"))
  target = tmp_path / "cols" / "wikitext-103-v1"
  target.mkdir(parents=True)
  for split in ROWS:
    datasets.Dataset.from_dict({"body": ["x\n"]}).to_parquet(
        str(target / f"{split}-0.parquet"))
  with pytest.raises(UserError, match="columns \\['body'\\], not 'text'"):
    load_splits(hf_config(tmp_path / "cols"))


def test_missing_datasets_package_says_what_to_install(monkeypatch):
  real_import = builtins.__import__

  def no_datasets(name, *args, **kwargs):
    if name == "datasets":
      raise ImportError("No module named 'datasets'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_datasets)
  with pytest.raises(UserError, match=r"pip install 'zebra_jax\[data\]'"):
    load_splits(hf_config())
  assert os.environ["HF_HUB_OFFLINE"] == "1"
