"""End to end: the CLI in every mode on corpora the tests write, resume, errors."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from zebra_jax.configs import demo
from zebra_jax.errors import UserError
from zebra_jax.inference import loading, sample
from zebra_jax.training import evaluate, loop
from tests.helpers import REPO, tiny_word_config, write_wikitext


def _cli(*args, timeout=300, cwd=REPO):
  """Runs python -m zebra_jax.main with the test's 8-device environment."""
  return subprocess.run([sys.executable, "-m", "zebra_jax.main", *args],
                        capture_output=True, text=True, timeout=timeout,
                        cwd=cwd)


@pytest.mark.slow
def test_train_eval_sample_in_process(tmp_path):
  cfg = tiny_word_config(write_wikitext(tmp_path / "wt"))
  cfg.train.num_steps, cfg.train.eval_every = 80, 40
  workdir = str(tmp_path / "run")
  summary = loop.run(cfg, workdir)
  assert summary["steps"] == 80
  records = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
  train_losses = [r["loss"] for r in records if r["kind"] == "train"]
  assert train_losses[-1] < train_losses[0] - 0.5  # visibly learning
  assert os.path.exists(f"{workdir}/config.json")
  assert os.path.exists(f"{workdir}/tokenizer/tokenizer.zebra.json")

  results = evaluate.run(cfg, workdir)
  vocab = json.load(open(f"{workdir}/config.json"))["model"]["vocab_size"]
  for split in ("valid", "test"):
    assert np.isclose(results[split]["ppl"], np.exp(results[split]["loss"]))
    assert results[split]["ppl"] < vocab / 2  # far better than uniform
    assert 0.0 < results[split]["acc"] <= 1.0

  cfg.sample.update(prompt="the cat", max_new_tokens=8, temperature=0.0,
                    num_samples=2)
  texts = sample.run(cfg, workdir)
  assert len(texts) == 2 and texts[0] == texts[1]  # greedy: identical
  assert texts[0].startswith("the cat ")
  assert len(re.findall(r"[^ \n]+|\n", texts[0])) == 2 + 8  # <eos> is "\n"


@pytest.mark.slow
def test_eval_uses_best_checkpoint_and_matches_training_eval(tmp_path):
  cfg = tiny_word_config(write_wikitext(tmp_path / "wt"))
  cfg.train.eval_max_batches = 0  # score the whole split, as eval mode does
  cfg.eval.batch_size = 8
  workdir = str(tmp_path / "run")
  loop.run(cfg, workdir)
  records = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
  valid = {r["step"]: r["loss"] for r in records if r["kind"] == "valid"}
  best_step = min(valid, key=valid.get)
  loaded = loading.load_for_inference(cfg, workdir)
  assert loaded.step == best_step
  again = evaluate.run(cfg, workdir, splits_to_eval=("valid",))["valid"]
  assert again["loss"] == pytest.approx(valid[best_step], rel=1e-5)


