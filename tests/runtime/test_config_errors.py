"""Bad config values and bad command lines: one `error:` line, exit 2.

The table goes through config_checks.validate (fast, in-process); a few
subprocesses check what only the command line can get wrong.
"""

import json
import math
import os
import subprocess
import sys

import ml_collections
import pytest

from zebra_jax.config import files
from zebra_jax.configs import base, demo, lm1b, wlm, wt103
from zebra_jax.errors import UserError
from zebra_jax.runtime import config_checks
from tests.helpers import REPO

NAN = math.nan
POSITIVE_INTS = (
    "data.batch_size", "data.seq_len", "data.bpe_vocab_size",
    "model.embed_size", "model.hidden_size", "model.num_layers",
    "model.num_stripes", "model.unroll", "model.adaptive_div_val",
    "train.num_steps", "train.log_every",
    "train.eval_every", "train.grad_accum_steps", "train.max_consecutive_skips",
    "train.loss_scale.growth_interval", "eval.batch_size", "eval.seq_len",
    "checkpoint.every_steps", "checkpoint.keep_latest",
    "sample.num_samples", "sample.chunk", "serve.max_body_bytes",
    "serve.max_new_tokens", "serve.max_prompt_tokens", "serve.max_rows",
    "serve.max_score_tokens", "serve.slots", "serve.prefill_chunk",
    "serve.prefill_rows", "serve.decode_block", "serve.small_batch_blocks",
    "serve.small_batch_rows", "parallel.stripe_devices",
    "export.triton_max_batch_size")
NON_NEGATIVE_INTS = (
    "data.min_freq", "data.max_vocab_size", "model.vocab_size",
    "model.adaptive_chunk_rows", "model.adaptive_tile",
    "optim.warmup_steps", "train.eval_max_batches", "checkpoint.keep_best",
    "profile.start_step", "profile.num_steps",
    "eval.max_tokens", "serve.queue", "serve.prefix_cache_bytes",
    "export.triton_queue_delay_us")
POSITIVE_NUMBERS = ("optim.learning_rate", "optim.eps",
                    "train.loss_scale.initial_scale",
                    "train.loss_scale.min_scale")
NON_NEGATIVE_NUMBERS = ("optim.weight_decay", "optim.clip_norm",
                        "train.time_budget_minutes", "serve.drain_seconds")
BOOLS = ("model.tie_embeddings", "model.adaptive_tie", "model.remat",
         "model.head_fused_xent",
         "train.report_at_end", "train.sample_at_eval", "eval.accuracy",
         "sample.stream", "serve.access_log")
TEXTS = ("data.path", "data.hf_name", "data.hf_config", "data.hf_cache_dir",
         "data.hf_text_column", "data.tfds_name", "data.tfds_data_dir",
         "data.tfds_train_split", "data.tfds_valid_split",
         "data.tfds_test_split", "data.tfds_text_key",
         "sample.prompt", "sample.stop", "serve.api_key", "serve.api_key_file",
         "serve.chat_template", "serve.allowed_origins", "export.triton_gpus")

