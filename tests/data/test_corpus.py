"""Sources: the embedded corpus, WikiText folders, plain text files, and the
registry that picks them by name."""

import os

import ml_collections
import pytest

from zebra_jax.data import pipeline, sources, splits as splits_lib
from zebra_jax.data.sources import embedded
from zebra_jax.errors import UserError


def data_config(**overrides) -> ml_collections.ConfigDict:
  c = dict(source="embedded", path="", valid_fraction=0.05, test_fraction=0.05)
  c.update(overrides)
  return ml_collections.ConfigDict(c)


def load_splits(data_config) -> dict[str, str]:
  return sources.load_splits(pipeline.make_source(data_config))


def source_fingerprint(data_config) -> str:
  return pipeline.make_source(data_config).fingerprint()


@pytest.fixture(scope="module")
def embedded_twice(tmp_path_factory):
  """Two loads: the first builds the corpus, the second reads the cache.

  The cache goes to a temporary folder so the test sees a fresh build.
  """
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    first = load_splits(data_config())
    second = load_splits(data_config())
    cached = os.listdir(os.path.join(os.environ["XDG_CACHE_HOME"], "zebra_jax"))
    documents = embedded.embedded_documents()
  return first, second, cached, documents


def test_embedded_is_big_english_text(embedded_twice):
  splits = embedded_twice[0]
  total = sum(len(text) for text in splits.values())
  assert total > 500_000
  assert splits["train"].count(" the ") > 1000
  for name in splits_lib.SPLITS:
    assert splits[name].strip(), name
  # The held-out shares are roughly the fractions asked for (documents vary).
  assert 0.01 < len(splits["valid"]) / total < 0.15
  assert 0.01 < len(splits["test"]) / total < 0.15


def test_embedded_is_prose_without_indentation(embedded_twice):
  text = "".join(embedded_twice[0].values())
  assert "  " not in text  # no space runs: indentation taught only blanks
  assert ">>>" not in text and "::=" not in text
  paragraphs = [p for p in text.split("\n") if p]
  assert not any(p[0].isspace() for p in paragraphs)
  # Most of what is left is words of letters.
  words = text.split()
  assert sum(w.strip(".,;:()'\"").isalpha() for w in words) > 0.75 * len(words)


def test_prose_keeps_paragraphs_and_drops_code():
  doc = ("Title\n=====\n\nA paragraph of real prose that is\nwrapped over"
         "   two lines.\n\n    code = 1\n    more()\n\n>>> 1 + 1\n2\n\n"
         "f(a, b)\n\nA second paragraph, also long enough to keep.")
  assert embedded.prose(doc) == (
      "A paragraph of real prose that is wrapped over two lines.\n\n"
      "A second paragraph, also long enough to keep.")


def test_embedded_is_deterministic_and_cached(embedded_twice):
  first, second, cached, _ = embedded_twice
  assert first == second
  assert len(cached) == 1 and cached[0].startswith("embedded-py")


def test_embedded_splits_are_disjoint_documents(embedded_twice):
  splits, _, _, documents = embedded_twice
  documents = dict(documents)
  assert any(name.startswith("topic:") for name in documents)
  assert any(name.startswith("module:") for name in documents)
  # Every document lands in exactly one split.
  for name, text in list(documents.items())[::25]:
    homes = [s for s in splits_lib.SPLITS if text + "\n\n" in splits[s]]
    assert len(homes) == 1, (name, homes)


def test_embedded_never_takes_tests(embedded_twice):
  modules = [name.removeprefix("module:").split(".")
             for name, _ in embedded_twice[3]
             if name.startswith("module:")]
  skipped = {"test", "tests", "idlelib", "tkinter", "site-packages"}
  assert not [m for m in modules if skipped & set(m)]
  assert ["json", "__init__"] in modules  # a package's docstrings are kept


def write_wikitext(folder, suffix=".tokens"):
  folder.mkdir(exist_ok=True)
  texts = {"train": " = Title = \n the cat sat \n", "valid": " the dog \n",
           "test": " a cat \n"}
  for split, text in texts.items():
    (folder / f"wiki.{split}{suffix}").write_text(text, encoding="utf-8")
  return texts