@pytest.mark.slow
def test_cli_train_eval_sample_char_level(tmp_path):
  """Train from anywhere; later modes need only the workdir (runs/NAME)."""
  text = tmp_path / "story.txt"
  text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy "
                          f"dog.\n" for i in range(300)))
  out = _cli("--config=demo:tiny",
             "--config.data.source=text", f"--config.data.path={text}",
             "--config.train.report_at_end=false", cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  assert "| epoch 1 step 20 |" in out.stdout and "valid ppl" in out.stdout
  workdir = "--workdir=runs/demo-tiny"  # the default for demo:tiny
  assert (tmp_path / "runs" / "demo-tiny" / "config.json").is_file()
  out = _cli(workdir, "--mode=eval", cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  assert "| valid at step 20" in out.stdout and "| test at step 20" in out.stdout
  out = _cli(workdir, "--mode=sample", "--prompt=the quick",
             "--config.sample.seed=3", "--config.sample.max_new_tokens=12",
             cwd=tmp_path)
  again = _cli(workdir, "--mode=sample", "--config.sample.prompt=the quick",
               "--config.sample.seed", "3",
               "--config.sample.max_new_tokens=12", cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  assert "the quick" in out.stdout and out.stdout == again.stdout
  assert "temperature 0.8" in out.stdout  # the demo config's, from config.json


@pytest.mark.slow
def test_killed_run_resumes_from_its_checkpoint(tmp_path):
  data = write_wikitext(tmp_path / "wt")
  workdir = str(tmp_path / "run")
  args = ["--config=wt103:tiny", f"--workdir={workdir}",
          f"--config.data.path={data}", "--config.model.head=full",
          "--config.train.num_steps=100000",
          "--config.checkpoint.every_steps=10", "--config.train.eval_every=1000",
          "--config.train.log_every=10"]
  proc = subprocess.Popen([sys.executable, "-m", "zebra_jax.main", *args],
                          cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  deadline = time.time() + 120
  try:
    while time.time() < deadline:
      steps = [d for d in os.listdir(ckpt_dir) if d.isdigit()] if os.path.isdir(
          ckpt_dir) else []
      if any(int(s) >= 20 for s in steps):
        break
      time.sleep(0.2)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  saved = max(int(s) for s in os.listdir(ckpt_dir) if s.isdigit())
  assert saved >= 20
  out = _cli(*args[:-4], f"--config.train.num_steps={saved + 10}",
             "--config.train.log_every=5", "--config.train.report_at_end=false")
  assert out.returncode == 0, out.stderr
  assert f"resuming from checkpoint at step {saved}" in out.stdout
  assert f"step {saved + 5} |" in out.stdout  # continued, not from 0
  assert "| epoch 1 step 5 |" not in out.stdout


@pytest.mark.parametrize("override, message", [
    (["--config.model.num_stripes=3"], "not divisible by model.num_stripes=3"),
    (["--config.model.hidden_size=0"],
     "model.hidden_size=0 must be a positive whole number"),
    (["--config.model.dropout_hidden=1.5"], "outside [0, 1)"),
    (["--config.data.source=wikitext", "--config.data.path=/no/such/dir"],
     "/no/such/dir"),
    (["--config.data.batch_size=12"], "does not divide over 8 devices"),
    (["--config.model.hiden_size=64"],
     "model has no field 'hiden_size'; valid fields: adaptive_chunk_rows"),
    (["--config.model.head=bogus"],
     "--config.model.head='bogus' is not one of full, adaptive"),
    (["--config.model.head=adaptive", "--config.model.adaptive_cutoffs=(60,20)"],
     "model.adaptive_cutoffs=(60, 20) must be positive and strictly increasing"),
    (["--config.model.adaptive_div_val=0"],
     "model.adaptive_div_val=0 must be a positive whole number"),
])
def test_bad_config_gives_one_clear_line(tmp_path, override, message):
  out = _cli("--config=demo:tiny", f"--workdir={tmp_path}/run",
             *override)
  assert out.returncode != 0
  assert "Traceback" not in out.stderr
  errors = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and message in errors[0], out.stderr


def test_empty_corpus_and_eval_without_checkpoint(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(UserError, match="empty"):
    cfg = demo.get_config("tiny")
    cfg.data.source, cfg.data.path = "text", str(empty)
    loop.run(cfg, str(tmp_path / "a"))
  with pytest.raises(UserError, match="train first"):
    evaluate.run(demo.get_config("tiny"), str(tmp_path / "nothing"))
  os.makedirs(tmp_path / "b")
  with open(tmp_path / "b" / "config.json", "w") as f:
    json.dump(demo.get_config("tiny").to_dict(), f)
  with pytest.raises(UserError, match="no checkpoint"):
    sample.run(demo.get_config("tiny"), str(tmp_path / "b"))


@pytest.mark.slow
def test_workdir_with_other_tokenizer_or_model_is_rejected(tmp_path):
  cfg = tiny_word_config(write_wikitext(tmp_path / "wt"))
  cfg.train.num_steps = 2
  workdir = str(tmp_path / "run")
  loop.run(cfg, workdir)
  other = tiny_word_config(tmp_path / "wt")
  other.data.tokenizer = "char"
  with pytest.raises(UserError, match="tokenizer"):
    loop.run(other, workdir)
  bigger = tiny_word_config(tmp_path / "wt")
  bigger.model.hidden_size = 64
  with pytest.raises(UserError, match="model.hidden_size=32"):
    loop.run(bigger, workdir)


@pytest.mark.slow
def test_prompt_symbols_outside_the_vocabulary(tmp_path, caplog):
  cfg = tiny_word_config(write_wikitext(tmp_path / "wt"), head="full")
  cfg.train.num_steps = 2
  workdir = str(tmp_path / "run")
  loop.run(cfg, workdir)
  cfg.sample.update(prompt="the zebra", max_new_tokens=3)
  texts = sample.run(cfg, workdir)  # word level: <unk> and a warning
  assert texts[0].startswith("the zebra")
  assert "zebra" in caplog.text

  char_cfg = demo.get_config("tiny")
  char_dir = str(tmp_path / "char")
  char_cfg.train.num_steps = 2
  loop.run(char_cfg, char_dir)
  char_cfg.sample.prompt = "zebra \u2603"
  with pytest.raises(UserError, match="\u2603"):
    sample.run(char_cfg, char_dir)


def test_devices_seen_by_tests():
  assert jax.device_count() == 8  # conftest's emulated devices


def _greedy(*args, cwd):
  out = _cli(*args, "--mode=sample", "--config.sample.temperature=0",
             "--prompt=the quick", cwd=cwd)
  assert out.returncode == 0, out.stderr
  return out.stdout


@pytest.mark.slow
def test_overrides_apply_to_the_workdirs_config_json(char_run, tmp_path):
  """--config.sample.temperature=0 without --config: the same greedy text as
  with the config file the run was trained from."""
  cfg, workdir = char_run
  saved = _greedy(f"--workdir={workdir}", cwd=tmp_path)
  from_file = _greedy(f"--config={REPO}/zebra_jax/configs/demo.py:tiny",
                      f"--workdir={workdir}", "--config.data.source=text",
                      f"--config.data.path={cfg.data.path}", cwd=tmp_path)
  assert "temperature 0.0" in saved and saved == from_file


@pytest.mark.slow
def test_config_json_without_newer_fields_evaluates_and_samples(char_run,
                                                                tmp_path):
  """A workdir whose config.json predates the adaptive head, grouped stripes,
  the Pallas recurrence, stop/stream/chunk and the serve limits."""
  _, workdir = char_run
  old = str(tmp_path / "old")
  shutil.copytree(workdir, old)
  record = json.load(open(f"{old}/config.json"))
  for field in ("head", "stripe_input", "recurrence", "adaptive_cutoffs",
                "adaptive_div_val", "adaptive_tie", "adaptive_chunk_rows"):
    del record["model"][field]
  for field in ("stop", "stream", "chunk", "repetition_penalty"):
    del record["sample"][field]
  del record["serve"]
  with open(f"{old}/config.json", "w") as f:
    json.dump(record, f)
  out = _cli(f"--workdir={old}", "--mode=eval", "--split=valid", cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  new = _cli(f"--workdir={workdir}", "--mode=eval", "--split=valid",
             cwd=tmp_path)
  loss = lambda text: re.search(r"valid loss ([0-9.]+)", text).group(1)
  assert loss(out.stdout) == loss(new.stdout)
  assert _greedy(f"--workdir={old}", cwd=tmp_path) == _greedy(
      f"--workdir={workdir}", cwd=tmp_path)


@pytest.mark.parametrize("flag, field", [
    ("--temperature=0.7", "--config.sample.temperature=0.7"),
    ("--max_new_tokens=5", "--config.sample.max_new_tokens=5"),
    ("--stream", "--config.sample.stream"),
    ("--stream_chunk=4", "--config.sample.chunk=4"),
])
def test_removed_numeric_flag_names_its_config_field(tmp_path, flag, field):
  out = _cli("--mode=sample", f"--workdir={tmp_path}", flag, cwd=tmp_path)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  (line,) = out.stderr.strip().splitlines()
  assert line.startswith("error: ") and f"use {field}" in line, line


def test_modes_that_became_lab_scripts_name_their_command(tmp_path):
  out = _cli("--mode=infer_bench", f"--workdir={tmp_path}", cwd=tmp_path)
  assert out.returncode == 2
  (line,) = out.stderr.strip().splitlines()
  assert "python -m lab.infer_bench --workdir=DIR in a checkout" in line, line