# (field, bad value, what the one line says about it)
CASES = (
    [(f, v, "must be a positive whole number") for f in POSITIVE_INTS
     for v in (0, -3, 2.5, NAN, "8", True)]
    + [(f, v, "must be a whole number >= 0") for f in NON_NEGATIVE_INTS
       for v in (-1, 1.5, NAN, "0")]
    + [(f, v, "must be a whole number") for f in ("seed", "sample.seed")
       for v in (1.5, "0", None)]
    + [(f, v, "must be positive") for f in POSITIVE_NUMBERS
       for v in (0, -1e-3, NAN, math.inf, "1e-3")]
    + [(f, v, "must be a number >= 0") for f in NON_NEGATIVE_NUMBERS
       for v in (-0.5, NAN, "1")]
    + [(f, v, "is outside [0, 1)") for f in (
        "model.dropout_embed", "model.dropout_hidden", "model.dropout_output",
        "optim.momentum", "optim.b1", "optim.b2") for v in (1.0, -0.1, NAN)]
    + [("optim.min_lr_ratio", v, "is outside [0, 1]") for v in (1.5, -0.1, NAN)]
    + [("train.loss_scale.backoff_factor", v, "is outside (0, 1)")
       for v in (0.0, 1.0, NAN)]
    + [("train.loss_scale.growth_factor", v, "must be above 1")
       for v in (1.0, 0.5, NAN)]
    + [(f, v, "is outside (0, 0.5)") for f in (
        "data.valid_fraction", "data.test_fraction") for v in (0.0, 0.5, NAN)]
    # The sampling parameters' bounds are the serving engine's.
    + [("sample.max_new_tokens", v, "must be a whole number in [0, ")
       for v in (-1, 2.5, NAN, "8", True)]
    + [("sample.top_k", v, "must be a whole number in [-1, ")
       for v in (-2, 1.5, NAN, "0", 2**40)]
    + [("sample.temperature", v, "must be a number in [0, 100]")
       for v in (-0.5, NAN, "1", 101)]
    + [("sample.top_p", v, "must be a number in (0, 1]")
       for v in (0.0, 1.5, NAN)]
    + [("sample.min_p", v, "must be a number in [0, 1]") for v in (-0.1, 2)]
    + [("sample.repetition_penalty", v, "must be a number in (0, 100]")
       for v in (0, -1e-3, NAN, math.inf, "1e-3")]
    + [(f, v, "must be a number in [-2, 2]") for f in (
        "sample.presence_penalty", "sample.frequency_penalty")
       for v in (2.5, NAN)]
    + [(f, v, "must be true or false") for f in BOOLS for v in (1, "yes")]
    + [(f, v, "must be text") for f in TEXTS for v in (0, None)]
    + [("data.source", "web", "is not one of"),
       ("data.tokenizer", "sentencepiece", "is not one of"),
       ("data.batching", "shuffled", "is not one of"),
       ("model.dtype", "float64", "is not one of"),
       ("model.head", "hierarchical", "is not one of"),
       ("model.stripe_input", "sparse", "is not one of"),
       ("export.triton_instance", "tpu", "is not one of"),
       ("model.recurrence", "cuda", "is not one of"),
       ("model.head_logits_dtype", "bfloat16", "is not one of"),
       ("model.cpu_bf16_head", "on", "is not one of"),
       ("model.cpu_bf16_projections", "bf16", "is not one of"),
       ("model.cpu_bf16_recurrence", "on", "is not one of"),
       ("model.cpu_fused_head", "always", "is not one of"),
       ("optim.name", "adagrad", "is not one of"),
       ("model.num_stripes", 3, "not divisible by model.num_stripes=3"),
       ("parallel.stripe_devices", 3,
        "does not divide model.num_stripes=4: set --config.parallel."
        "stripe_devices to a divisor of both, e.g. 4"),
       ("parallel.stripe_devices", 16, "does not divide model.num_stripes"),
       ("model.adaptive_cutoffs", (60, 20), "strictly increasing"),
       ("model.adaptive_cutoffs", (0.5,), "is not a tuple of word ids")]
)


def _with(cfg, dotted: str, value) -> ml_collections.ConfigDict:
  """cfg with one field replaced, type checks bypassed (as JSON could)."""
  tree = cfg.to_dict()
  *path, leaf = dotted.split(".")
  node = tree
  for part in path:
    node = node[part]
  assert leaf in node, dotted  # the table names real fields
  node[leaf] = value
  return ml_collections.ConfigDict(tree)


def _tiny():
  cfg = demo.get_config("tiny")
  cfg.model.head = "adaptive"  # so the cutoffs are checked too
  return cfg


@pytest.mark.parametrize("field, value, message", CASES,
                         ids=[f"{f}={v!r}" for f, v, _ in CASES])
def test_bad_value_is_one_line_naming_field_and_fix(field, value, message):
  with pytest.raises(UserError) as raised:
    config_checks.validate(_with(_tiny(), field, value))
  text = str(raised.value)
  assert "\n" not in text and message in text, text
  assert field in text  # the field, then the fix:
  assert "e.g." in text or "pick one of" in text, text


def test_shipped_configs_and_edge_values_pass():
  for cfg in (base.get_config(), demo.get_config(), demo.get_config("tiny"),
              wt103.get_config("tiny"), lm1b.get_config(),
              lm1b.get_config("tiny"), wlm.get_config(),
              wlm.get_config("grouped8"), wlm.get_config("tiny")):
    if cfg.data.source == "wikitext":
      cfg.data.path = "/data/wikitext-103"
    config_checks.validate(cfg)
  for field, value in (("model.dropout_hidden", 0.0), ("sample.top_p", 1.0),
                       ("optim.min_lr_ratio", 1.0), ("optim.clip_norm", 0.0),
                       ("sample.temperature", 0.0), ("sample.top_k", 0),
                       ("optim.learning_rate", 1), ("seed", -7)):
    config_checks.validate(_with(_tiny(), field, value))


def _leaves(tree, prefix=""):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def test_every_base_field_is_checked():
  """A field added to config/base.py must be added to the checks too."""
  checked = {f for f, _, _ in CASES} | {"model.adaptive_cutoffs"}
  fields = set(_leaves(base.get_config().to_dict()))
  assert not fields - checked, f"no check or test row: {fields - checked}"
  assert not checked - fields, f"not in config/base.py: {checked - fields}"


