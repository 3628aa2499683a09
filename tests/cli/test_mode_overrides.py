"""Every mode by every config section: each --config.* override is applied,
refused (one error line) or warned about (one line), never dropped silently.

The table below is the contract, written out here rather than read from
zebra_jax/config/mode_fields.py, so a change of the rule shows up as a
failing case. Overrides go through cli.arguments.load, as the command line
does; "applied" is checked in the config the mode then runs with.
"""

import re
import subprocess
import sys

import pytest

from zebra_jax.cli import arguments
from zebra_jax.cli.modes import CONFIGLESS
from zebra_jax.config import base, mode_fields
from zebra_jax.errors import UserError
from zebra_jax.runtime import rundir
from zebra_jax.training import evaluate, loop
from tests.helpers import REPO, tiny_word_config, write_wikitext

MODES = ("eval", "sample", "score", "serve", "export", "plot")
SECTIONS = sorted({name.split(".")[0] for name, _ in base.fields()})
# What a trained model is: refused in every mode but train.
TRAINED = {"model.vocab_size", "model.embed_size", "model.hidden_size",
           "model.num_layers", "model.num_stripes", "model.stripe_input",
           "model.tie_embeddings", "model.head", "model.adaptive_cutoffs",
           "model.adaptive_div_val", "model.adaptive_tie", "data.tokenizer",
           "data.bpe_vocab_size", "data.min_freq", "data.max_vocab_size"}
RUNS = {"model.dtype", "model.adaptive_chunk_rows", "model.recurrence",
        "model.cpu_bf16_head", "model.head_logits_dtype",
        "model.head_fused_xent", "model.adaptive_tile", "parallel"}
# Read where a window of tokens runs the layers at once: not by sampling,
# whose prompts and tokens go one step at a time.
WINDOWS = {"model.cpu_bf16_projections", "model.cpu_bf16_recurrence",
           "model.unroll"}
CORPUS = {"data.source", "data.path", "data.hf_name", "data.hf_config",
          "data.hf_cache_dir", "data.hf_text_column", "data.tfds_name",
          "data.tfds_data_dir", "data.tfds_train_split",
          "data.tfds_valid_split", "data.tfds_test_split", "data.tfds_text_key",
          "data.valid_fraction", "data.test_fraction"}
APPLIED = {
    "eval": RUNS | WINDOWS | CORPUS | {"eval", "model.cpu_fused_head"},
    "sample": RUNS | {"sample", "serve.slots", "serve.queue",
                      "serve.prefill_chunk", "serve.prefill_rows",
                      "serve.small_batch_blocks", "serve.small_batch_rows",
                      "serve.prefix_cache_bytes"},
    "score": RUNS | WINDOWS | {"eval.seq_len"},
    "serve": RUNS | WINDOWS | {"serve", "sample", "eval.seq_len"},
    "export": RUNS | WINDOWS | {"export", "sample", "serve", "eval"},
    "plot": set(),
}

# Read only when another field selects them, which the char run's config
# does not (data.source=embedded, model.head=full): an override a mode
# would apply gets one line saying what would select it.
UNSELECTED = {"data.hf_name", "data.hf_config", "data.hf_cache_dir",
              "data.hf_text_column", "data.tfds_name", "data.tfds_data_dir",
              "data.tfds_train_split", "data.tfds_valid_split",
              "data.tfds_test_split", "data.tfds_text_key",
              "model.adaptive_chunk_rows", "model.head_logits_dtype",
              "model.head_fused_xent", "model.adaptive_tile"}


def expected(mode: str, field: str) -> str:
  if mode == "plot" or field in TRAINED:
    return "refused"
  applied = APPLIED[mode]
  if field in applied or field.split(".")[0] in applied:
    return "unselected" if field in UNSELECTED else "applied"
  return "warned"


def _changed(field: str, rule, value):
  """(a value other than `value` that the field's rule accepts, its text)."""
  if isinstance(value, bool):
    return not value, str(not value).lower()
  if hasattr(rule, "choices"):
    other = next(c for c in rule.choices if c != value)
    return other, other
  if isinstance(value, tuple):
    return (10, 20), "(10, 20)"
  if isinstance(value, int):
    return value + 1, str(value + 1)
  if isinstance(value, float):
    new = value + 0.01 if value < 0.9 else value - 0.01
    return new, repr(new)
  return value + "x", value + "x"


