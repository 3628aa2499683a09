"""`data.source=tfds`: a prepared TensorFlow Datasets dataset, a row a line.

Reads through TFDS's random-access data sources (`builder.as_data_source`),
which read array_record (or parquet) files with the `array_record` package
and decode rows with numpy: no TensorFlow at training time, checked by the
tests in a venv without it. A dataset prepared in TFDS's default tfrecord
format is refused with a line saying how to prepare it as array_record;
preparing (`tfds build`, and builders such as lm1b's that glob with
tf.io.gfile) does import TensorFlow, once, wherever that runs.

  data.tfds_name         e.g. lm1b, or NAME/CONFIG:VERSION
  data.tfds_data_dir     where it was prepared ('' = TFDS's default)
  data.tfds_*_split      TFDS split names, slicing included, so a dataset of
                         train and test alone can carve its validation split:
                         train[:99%] | train[99%:] | test, or train[-5000:]
  data.tfds_text_key     the feature holding the text (bytes or str)

Rows are decoded once, on the first run: the id cache keeps the tokens.

`tensorflow-datasets` is optional (`pip install 'zebra_jax[tfds]'`):
imported here only.
"""

import dataclasses
import os
from typing import ClassVar

from zebra_jax.data import splits as splits_lib
from zebra_jax.errors import UserError

_ROWS_PER_PIECE = 20_000  # lm1b: ~2.7 MB of text per piece
_RANDOM_ACCESS_FORMATS = ("array_record", "parquet")


@dataclasses.dataclass(frozen=True)
class TFDSSource:
  """The text feature of three (sliced) splits of a prepared TFDS dataset."""

  name: ClassVar[str] = "tfds"
  needs_path: ClassVar[bool] = False

  tfds_name: str
  tfds_data_dir: str
  tfds_train_split: str
  tfds_valid_split: str
  tfds_test_split: str
  tfds_text_key: str

  def fingerprint(self) -> str:
    """The names and split specs, and the stats of the prepared files
    (reads dataset_info.json, no rows)."""
    folder = _builder(self).data_dir
    files = sorted(os.path.join(root, f)
                   for root, _, names in os.walk(folder) for f in names)
    return splits_lib.fingerprint({
        "source": self.name, "name": self.tfds_name,
        "splits": self._split_specs(), "text_key": self.tfds_text_key,
        "files": splits_lib.file_stats(files)})

  def open(self) -> dict[str, splits_lib.Split]:
    builder = _builder(self)
    _check_text_key(builder, self)
    return {name: _row_split(name, _data_source(builder, spec, name, self),
                             self.tfds_text_key)
            for name, spec in zip(splits_lib.SPLITS, self._split_specs())}

  def _split_specs(self) -> list[str]:
    return [self.tfds_train_split, self.tfds_valid_split,
            self.tfds_test_split]


def _import_tfds():
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserError(
        "data.source=tfds needs the `tensorflow-datasets` package: pip "
        "install 'zebra_jax[tfds]'") from None
  return tfds


def _builder(source):
  """The prepared dataset's builder (its dataset_info.json read, no rows)."""
  if not source.tfds_name:
    raise UserError("data.source=tfds needs a dataset: set "
                    "--config.data.tfds_name, e.g. lm1b")
  tfds = _import_tfds()
  data_dir = source.tfds_data_dir or None
  where = source.tfds_data_dir or "TFDS's default data_dir"
  try:
    builder = tfds.builder(source.tfds_name, data_dir=data_dir)
  except ValueError as e:  # DatasetNotFoundError among them
    raise UserError(
        f"TFDS has no dataset {source.tfds_name!r} in {where} "
        f"({_first_sentence(e)}): prepare it there, or fix "
        "--config.data.tfds_name / --config.data.tfds_data_dir") from None
  if not builder.is_prepared():
    raise UserError(
        f"TFDS dataset {source.tfds_name!r} is not prepared in {where} "
        f"({builder.data_dir} is missing): prepare it with `tfds build "
        f"{source.tfds_name} --data_dir=DIR --file_format=array_record` and "
        "set --config.data.tfds_data_dir=DIR")
  file_format = builder.info.file_format
  format_name = getattr(file_format, "value", str(file_format))
  if format_name not in _RANDOM_ACCESS_FORMATS:
    raise UserError(
        f"TFDS dataset {source.tfds_name!r} in {builder.data_dir} is stored "
        f"as {format_name}, which only TensorFlow reads: prepare it again "
        f"with `tfds build {source.tfds_name} --file_format=array_record` "
        "(array_record and parquet read without TensorFlow)")
  return builder


def _check_text_key(builder, source) -> None:
  features = list(builder.info.features.keys())
  if source.tfds_text_key not in features:
    raise UserError(
        f"TFDS dataset {source.tfds_name!r} has features {features}, not "
        f"{source.tfds_text_key!r}: set --config.data.tfds_text_key to the "
        "one holding the text")


def _data_source(builder, spec: str, name: str, source):
  """The random-access rows of one split spec; a bad spec -> UserError."""
  field = f"data.tfds_{name}_split"
  try:
    rows = builder.as_data_source(split=spec)
  except ValueError as e:
    raise UserError(
        f"{field}={spec!r} does not select rows of {source.tfds_name!r} "
        f"(splits {', '.join(builder.info.splits)}): {_first_sentence(e)}; "
        f"fix --config.{field}, e.g. train[:99%] and train[99%:] to carve "
        "a split out of train") from None
  return rows


def _row_split(name: str, rows, key: str) -> splits_lib.Split:
  """Rows -> lines: each row's text ends with exactly one "\\n"."""
  def read():
    for start in range(0, len(rows), _ROWS_PER_PIECE):
      batch = rows.__getitems__(range(start, min(start + _ROWS_PER_PIECE,
                                                 len(rows))))
      texts = [_text(row[key], key) for row in batch]
      yield "".join(t if t.endswith("\n") else t + "\n"
                    for t in texts), len(texts)
  return splits_lib.Split(name, len(rows), "rows", read)


def _text(value, key: str) -> str:
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, str):
    return value
  raise UserError(f"TFDS feature {key!r} holds {type(value).__name__}, not "
                  "text: set --config.data.tfds_text_key to a Text feature")


def _first_sentence(error: Exception) -> str:
  """TFDS's messages can list every registered dataset: the first sentence."""
  text = " ".join(str(error).split())
  return text.split(". ")[0].rstrip(".")
