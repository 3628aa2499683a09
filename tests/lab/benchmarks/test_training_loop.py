"""The training-loop benchmark's parts: its configs, log interval and the
torch side's absence reported."""

import sys

import ml_collections
import pytest

from lab.benchmarks import training_loop
from zebra_jax.config import files
from zebra_jax.errors import UserError


def _base() -> ml_collections.ConfigDict:
  return files.load_file("base")


def test_missing_torch_is_reported_not_faked(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
  cfg = training_loop.train_config(_base(), training_loop.SHAPES["quick"], 1,
                                 "dense", 6, 4)
  rows, note = training_loop.torch_rows(cfg, 107, None, 4, 6)
  assert rows == [] and "torch not installed" in note


@pytest.mark.parametrize("warmup,steps", [(2, 6), (4, 6), (20, 60), (9, 12),
                                          (7, 5)])
def test_log_lines_bound_the_timed_part(warmup, steps):
  every = training_loop.log_interval(warmup, steps)
  assert warmup % every == 0 and steps % every == 0
  assert warmup // every >= 2
  # No longer interval has both properties.
  assert all(warmup % d or steps % d or warmup // d < 2
             for d in range(every + 1, warmup + 1))


def test_too_short_warmup_is_a_user_error():
  with pytest.raises(UserError, match="--warmup=1"):
    training_loop.log_interval(1, 6)


def test_train_config_sets_the_rows_stripes_and_schedule():
  shape = training_loop.SHAPES["quick"]
  cfg = training_loop.train_config(_base(), shape, 2, "grouped", 6, 4)
  assert cfg.model.stripe_input == "grouped" and cfg.model.num_stripes == 2
  assert cfg.train.num_steps == 10 and cfg.train.eval_every > 10
  assert cfg.checkpoint.every_steps > 10


def test_word_shape_reads_a_16k_word_vocabulary():
  cfg = training_loop.train_config(_base(), training_loop.SHAPES["word"], 1,
                                 "dense", 60, 20)
  vocab_size, ids = training_loop.train_ids(cfg)
  assert vocab_size == 16384
  assert ids.min() >= 0 and ids.max() < vocab_size
  assert (cfg.model.hidden_size, cfg.data.tokenizer) == (256, "word")
