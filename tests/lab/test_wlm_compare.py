"""lab.wlm_compare: both sides read the same words, the trace's parts add up
to the busy time, and `--quick` runs every row end to end. No timing
assertions: the machines are shared and noisy."""

import json
import math
import os
import subprocess
import sys

import pytest

from lab.benchmarks import equal_time, step_split, traces, word_corpus, word_lm
from zebra_jax.errors import UserError
from tests.helpers import REPO


def test_torch_corpus_and_zebra_tokenizer_find_the_same_words(tmp_path):
  from zebra_jax.data.tokenizers import word  # pylint: disable=g-import-not-at-top
  sizes = equal_time.QUICK
  folder, manifest = word_corpus.prepare(sizes["target_tokens"],
                                         sizes["vocab_size"], str(tmp_path))
  corpus = word_lm.Corpus(folder, word_corpus.SPLIT_FILES)
  with open(f"{folder}/wiki.train.tokens", encoding="utf8") as f:
    tokenizer = word.WordTokenizer.build(f.read())
  assert set(corpus.word2idx) == set(tokenizer.vocab)
  assert len(corpus.word2idx) == sizes["vocab_size"]
  assert {s: len(ids) for s, ids in corpus.ids.items()} == manifest["tokens"]
  # Prepared again: the same folder, not rebuilt.
  assert word_corpus.prepare(sizes["target_tokens"], sizes["vocab_size"],
                             str(tmp_path))[0] == folder


def test_overlapping_ops_share_each_instant():
  seconds, busy = step_split.partition(
      [(0.0, 2.0, "head"), (1.0, 3.0, "recurrence"), (5.0, 6.0, "optimizer")])
  assert busy == pytest.approx(4.0)
  assert seconds["head"] == pytest.approx(1.5)
  assert seconds["recurrence"] == pytest.approx(1.5)
  assert seconds["optimizer"] == pytest.approx(1.0)
  assert sum(seconds.values()) == pytest.approx(busy)


def test_ops_are_given_to_the_parts_by_scope_and_kind():
  assert step_split.op_part("custom-call.3", "jit(f)/zebra_lstm_0/x") == (
      "recurrence")
  assert step_split.op_part("dot.1", "jit(f)/zebra_lstm_1/dot") == (
      "projections")
  assert step_split.op_part("fusion.2", "jit(f)/transpose(jvp(head))/x") == (
      "head")
  assert step_split.op_part("fusion.9", "jit(f)/optimizer/mul") == "optimizer"
  assert step_split.op_part("while.1", "jit(f)/zebra_lstm_0/while") is None
  # The native bf16 matmul's calls are matmuls, not time loops.
  hlo = ('%ffi_call.31 = f32[700,800]{1,0} custom-call(%a, %b), '
         'custom_call_target="zebra_bf16_matmul_0123456789ab"\n'
         '%ffi_call.2 = f32[1]{0} custom-call(%c), '
         'custom_call_target="zebra_native_forward_0123456789ab"\n')
  calls = traces.bf16_matmul_calls(hlo)
  assert calls == {"ffi_call.31"}
  assert step_split.op_part("ffi_call.31", "jit(f)/zebra_lstm_0/x",
                            calls) == "projections"
  assert step_split.op_part("ffi_call.2", "jit(f)/zebra_lstm_0/x",
                            calls) == "recurrence"


def _quick_run(path, *flags):
  """`lab.wlm_compare --quick` with `flags`, its JSON at `path`: (stdout,
  the result). Needs torch, for the example's side."""
  pytest.importorskip(
      "torch", reason="the example's recipe runs in PyTorch: pip install torch")
  out = subprocess.run(
      [sys.executable, "-m", "lab.wlm_compare", "--quick", *flags,
       f"--json={path}"],
      capture_output=True, text=True, timeout=600, cwd=REPO,
      env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           "JAX_PLATFORMS": "cpu"})  # one CPU device: batch 20 is the recipe's
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout, json.loads(path.read_text())


@pytest.mark.slow
def test_quick_run_reports_every_row(tmp_path):
  stdout, result = _quick_run(tmp_path / "wlm.json", "--threads=2,1",
                              "--torch_bf16")
  assert "x torch" in stdout
  rows = {r["name"]: r for r in result["rows"]}
  assert set(rows) == {"jax_S1_dense", "jax_S8_grouped", "torch_2thread",
                       "torch_1thread", "torch_bf16_2thread",
                       "torch_bf16_1thread"}
  for r in rows.values():
    assert r["tokens_per_s"] > 0 and math.isfinite(r["valid_ppl"])
    assert r["seconds"] >= result["seconds"]
  assert [n for n, r in rows.items() if r.get("autocast_bf16")] == [
      "torch_bf16_2thread", "torch_bf16_1thread"]
  # Ratios are to the faster float32 torch row, and to the faster bf16 one.
  for tag, key in (("", "ratio_to_torch"), ("_bf16", "ratio_to_torch_bf16")):
    ratios = [rows[f"torch{tag}_{t}thread"][key] for t in (1, 2)]
    assert max(ratios) == 1.0 and min(ratios) <= 1.0
  fastest_bf16 = max(rows[f"torch_bf16_{t}thread"]["tokens_per_s"]
                     for t in (1, 2))
  for r in rows.values():
    assert r["ratio_to_torch_bf16"] == pytest.approx(
        r["tokens_per_s"] / fastest_bf16)