@pytest.mark.parametrize("spec", [
    "wt103:tiny", "wt103.py:tiny",
    # Where the shipped configs lived before they moved into the package:
    # command lines written then name them by these paths.
    "configs/wt103.py:tiny", "/old/checkout/configs/wt103.py:tiny"])
def test_shipped_configs_load_by_name_from_any_directory(tmp_path,
                                                         monkeypatch, spec):
  monkeypatch.chdir(tmp_path)
  assert files.load_file(spec).to_dict() == wt103.get_config("tiny").to_dict()
  assert files.default_workdir(spec) == "runs/wt103-tiny"


def test_a_config_file_of_ones_own_loads_by_path(tmp_path, monkeypatch):
  """A file wins over a shipped name, even at a shipped config's old path."""
  mine = tmp_path / "configs" / "demo.py"
  mine.parent.mkdir()
  mine.write_text("from zebra_jax.configs import demo\n"
                  "def get_config(variant=''):\n"
                  "  c = demo.get_config(variant)\n"
                  "  c.model.hidden_size = 48\n"
                  "  return c\n")
  monkeypatch.chdir(tmp_path)
  for spec in ("configs/demo.py:tiny", f"{mine}:tiny"):
    assert files.load_file(spec).model.hidden_size == 48
  assert files.load_file("demo:tiny").model.hidden_size == 32  # the shipped


def test_shipped_names_are_the_shipped_files():
  folder = os.path.dirname(demo.__file__)
  assert files.shipped_names() == ["base", "demo", "lm1b", "wlm", "wt103"]
  assert files.as_path("demo:tiny") == os.path.join(folder, "demo.py") + ":tiny"
  assert files.as_path("nope:tiny") == "nope:tiny"  # left for its reader


def test_config_flag_of_ml_collections_takes_names(tmp_path):
  """Tools whose --config is ml_collections' config flag (it reads files
  only) take a shipped name too, from any directory."""
  code = ("from absl import flags; from ml_collections import config_flags; "
          "from zebra_jax.cli import entry; "
          "c = config_flags.DEFINE_config_file('config'); "
          "entry.parse_flags(['x', '--config', 'wt103:tiny']); "
          "print(c.value.model.head, c.value.sample.chunk)")
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["adaptive", "32"]


def _cli(cwd, *args):
  return subprocess.run([sys.executable, "-m", "zebra_jax.main", *args],
                        capture_output=True, text=True, timeout=300, cwd=cwd)


def _one_error_line(out) -> str:
  assert out.returncode == 2, out.stderr
  assert "Traceback" not in out.stderr, out.stderr
  (line,) = out.stderr.strip().splitlines()
  assert line.startswith("error: ")
  return line


def test_cli_mistyped_config_path(tmp_path):
  line = _one_error_line(_cli(tmp_path, "--config=configs/nope.py",
                              f"--workdir={tmp_path}"))
  assert "no such file 'configs/nope.py'" in line
  assert "shipped configs: base, demo, lm1b, wlm, wt103" in line  # what exists instead
  line = _one_error_line(_cli(tmp_path, "--config=dmeo:tiny"))
  assert "no shipped config 'dmeo'" in line
  assert "e.g. --config=demo:tiny" in line


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_cli_damaged_config_json(tmp_path, mode):
  workdir = tmp_path / "run"
  workdir.mkdir()
  whole = json.dumps(demo.get_config("tiny").to_dict(), indent=2)
  (workdir / "config.json").write_text(whole[:len(whole) // 2])  # disk full
  config = (["--config=demo:tiny"] if mode == "train" else [])
  line = _one_error_line(_cli(REPO, *config, f"--mode={mode}",
                              f"--workdir={workdir}"))
  assert f"{workdir}/config.json is damaged" in line
  assert ("delete it to resume" if mode == "train" else "restore it") in line


def test_cli_grad_accum_steps_zero(tmp_path):
  line = _one_error_line(_cli(
      REPO, "--config=demo:tiny", f"--workdir={tmp_path}/run",
      "--config.train.grad_accum_steps=0"))
  assert ("--config.train.grad_accum_steps=0 must be a positive whole number"
          in line)


def test_cli_workdir_config_without_config_flag(tmp_path):
  """--config left out: the workdir's config.json, overrides applied to it."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(
      json.dumps(demo.get_config("tiny").to_dict()))
  line = _one_error_line(_cli(tmp_path, "--mode=sample", "--workdir=run",
                              "--config.sample.top_p=0"))
  assert "top_p=0" in line  # the override reached the sampling bounds
