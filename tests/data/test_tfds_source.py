"""data.source=tfds on a tiny TFDS dataset prepared in a temporary data_dir
(tests/data/tfds_fixture.py): rows read back as written, split slicing,
no TensorFlow at read time, one error line per mistake."""

import builtins
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from zebra_jax.data import pipeline, sources
from zebra_jax.errors import UserError
from tests.helpers import REPO


@pytest.fixture(scope="module")
def fixture():
  """tests/data/tfds_fixture.py, importable where tensorflow-datasets is."""
  pytest.importorskip("tensorflow_datasets",
                      reason="pip install 'zebra_jax[tfds]'")
  from tests.data import tfds_fixture  # pylint: disable=g-import-not-at-top
  return tfds_fixture


@pytest.fixture(scope="module")
def data_dir(fixture, tmp_path_factory):
  return fixture.prepare(str(tmp_path_factory.mktemp("tfds")))


def tfds_config(data_dir, **overrides) -> ml_collections.ConfigDict:
  d = dict(source="tfds", tfds_name="zebra_tiny_lm", tfds_data_dir=data_dir,
           tfds_train_split="train[:90%]", tfds_valid_split="train[90%:]",
           tfds_test_split="test", tfds_text_key="text", tokenizer="word",
           min_freq=1, max_vocab_size=0)
  d.update(overrides)
  return ml_collections.ConfigDict(d)


def load_splits(data_config) -> dict[str, str]:
  return sources.load_splits(pipeline.make_source(data_config))


def lines_text(lines) -> str:
  return "".join(line + "\n" for line in lines)


def test_slices_carve_valid_out_of_train_row_for_row(fixture, data_dir):
  train = fixture.LINES["train"]
  cut = len(train) * 9 // 10
  assert load_splits(tfds_config(data_dir)) == {
      "train": lines_text(train[:cut]), "valid": lines_text(train[cut:]),
      "test": lines_text(fixture.LINES["test"])}
  absolute = load_splits(tfds_config(data_dir, tfds_train_split="train[:-5]",
                                     tfds_valid_split="train[-5:]"))
  assert absolute["valid"] == lines_text(train[-5:])


def test_word_ids_are_the_lines_words(fixture, data_dir, tmp_path):
  cfg = ml_collections.ConfigDict(dict(data=dict(tfds_config(data_dir))))
  tokenizer, ids = pipeline.prepare_data(cfg, str(tmp_path / "run"))
  train = fixture.LINES["train"]
  cut = len(train) * 9 // 10
  for name, lines in (("train", train[:cut]), ("valid", train[cut:]),
                      ("test", fixture.LINES["test"])):
    words = [w for line in lines for w in line.split() + ["<eos>"]]
    assert [tokenizer.vocab[i] for i in ids[name]] == words, name
  # A rerun maps the cached ids: the fingerprint is taken afresh, the same.
  manifest = json.loads((tmp_path / "run" / "data" / "manifest.json")
                        .read_text())
  source = pipeline.make_source(cfg.data)
  assert manifest["source_fingerprint"] == source.fingerprint()
  assert source.fingerprint() != pipeline.make_source(
      tfds_config(data_dir, tfds_valid_split="train[95%:]")).fingerprint()


def test_reads_without_importing_tensorflow(data_dir):
  code = ("import sys; from tests.data.test_tfds_source import "
          "load_splits, tfds_config; "
          f"splits = load_splits(tfds_config({data_dir!r})); "
          "print(len(splits['train']), 'tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  size, imported = out.stdout.split()
  assert int(size) > 0 and imported == "False"


def test_a_dataset_prepared_as_tfrecord_is_refused(fixture, tmp_path):
  """TFDS records the format in dataset_info.json; tfrecord needs TF."""
  data_dir = fixture.prepare(str(tmp_path))
  info_path = os.path.join(data_dir, fixture.NAME, "1.0.0",
                           "dataset_info.json")
  with open(info_path, encoding="utf-8") as f:
    info = json.load(f)
  info["fileFormat"] = "tfrecord"
  with open(info_path, "w", encoding="utf-8") as f:
    json.dump(info, f)
  with pytest.raises(UserError, match="stored as tfrecord, which only "
                     "TensorFlow reads.*--file_format=array_record"):
    load_splits(tfds_config(data_dir))


@pytest.mark.parametrize("overrides, message", [
    (dict(tfds_name=""), "set --config.data.tfds_name, e.g. lm1b"),
    (dict(tfds_name="no_such_dataset_xyz"),
     "TFDS has no dataset 'no_such_dataset_xyz'"),
    (dict(tfds_valid_split="validation"),
     "data.tfds_valid_split='validation' does not select rows of "
     "'zebra_tiny_lm' \\(splits train, test\\): Unknown split"),
    (dict(tfds_test_split="test[:abc]"), "fix --config.data.tfds_test_split"),
    (dict(tfds_valid_split="train[5:5]"),
     "tfds_valid_split=.train\\[5:5\\]. does not select rows"),
    (dict(tfds_text_key="body"),
     "has features \\['text'\\], not 'body': set --config.data.tfds_text_key"),
])
def test_mistakes_are_one_line_naming_the_fix(data_dir, overrides, message):
  with pytest.raises(UserError, match=message) as raised:
    load_splits(tfds_config(data_dir, **overrides))
  assert "\n" not in str(raised.value)


def test_a_registered_dataset_not_prepared_says_how(fixture, tmp_path):
  with pytest.raises(UserError, match="'lm1b' is not prepared in .*tfds build "
                     "lm1b --data_dir=DIR --file_format=array_record"):
    load_splits(tfds_config(str(tmp_path), tfds_name="lm1b"))


def test_missing_package_says_what_to_install(monkeypatch):
  real_import = builtins.__import__

  def no_tfds(name, *args, **kwargs):
    if name == "tensorflow_datasets":
      raise ImportError("No module named 'tensorflow_datasets'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_tfds)
  with pytest.raises(UserError, match=r"pip install 'zebra_jax\[tfds\]'"):
    load_splits(tfds_config("/nowhere"))


@pytest.mark.slow
def test_lm1b_tiny_trains_end_to_end_on_it(data_dir, tmp_path):
  """The command docs/data.md shows, a few steps of it."""
  out = subprocess.run(
      [sys.executable, "-m", "zebra_jax.main", "--config=lm1b:tiny",
       f"--workdir={tmp_path / 'run'}",
       f"--config.data.tfds_data_dir={data_dir}",
       "--config.train.num_steps=6", "--config.train.eval_every=3"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "| eval 2 at step 6" in out.stdout, out.stdout
  assert "| test at step 6" in out.stdout, out.stdout