def _running_config(mode, cfg, workdir):
  """The config `mode` runs with: the model's settings merged as inference
  merges them, and for eval the corpus, which evaluate.run reads off cfg."""
  merged = rundir.load_config(cfg, workdir)
  if mode == "eval":
    merged.data = cfg.data
  return merged


def _load(mode, workdir, overrides):
  """As zebra_jax.main reads the command line's config."""
  return arguments.load(mode, None, workdir, overrides,
                        needs_config=mode not in CONFIGLESS)[0]


def _outcome(mode, field, workdir, capsys):
  """What the command line does with one changed override of `field`."""
  value = _load("eval", workdir, [])
  for part in field.split("."):
    value = value[part]
  rules = dict(base.fields())
  new, text = _changed(field, rules[field].rule, value)
  capsys.readouterr()
  try:
    cfg = _load(mode, workdir, [(field, text)])
  except UserError as e:
    assert f"--config.{field}" in str(e) and "\n" not in str(e), str(e)
    return "refused"
  warnings = capsys.readouterr().err.splitlines()
  running = _running_config(mode, cfg, workdir)
  for part in field.split("."):
    running = running[part]
  if warnings:
    assert len(warnings) == 1, warnings
    if warnings[0].startswith(f"warning: --config.{field}: read only with "):
      return "unselected"
    assert warnings[0].startswith(f"warning: --config.{field}: --mode={mode} "
                                  "does not read it"), warnings
    return "warned"
  assert mode_fields.same(running, new), (
      f"--config.{field}={text} under --mode={mode}: neither refused, nor "
      f"warned about, nor applied (runs with {running!r})")
  return "applied"


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("mode", MODES)
def test_every_override_is_applied_refused_or_warned(char_run, capsys, mode,
                                                     section):
  _, workdir = char_run
  fields = [name for name, _ in base.fields()
            if name.split(".")[0] == section]
  got = {field: _outcome(mode, field, workdir, capsys) for field in fields}
  assert got == {field: expected(mode, field) for field in fields}


def test_the_table_covers_every_mode():
  assert set(mode_fields.READS) == {"train", *MODES}


def test_a_trained_models_own_value_is_accepted(char_run, capsys):
  """The training command's overrides may be repeated in any mode."""
  cfg, workdir = char_run
  hidden = str(cfg.model.hidden_size)
  loaded, _ = arguments.load(
      "sample", f"{REPO}/zebra_jax/configs/demo.py:tiny", workdir,
      [("model.hidden_size", hidden), ("data.tokenizer", "char"),
       ("sample.temperature", "0")])
  assert loaded.sample.temperature == 0.0
  assert capsys.readouterr().err == ""


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "zebra_jax.main", *args],
                        capture_output=True, text=True, timeout=300, cwd=REPO)


def test_cli_refuses_a_model_field_in_one_line(char_run):
  _, workdir = char_run
  out = _cli(f"--workdir={workdir}", "--mode=sample",
             "--config.model.hidden_size=64")
  assert out.returncode == 2 and "Traceback" not in out.stderr
  (line,) = out.stderr.strip().splitlines()
  assert line.startswith("error: --config.model.hidden_size=64: the model in")
  assert "trained with model.hidden_size=32" in line, line