@pytest.mark.parametrize("suffix", [".tokens", ".raw"])
def test_wikitext_folder(tmp_path, suffix):
  texts = write_wikitext(tmp_path / "wt", suffix)
  splits = load_splits(
      data_config(source="wikitext", path=str(tmp_path / "wt")))
  assert splits == texts


def test_wikitext_missing_file_names_it(tmp_path):
  write_wikitext(tmp_path / "wt")
  os.remove(tmp_path / "wt" / "wiki.valid.tokens")
  with pytest.raises(UserError, match="wiki.valid.tokens is missing"):
    load_splits(
        data_config(source="wikitext", path=str(tmp_path / "wt")))


def test_wikitext_missing_folder(tmp_path):
  with pytest.raises(UserError, match="not a folder.*--config.data.path"):
    load_splits(
        data_config(source="wikitext", path=str(tmp_path / "nowhere")))


def test_text_file_split_by_fractions(tmp_path):
  lines = [f"line {i}" for i in range(20)]
  (tmp_path / "a.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
  splits = load_splits(data_config(
      source="text", path=str(tmp_path / "a.txt"), valid_fraction=0.1,
      test_fraction=0.25))
  # 20 lines: test = last 5, valid = the 2 before them, train = the first 13.
  assert splits["train"] == "".join(f"{l}\n" for l in lines[:13])
  assert splits["valid"] == "line 13\nline 14\n"
  assert splits["test"] == "".join(f"{l}\n" for l in lines[15:])


def test_text_folder_and_comma_list_concatenate_in_order(tmp_path):
  (tmp_path / "b.txt").write_text("b1\nb2", encoding="utf-8")  # no final \n
  (tmp_path / "a.txt").write_text("a1\r\na2\n", encoding="utf-8")
  (tmp_path / "skip.md").write_text("not text\n", encoding="utf-8")
  config = data_config(source="text", path=str(tmp_path), valid_fraction=0.0,
                       test_fraction=0.0)
  expected = {"train": "a1\na2\nb1\nb2\n", "valid": "", "test": ""}
  assert load_splits(config) == expected
  config.path = f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}"
  assert load_splits(config) == expected


def test_text_missing_path(tmp_path):
  missing = str(tmp_path / "missing.txt")
  with pytest.raises(UserError, match="does not exist.*--config.data.path"):
    load_splits(data_config(source="text", path=missing))


def test_empty_corpus(tmp_path):
  (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
  with pytest.raises(UserError, match="train split.*is empty"):
    load_splits(
        data_config(source="text", path=str(tmp_path / "empty.txt")))


def test_non_utf8_names_file_and_offset(tmp_path):
  path = tmp_path / "latin1.txt"
  path.write_bytes("caf".encode() + "é\n".encode("latin-1"))
  with pytest.raises(UserError, match=r"latin1.txt is not UTF-8.*offset 3.*"
                                      r"iconv") as info:
    load_splits(data_config(source="text", path=str(path)))
  assert "\n" not in str(info.value)


def test_bad_source_and_fractions():
  with pytest.raises(UserError, match="data.source .web. is unknown.*one of "
                     "embedded, wikitext, text, hf, tfds"):
    load_splits(data_config(source="web"))
  with pytest.raises(UserError, match="sum to less than 1"):
    load_splits(data_config(valid_fraction=0.6, test_fraction=0.5))


def test_fingerprint_tracks_files(tmp_path):
  path = tmp_path / "a.txt"
  path.write_text("one\n", encoding="utf-8")
  config = data_config(source="text", path=str(path))
  before = source_fingerprint(config)
  assert source_fingerprint(config) == before
  path.write_text("one two\n", encoding="utf-8")  # new size
  assert source_fingerprint(config) != before
  assert (source_fingerprint(data_config())
          != source_fingerprint(data_config(valid_fraction=0.1)))


def test_sources_are_frozen_and_picked_by_name():
  assert sorted(sources.SOURCES) == ["embedded", "hf", "text", "tfds",
                                     "wikitext"]
  source = pipeline.make_source(data_config(source="text", path="a.txt"))
  assert source == sources.TextSource("a.txt", 0.05, 0.05)
  with pytest.raises(Exception):  # frozen: options cannot drift after checks
    source.path = "b.txt"
  assert [s.needs_path for s in sources.SOURCES.values()] == [
      False, True, True, False, False]
