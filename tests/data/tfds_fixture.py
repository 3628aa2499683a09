"""A tiny TFDS text dataset, prepared as array_record without TensorFlow:
what data.source=tfds reads in the tests and in docs/data.md's example.

  python -c "from tests.data.tfds_fixture import prepare; prepare('/tmp/tfds')"

writes /tmp/tfds/zebra_tiny_lm/1.0.0/ with splits train (240 rows) and test
(40 rows) and no validation, like lm1b, so a run carves one out of train.
"""

import tensorflow_datasets as tfds

from tests.data.fixtures import sentences

NAME = "zebra_tiny_lm"
LINES = {"train": sentences(240, seed=0), "test": sentences(40, seed=1)}


class ZebraTinyLm(tfds.core.GeneratorBasedBuilder):
  """LINES as a TFDS dataset: one `text` feature a row, stored in order."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    # disable_shuffling: rows keep the order written, so tests compare texts.
    return tfds.core.DatasetInfo(
        builder=self, disable_shuffling=True,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    return {split: self._generate_examples(lines)
            for split, lines in LINES.items()}

  def _generate_examples(self, lines):
    for index, line in enumerate(lines):
      yield index, {"text": line}


def prepare(data_dir: str) -> str:
  """Prepares the dataset under data_dir (array_record); returns data_dir."""
  ZebraTinyLm(data_dir=data_dir,
              file_format="array_record").download_and_prepare()
  return data_dir