@pytest.mark.slow
def test_eval_of_another_corpus_reports_unknown_tokens(char_run, tmp_path):
  """Another text scores another perplexity; what the trained vocabulary
  lacks is counted, and the workdir's records keep the training corpus."""
  _, workdir = char_run
  other = tmp_path / "other.txt"
  other.write_text("".join(f"Row {i}: ZEBRAS graze by the river, quietly!\n"
                           for i in range(200)))
  ppl = lambda out: float(re.search(r"test ppl ([0-9.]+)", out).group(1))
  trained = _cli(f"--workdir={workdir}", "--mode=eval", "--split=test")
  out = _cli(f"--workdir={workdir}", "--mode=eval", "--split=test",
             "--config.data.source=text", f"--config.data.path={other}")
  assert trained.returncode == 0 and out.returncode == 0, out.stderr
  assert ppl(out.stdout) != pytest.approx(ppl(trained.stdout), rel=1e-3)
  unknown = re.search(r"\| (\d+) tokens \| (\d+) unknown to the trained "
                      r"vocabulary, scored as <unk> \|", out.stdout)
  assert unknown and 0 < int(unknown.group(2)) < int(unknown.group(1))
  assert "unknown to the trained" not in trained.stdout
  missing = _cli(f"--workdir={workdir}", "--mode=eval",
                 "--config.data.source=text",
                 "--config.data.path=/nonexistent.txt")
  assert missing.returncode == 2 and "Traceback" not in missing.stderr
  errors = [l for l in missing.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "/nonexistent.txt" in errors[0], missing.stderr


def test_eval_text_file_scores_the_whole_file(char_run, tmp_path, capsys):
  """--text_file holding the test split's text scores what the test split
  does (the same ids, the same windows)."""
  cfg, workdir = char_run
  split = evaluate.run(cfg, workdir, "test")["test"]
  test_text = tmp_path / "test.txt"
  lines = open(cfg.data.path).read().splitlines(keepends=True)
  test_text.write_text("".join(lines[-15:]))  # demo's 5% of 300 lines
  capsys.readouterr()
  whole = evaluate.run(cfg, workdir, text_files=[str(test_text)])
  assert whole[str(test_text)]["loss"] == pytest.approx(split["loss"],
                                                        rel=1e-6)
  assert "| 0 unknown to the trained vocabulary" in capsys.readouterr().out
  with pytest.raises(UserError, match="does not exist"):
    evaluate.run(cfg, workdir, text_files=[str(tmp_path / "none.txt")])


def test_the_configuration_page_states_the_rule():
  """docs/configuration.md's table and list say what mode_fields holds."""
  with open(f"{REPO}/docs/configuration.md", encoding="utf-8") as f:
    page = f.read()
  section = page[page.index("## Overrides outside training"):]
  section = section[:section.index("\n## ", 1)]
  for mode in MODES:
    row = re.search(rf"^\| `{mode}` \| (.*) \|$", section, re.M)
    assert row, mode
    assert row.group(1).replace("\\*", "*").startswith(
        mode_fields.described(mode)), (mode, row.group(1))
  for field in mode_fields.FIXED:
    assert f"`{field}`" in section, field


def test_a_flag_the_mode_does_not_read_is_warned_about(tmp_path):
  out = _cli(f"--workdir={tmp_path}", "--mode=sample", "--text=hi",
             "--split=test")
  warnings = [l for l in out.stderr.splitlines() if l.startswith("warning:")]
  assert warnings == [
      "warning: --text: --mode=sample does not read it (it reads --prompt, "
      "--prompt_file): ignored",
      "warning: --split: --mode=sample does not read it (it reads --prompt, "
      "--prompt_file): ignored"], out.stderr
  assert out.returncode == 2 and "no config.json" in out.stderr


@pytest.mark.slow
def test_eval_of_another_wikitext_counts_unknown_words(tmp_path, capsys):
  """Word level: words the trained vocabulary lacks are scored as <unk>,
  and counted exactly."""
  cfg = tiny_word_config(write_wikitext(tmp_path / "wt"), head="full")
  cfg.train.update(num_steps=2, report_at_end=False)
  workdir = str(tmp_path / "run")
  loop.run(cfg, workdir)
  other = tmp_path / "other"
  other.mkdir()
  lines = [" the zebra sat on a quagga mat . \n", " the cat ran . \n"] * 40
  for split in ("train", "valid", "test"):
    (other / f"wiki.{split}.tokens").write_text("".join(lines))
  cfg.data.path = str(other)
  capsys.readouterr()
  trained = evaluate.run(tiny_word_config(tmp_path / "wt", head="full"),
                         workdir, "test")["test"]
  result = evaluate.run(cfg, workdir, "test")["test"]
  words = sum(len(line.split()) + 1 for line in lines)  # + <eos> a line
  (line,) = [l for l in capsys.readouterr().out.splitlines()
             if "unknown to the trained vocabulary" in l]
  assert str(other) in line and f"| {words} tokens | 80 unknown" in line
  assert result["loss"] != pytest.approx(trained["loss"], rel=1e-3)


def test_training_warns_about_a_field_its_source_does_not_read(capsys):
  cfg = arguments.load("train", "demo:tiny", None,
                       [("data.hf_name", "x/y"), ("data.tfds_name", "lm1b"),
                        ("data.source", "tfds")], needs_config=True)[0]
  assert cfg.data.source == "tfds"
  err = capsys.readouterr().err.splitlines()
  assert err == ["warning: --config.data.hf_name: read only with "
                 "data.source=hf, and this run has data.source='tfds': "
                 "ignored"], err
