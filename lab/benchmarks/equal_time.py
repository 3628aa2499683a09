"""zebra_jax against PyTorch's word_language_model example at equal wall-clock.

Run by `python -m lab.wlm_compare`.

Both sides read the same WikiText-layout folder (word_corpus: ~1M tokens of
real English, a 10,000-word vocabulary) and train for the same `seconds`:
  torch   the example's recipe (word_lm.train_for), its clock around the
          training windows only
  jax     `training.loop.run`, the code `--mode=train` runs, on
          configs/wlm.py (or a variant) with train.time_budget_minutes set;
          its clock starts before the first step, so compiling counts
          against it. No evaluation or save happens inside the budget.
Then each scores valid once with its final weights, the example's way
(batch 10, windows of 35, the state carried). tokens/s is tokens trained
over training seconds. torch runs once per thread count asked for (the
tool's default: every core, and 1): on a shared machine its threads can
spin on each other, so a row's ratio is its tokens/s over the faster torch
row's, as lab.train_bench keeps the faster of 1 and 2 threads. With
--torch_bf16 the example runs again at each thread count under
torch.autocast(bfloat16) (oneDNN's bf16 kernels where the CPU has them):
the reference for JAX rows that multiply in bf16 (configs/wlm.py's head
and window products), in its own ratio column beside float32's.
"""

import contextlib
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Sequence

import ml_collections

from lab.benchmarks import torch_reference, word_corpus, word_lm
from lab.benchmarks.table import (load_column, print_and_save, print_rows,
                                 ratio_text)
from zebra_jax.cli import overrides as config_overrides
from zebra_jax.errors import UserError

FULL = dict(target_tokens=1_100_000, vocab_size=10_000, width=200)
QUICK = dict(target_tokens=60_000, vocab_size=2_000, width=32)
VARIANTS = {"": "jax_S1_dense", "grouped8": "jax_S8_grouped"}
_NEVER = 10 ** 9  # a step count no budget reaches


def jax_config(variant: str, folder: str, seconds: float, width: int,
               overrides: Sequence[tuple[str, str]] = ()
               ) -> ml_collections.ConfigDict:
  """configs/wlm.py's variant on `folder`, stopped by the time budget alone,
  with `overrides` ((field, text) pairs) read as --config.* reads them."""
  from zebra_jax.configs import wlm  # pylint: disable=g-import-not-at-top
  cfg = wlm.get_config(variant)
  cfg.data.path = folder
  cfg.model.update(embed_size=width, hidden_size=width)
  cfg.train.update(num_steps=_NEVER, time_budget_minutes=seconds / 60.0,
                   eval_every=_NEVER, eval_max_batches=0, log_every=50,
                   sample_at_eval=False)
  cfg.eval.accuracy = False  # the example counts no accuracy
  cfg.checkpoint.every_steps = _NEVER
  try:
    config_overrides.apply(cfg, list(overrides))
  except UserError as e:
    raise UserError(f"--jax_override: {e}") from None
  return cfg


def _records(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def jax_row(cfg: ml_collections.ConfigDict, name: str) -> dict:
  """One budgeted `loop.run`; its training seconds, tokens and valid ppl."""
  from zebra_jax.training import loop  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix="wlm_compare_") as workdir:
    load_before = os.getloadavg()[0]
    with contextlib.redirect_stdout(sys.stderr):  # the loop's log: stderr
      summary = loop.run(cfg, workdir)
    load_after = os.getloadavg()[0]
    records = _records(workdir)
  valid = [r for r in records if r["kind"] == "valid"][-1]
  steady = [r["tok_per_s"] for r in records if r["kind"] == "train"][1:]
  tokens = summary["steps"] * cfg.data.batch_size * cfg.data.seq_len
  return {"name": name, "side": "jax", "seconds": valid["train_s"],
          "steps": summary["steps"], "tokens": tokens,
          "tokens_per_s": tokens / valid["train_s"],
          "steady_tokens_per_s": statistics.median(steady) if steady else None,
          "valid_loss": valid["loss"], "valid_ppl": valid["ppl"],
          "stripes": cfg.model.num_stripes,
          "stripe_input": cfg.model.stripe_input,
          "recurrence": cfg.model.recurrence,
          "load_before": load_before, "load_after": load_after}


def torch_row(folder: str, seconds: float, threads: int, width: int,
              autocast_bf16: bool = False) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  corpus = word_lm.Corpus(folder, word_corpus.SPLIT_FILES)
  row = word_lm.train_for(torch, corpus, seconds, threads,
                          p=dict(emsize=width, nhid=width),
                          autocast_bf16=autocast_bf16)
  row["name"] = f"torch{'_bf16' if autocast_bf16 else ''}_{threads}thread"
  row["torch"] = torch.__version__ + (
      f", {torch_reference.autocast_note()}" if autocast_bf16 else "")
  return row


def round_orders(count: int, rounds: int) -> list[list[int]]:
  """The rows' order in each round: as given, then reversed, and so on.

  Over an even number of rounds every row's runs sit symmetrically about
  the middle of the whole run (ABBA), so a machine whose pace drifts
  steadily through it slows every row alike, and the ratios hold."""
  forward = list(range(count))
  return [forward if r % 2 == 0 else forward[::-1] for r in range(rounds)]


