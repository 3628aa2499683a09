"""data.source=hf, offline: small local datasets written by the tests, never
the network (an unreachable endpoint at most). Rows are lines, as in
Salesforce/wikitext."""

import builtins
import json
import logging
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from huggingface_hub import constants as hub_constants  # pylint: disable=g-import-not-at-top
from zebra_jax.data import pipeline, sources  # pylint: disable=g-import-not-at-top
from zebra_jax.data.splits import SPLITS  # pylint: disable=g-import-not-at-top
from zebra_jax.errors import UserError
from tests.data import fixtures
from tests.helpers import REPO

# An endpoint nothing listens on: connections are refused at once.
UNREACHABLE = "http://127.0.0.1:9"

# WikiText rows: non-empty lines keep their "\n", blank lines are "".
ROWS = {"train": ["", " = Title = \n", "", " the cat sat <unk> \n",
                  " the cat \n"],
        "validation": ["", " the dog \n"],
        "test": [" a cat \n"]}
TEXTS = {"train": "\n = Title = \n\n the cat sat <unk> \n the cat \n",
         "valid": "\n the dog \n", "test": " a cat \n"}


def hf_config(path="", **overrides) -> ml_collections.ConfigDict:
  d = dict(source="hf", path=str(path), hf_name="Salesforce/wikitext",
           hf_config="wikitext-103-v1", hf_cache_dir="",
           hf_text_column="text", tokenizer="word", min_freq=1,
           max_vocab_size=0, valid_fraction=0.05, test_fraction=0.05)
  d.update(overrides)
  return ml_collections.ConfigDict(d)


def load_splits(data_config) -> dict[str, str]:
  return sources.load_splits(pipeline.make_source(data_config))


def source_fingerprint(data_config) -> str:
  return pipeline.make_source(data_config).fingerprint()


def write_parquet(folder, subfolder="wikitext-103-v1", rows=None,
                  column="text"):
  """The hub repo's layout: <config>/<split>-00000-of-00001.parquet."""
  target = folder / subfolder if subfolder else folder
  target.mkdir(parents=True)
  for split, split_rows in (rows or ROWS).items():
    datasets.Dataset.from_dict({column: split_rows}).to_parquet(
        str(target / f"{split}-00000-of-00001.parquet"))
  return folder