def _drifting_rounds(speeds, rounds):
  """Each row's runs on a machine whose pace falls steadily, 1% a run's
  length: tokens = speed x the pace integrated over the run."""
  pace = lambda t: 1.0 - 0.01 * t  # t in runs' lengths
  runs = [[] for _ in speeds]
  t = 0.0
  for order in equal_time.round_orders(len(speeds), rounds):
    for i in order:
      tokens = speeds[i] * (pace(t) + pace(t + 1)) / 2
      runs[i].append({"tokens": tokens, "seconds": 1.0,
                      "tokens_per_s": tokens, "steps": 1,
                      "valid_loss": 4.0 + i, "valid_ppl": math.exp(4.0 + i),
                      "load_before": t, "load_after": t + 1,
                      "started_s": t})
      t += 1
  return [equal_time.combined(r) for r in runs]


def test_reversed_rounds_cancel_a_steady_drift():
  """Rows of true speeds 3 : 2 : 1 on a machine that slows as it runs:
  one round favours the first row, two rounds (ABBA) give 3 : 2 : 1."""
  assert equal_time.round_orders(3, 3) == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
  one = _drifting_rounds([3.0, 2.0, 1.0], 1)
  assert one[0]["tokens_per_s"] / one[2]["tokens_per_s"] > 3.05
  two = _drifting_rounds([3.0, 2.0, 1.0], 2)
  ratios = [r["tokens_per_s"] / two[2]["tokens_per_s"] for r in two]
  assert ratios == pytest.approx([3.0, 2.0, 1.0], rel=1e-12)
  first = two[0]
  assert first["seconds"] == 2.0 and first["steps"] == 2
  assert [r["started_s"] for r in first["rounds"]] == [0.0, 5.0]
  assert first["valid_ppl"] == pytest.approx(math.exp(4.0))
  assert (first["load_before"], first["load_after"]) == (0.0, 6.0)


@pytest.mark.slow
def test_two_rounds_run_every_row_again_in_reverse(tmp_path):
  stdout, result = _quick_run(tmp_path / "wlm.json", "--rounds=2",
                              "--seconds=3", "--variants=dense1",
                              "--threads=1", "--notorch_bf16")
  assert "in each of 2 rounds" in stdout
  rows = {r["name"]: r for r in result["rows"]}
  jax_row, torch_row = rows["jax_S1_dense"], rows["torch_1thread"]
  starts = lambda r: [x["started_s"] for x in r["rounds"]]
  # jax, torch | torch, jax
  assert starts(jax_row)[0] < starts(torch_row)[0] < starts(torch_row)[1] < (
      starts(jax_row)[1])
  for r in (jax_row, torch_row):
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert r["seconds"] >= 2 * 3.0  # --seconds kept beside --quick
  assert torch_row["ratio_to_torch"] == 1.0


def test_jax_overrides_are_read_as_config_overrides(tmp_path):
  """--jax_override goes through --config.*'s reader: typed values, and an
  unknown field is an error rather than a field the run never reads."""
  cfg = equal_time.jax_config("", str(tmp_path), 60.0, 32,
                              [("model.cpu_bf16_recurrence", "off"),
                               ("model.unroll", "2")])
  assert cfg.model.cpu_bf16_recurrence == "off" and cfg.model.unroll == 2
  with pytest.raises(UserError, match=r"^--jax_override: --config.model."
                     r"cpu_bf16_recurence: model has no field"):
    equal_time.jax_config("", str(tmp_path), 60.0, 32,
                          [("model.cpu_bf16_recurence", "off")])


def test_the_wlm_config_trains_a_few_steps(tmp_path):
  """configs/wlm.py's tiny variant through the real loop: SGD at lr 20 with
  clipping keeps the loss finite."""
  from zebra_jax.configs import wlm  # pylint: disable=g-import-not-at-top
  from zebra_jax.training import loop  # pylint: disable=g-import-not-at-top
  folder, _ = word_corpus.prepare(equal_time.QUICK["target_tokens"],
                                  equal_time.QUICK["vocab_size"],
                                  str(tmp_path))
  cfg = wlm.get_config("tiny")
  cfg.data.path = folder
  cfg.train.sample_at_eval = False
  summary = loop.run(cfg, str(tmp_path / "run"))
  assert summary["steps"] == cfg.train.num_steps
  assert math.isfinite(summary["best_valid_ppl"])


def test_trace_refuses_the_comparisons_flags():
  """--trace runs one JAX step alone: a flag that only sets the comparison's
  runs is refused with one line, not dropped."""
  out = subprocess.run(
      [sys.executable, "-m", "lab.wlm_compare", "--trace", "--quick",
       "--seconds=5", "--notorch_bf16", "--rounds=2"],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert out.returncode == 2, out.stderr[-2000:]
  errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "--seconds, --torch_bf16, --rounds" in errors[0], (
      out.stderr[-2000:])
  assert "Traceback" not in out.stderr
  out = subprocess.run(
      [sys.executable, "-m", "lab.wlm_compare", "--trace", "--quick",
       "--jax_override=model.recurrence"],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert "error: --jax_override=model.recurrence: give SECTION.FIELD=VALUE" in (
      out.stderr), out.stderr[-2000:]