def combined(runs: Sequence[dict]) -> dict:
  """One row from its rounds: tokens over training seconds, all rounds
  together; valid perplexity from the rounds' mean valid loss (each round
  trains afresh for the same seconds); each round's own figures kept."""
  if len(runs) == 1:
    return runs[0]
  row = dict(runs[0])
  tokens = sum(r["tokens"] for r in runs)
  seconds = sum(r["seconds"] for r in runs)
  loss = statistics.fmean(r["valid_loss"] for r in runs)
  steady = [r["steady_tokens_per_s"] for r in runs
            if r.get("steady_tokens_per_s")]
  row.update(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
             steps=sum(r["steps"] for r in runs), valid_loss=loss,
             valid_ppl=math.exp(loss),
             steady_tokens_per_s=statistics.median(steady) if steady else None,
             load_before=runs[0]["load_before"],
             load_after=runs[-1]["load_after"],
             rounds=[{k: r[k] for k in ("tokens_per_s", "valid_ppl",
                                        "started_s")} for r in runs])
  return row


def run(seconds: float, variants, threads: Sequence[int], quick: bool = False,
        overrides: Sequence[tuple[str, str]] = (),
        json_path: str | None = None, torch_bf16: bool = False,
        rounds: int = 1) -> dict:
  """Every JAX variant, then the torch example at each thread count (and
  with torch_bf16, again under torch.autocast(bfloat16)), `rounds` times
  (round_orders); prints the table. Ratios are to the faster float32 torch
  row, and to the faster bf16 one."""
  sizes = QUICK if quick else FULL
  folder, manifest = word_corpus.prepare(sizes["target_tokens"],
                                         sizes["vocab_size"])
  width = sizes["width"]
  runners = [functools.partial(
      jax_row, jax_config(v, folder, seconds, width, overrides),
      VARIANTS.get(v, f"jax_{v}")) for v in variants]
  runners += [functools.partial(torch_row, folder, seconds, t, width)
              for t in threads]
  runners += [functools.partial(torch_row, folder, seconds, t, width,
                                autocast_bf16=True)
              for t in (threads if torch_bf16 else ())]
  runs = [[] for _ in runners]
  start = time.perf_counter()
  for order in round_orders(len(runners), rounds):
    for i in order:
      started = time.perf_counter() - start
      runs[i].append({**runners[i](), "started_s": started})
  rows = [combined(r) for r in runs]
  references = [r for r in rows
                if r["side"] == "torch" and not r["autocast_bf16"]]
  bf16 = [r for r in rows if r.get("autocast_bf16")]
  fastest = max(references, key=lambda r: r["tokens_per_s"])
  fastest_bf16 = max(bf16, key=lambda r: r["tokens_per_s"], default=None)
  for r in rows:
    r["ratio_to_torch"] = r["tokens_per_s"] / fastest["tokens_per_s"]
    r["ratio_to_torch_bf16"] = fastest_bf16 and (
        r["tokens_per_s"] / fastest_bf16["tokens_per_s"])
  result = {"seconds": seconds, "rounds": rounds, "threads": list(threads),
            "jax_overrides": [f"{k}={v}" for k, v in overrides],
            "cpus": os.cpu_count(), "corpus": {"folder": folder, **manifest},
            "width": width, "rows": rows}
  return print_and_save(result, print_table, json_path)


def print_table(result: dict) -> None:
  c = result["corpus"]
  rounds = result.get("rounds", 1)
  print(f"\nequal wall-clock, {result['seconds']:g} s of training a side"
        + (f" in each of {rounds} rounds (every other one in reverse order)"
           if rounds > 1 else "") + " | "
        f"{c['tokens']['train']:,} train / {c['tokens']['valid']:,} valid "
        f"tokens, vocab {c['vocab_size']:,} | 2 x {result['width']} LSTM, "
        f"batch 20, bptt 35 | torch {'/'.join(map(str, result['threads']))}"
        f" threads, XLA {result['cpus']} cores; x torch: to the faster "
        "float32 torch row; x torch bf16: to the faster row under "
        "torch.autocast(bfloat16)")
  bf16 = any(r.get("ratio_to_torch_bf16") for r in result["rows"])
  print_rows(result["rows"], [
      ("row", 21, lambda r: r["name"]),
      ("tok/s", 10, lambda r: f"{r['tokens_per_s']:,.0f}"),
      ("x torch", 9, lambda r: ratio_text(r["ratio_to_torch"])),
      *([("x torch bf16", 14,
          lambda r: ratio_text(r["ratio_to_torch_bf16"]))] if bf16 else []),
      ("valid ppl", 11, lambda r: f"{r['valid_ppl']:.2f}"),
      ("steps", 8, lambda r: f"{r['steps']:,}"),
      ("train s", 9, lambda r: f"{r['seconds']:.1f}"),
      ("steady tok/s", 14, lambda r: (f"{r['steady_tokens_per_s']:,.0f}"
                                      if r.get("steady_tokens_per_s")
                                      else "-")),
      *([("rounds' tok/s", 18, lambda r: " / ".join(
          f"{x['tokens_per_s']:,.0f}" for x in r["rounds"]))]
        if rounds > 1 else []),
      load_column()])
  for torch_side in (r for r in result["rows"] if r["side"] == "torch"):
    print(f"note: {torch_side['name']} ({torch_side['torch']}): "
          f"{torch_side['epochs']:.2f} epochs, lr {torch_side['lr_final']:g}"
          f" at the end (divided by 4 after epochs "
          f"{torch_side['anneal_epochs'] or 'none'})")
  print("note: jax: lr 20 throughout, compiling inside its budget")
  if result.get("jax_overrides"):
    print(f"note: jax rows: configs/wlm.py with "
          f"{', '.join(result['jax_overrides'])}")
  if rounds > 1:
    print("note: tok/s over all rounds' training seconds; valid ppl from "
          "the rounds' mean valid loss, each round trained afresh")
  if not any(r.get("autocast_bf16") for r in result["rows"]):
    print("note: the JAX rows multiply in bf16 where the CPU has the units "
          "(configs/wlm.py), the torch rows in float32: --torch_bf16 adds "
          "the example under torch.autocast(bfloat16), their like-for-like "
          "reference")