def write_hub_cache(hf_home, configs=("wikitext-103-v1",)):
  """What huggingface_hub leaves of Salesforce/wikitext in HF_HOME/hub."""
  return fixtures.write_hub_cache(hf_home, ROWS, configs)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
  """Offline as HF_HUB_OFFLINE=1 makes it, in this process too (the hub
  reads the variable once, at import), with an empty hub cache."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
  monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


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
  with pytest.raises(UserError, match="columns \\['body'\\], not 'text': "
                     "set --config.data.hf_text_column"):
    load_splits(hf_config(tmp_path / "cols"))
  assert load_splits(hf_config(tmp_path / "cols", hf_text_column="body")
                     )["test"] == "x\n"


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


def _load_in_child(env: dict, hf_home) -> subprocess.CompletedProcess:
  """Loads the default hub dataset in a fresh process, whose hub library
  reads HF_HUB_OFFLINE / HF_ENDPOINT / HF_HOME as a user's would; prints
  the splits and the seconds the load took."""
  code = ("import json, time; from tests.data.test_hf_source import "
          "hf_config, load_splits; t = time.perf_counter(); "
          "splits = load_splits(hf_config()); "
          "print(json.dumps([splits, time.perf_counter() - t]))")
  child_env = {k: v for k, v in os.environ.items()
               if not k.startswith("HF_")}
  child_env.update(HF_HOME=str(hf_home), **env)
  return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env, said", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1: reading the hub cache's"),
    ({"HF_ENDPOINT": UNREACHABLE}, "the hub is unreachable (Connection"),
], ids=["HF_HUB_OFFLINE", "no-network"])
def test_a_dataset_only_in_the_hub_cache_loads_offline(tmp_path, env, said):
  hf_home = write_hub_cache(tmp_path / "home")
  out = _load_in_child(env, hf_home)
  assert out.returncode == 0, out.stderr
  splits, seconds = json.loads(out.stdout.strip().splitlines()[-1])
  assert splits == TEXTS
  assert seconds < 5, seconds
  assert said in out.stderr
  assert "Retry" not in out.stderr, out.stderr


def test_no_network_and_no_copy_is_one_fast_line(tmp_path):
  """No retries: one error line naming the offline alternatives."""
  out = subprocess.run(
      [sys.executable, "-m", "zebra_jax.main", "--config=demo:tiny",
       f"--workdir={tmp_path / 'run'}", "--config.data.source=hf"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
           "HF_HOME": str(tmp_path / "empty"), "HF_ENDPOINT": UNREACHABLE})
  assert out.returncode == 2, out.stderr
  assert "Traceback" not in out.stderr and "Retry" not in out.stderr
  (line,) = out.stderr.strip().splitlines()
  assert line.startswith(f"error: could not load 'Salesforce/wikitext' "
                         f"(wikitext-2-raw-v1): the Hugging Face hub at "
                         f"{UNREACHABLE} is unreachable")
  for hint in ("holds no copy of 'Salesforce/wikitext'", "HF_HUB_OFFLINE=1",
               "--config.data.path"):
    assert hint in line, hint


def test_unreachable_hub_names_the_configs_the_cache_holds(monkeypatch,
                                                           tmp_path):
  write_hub_cache(tmp_path, configs=("wikitext-2-raw-v1", "wikitext-2-v1"))
  monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(hub_constants, "ENDPOINT", UNREACHABLE)
  with pytest.raises(UserError, match="the hub cache holds configs "
                     "wikitext-2-raw-v1, wikitext-2-v1 of 'Salesforce/"
                     "wikitext', not 'wikitext-103-v1'"):
    load_splits(hf_config())
  assert load_splits(hf_config(hf_config="wikitext-2-v1")) == TEXTS


def test_datasets_list_of_cached_configs_is_kept_whole(monkeypatch):
  def not_cached(*args, **kwargs):
    raise ValueError("Couldn't find cache for Salesforce/wikitext for config "
                     "'wikitext-103-v1'\nAvailable configs in the cache: "
                     "['wikitext-2-raw-v1', 'wikitext-2-v1']")

  monkeypatch.setattr(datasets, "load_dataset", not_cached)
  with pytest.raises(UserError) as info:
    load_splits(hf_config())
  message = str(info.value)
  assert ("Available configs in the cache: ['wikitext-2-raw-v1', "
          "'wikitext-2-v1']") in message
  assert "\n" not in message


def test_a_missing_split_is_held_out_of_train_with_a_line(tmp_path, caplog):
  train = [f" line {i} \n" for i in range(40)]
  path = write_parquet(tmp_path / "d", "", rows={"train": train,
                                                 "test": [" a cat \n"]})
  with caplog.at_level(logging.WARNING):
    splits = load_splits(hf_config(path, valid_fraction=0.1))
  assert splits == {"train": "".join(train[:36]),
                    "valid": "".join(train[36:]), "test": " a cat \n"}
  assert ("has no valid split: holding out the last 4 rows as valid of its "
          "40 train rows") in caplog.text
  only_train = write_parquet(tmp_path / "t", "", rows={"train": train})
  splits = load_splits(hf_config(only_train, valid_fraction=0.1,
                                 test_fraction=0.05))
  assert splits == {"train": "".join(train[:34]),
                    "valid": "".join(train[34:38]),
                    "test": "".join(train[38:])}


def test_split_errors_name_the_users_own_folder(tmp_path):
  path = write_parquet(tmp_path / "mine", "",
                       rows={"validation": ROWS["validation"]})
  with pytest.raises(UserError) as info:
    load_splits(hf_config(path))
  assert f"data.path '{path}'" in str(info.value)
  assert "Salesforce" not in str(info.value)
