"""zebra_jax against PyTorch's word_language_model example, equal wall-clock.

  python -m lab.wlm_compare --seconds=180       # dense S=1, grouped S=8,
                                                # torch on every core and on 1,
                                                # in float32 and in bf16
  python -m lab.wlm_compare --rounds=2          # twice, the second in reverse
                                                # order: drift cancels
  python -m lab.wlm_compare --notorch_bf16      # torch in float32 only
  python -m lab.wlm_compare --trace             # where one step's time goes
  python -m lab.wlm_compare --quick             # tiny: a smoke test

The corpus, the recipes and how both sides are clocked:
lab/benchmarks/equal_time.py; the trace's parts: lab/benchmarks/step_split.py.
"""

import os
from typing import Sequence

from absl import flags, logging

from zebra_jax.cli import entry
from zebra_jax.errors import UserError


def _variant(name: str) -> str:
  return "" if name == "dense1" else name


def main(argv: Sequence[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  from lab.benchmarks import equal_time, step_split  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  unknown = set(f.variants) - {"dense1", "grouped8"}
  if unknown:
    raise UserError(f"--variants: {', '.join(sorted(unknown))} unknown: use "
                    "dense1 and/or grouped8")
  variants = [_variant(v) for v in f.variants]
  overrides = _overrides(f.jax_override)
  if f.trace:
    unused = [n for n in ("seconds", "threads", "torch_bf16", "json",
                          "rounds")
              if f[n].present]
    if unused:
      raise UserError(f"--trace times one JAX step alone: drop "
                      f"{', '.join('--' + n for n in unused)}, which set "
                      "the comparison's runs")
    sizes = equal_time.QUICK if f.quick else equal_time.FULL
    folder, _ = equal_time.word_corpus.prepare(sizes["target_tokens"],
                                               sizes["vocab_size"])
    for v in variants:
      cfg = equal_time.jax_config(v, folder, 60.0, sizes["width"], overrides)
      step_split.print_trace(step_split.trace_row(
          cfg, equal_time.VARIANTS[v], steps=5 if f.quick else 30,
          traced=2 if f.quick else 5))
    return
  if f.seconds <= 0:
    raise UserError(f"--seconds={f.seconds}: give a positive budget")
  if not f.threads or not all(t.isdigit() and int(t) >= 1
                              for t in f.threads):
    raise UserError(f"--threads={','.join(f.threads)}: give thread counts "
                    "of at least 1")
  if f.rounds < 1:
    raise UserError(f"--rounds={f.rounds}: give 1, or 2 or more to run "
                    "the rows again in reverse order")
  threads = [int(t) for t in f.threads]
  seconds = 2.0 if f.quick and not f["seconds"].present else f.seconds
  equal_time.run(seconds, variants, threads, f.quick, overrides, f.json,
                 f.torch_bf16, f.rounds)


def _overrides(texts: Sequence[str]) -> list[tuple[str, str]]:
  """--jax_override's SECTION.FIELD=VALUE texts as (field, value) pairs,
  which the JAX rows' config takes as --config.* overrides."""
  pairs = []
  for text in texts:
    field, sep, value = text.partition("=")
    if not sep:
      raise UserError(f"--jax_override={text}: give SECTION.FIELD=VALUE, "
                      "e.g. model.recurrence=scan")
    pairs.append((field, value))
  return pairs


def _define_flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count())
  flags.DEFINE_float("seconds", 180.0, "Training seconds per side.")
  flags.DEFINE_list("variants", ["dense1", "grouped8"], "configs/wlm.py "
                    "variants of the JAX rows: dense1 (S=1) and/or grouped8 "
                    "(S=8, grouped input).")
  flags.DEFINE_list("threads", [str(t) for t in sorted({cores, 1})[::-1]],
                    "torch rows' thread counts, one row each; ratios are "
                    "to the faster (XLA uses every core it sees).")
  flags.DEFINE_integer("rounds", 1, "Run every row this many times, "
                       "every other round in reverse order: with an even "
                       "count each row's runs sit symmetrically about the "
                       "middle of the whole run, so a machine whose pace "
                       "drifts steadily slows every row alike. Rows report "
                       "tok/s over all their rounds.")
  flags.DEFINE_multi_string("jax_override", [], "SECTION.FIELD=VALUE set on "
                            "the JAX rows' config, e.g. "
                            "model.recurrence=scan, read as --config.* is "
                            "(an unknown field or a wrong type: one error "
                            "line).")
  flags.DEFINE_bool("torch_bf16", True, "Also run the example under "
                    "torch.autocast(bfloat16) at each thread count: the "
                    "like-for-like reference of configs/wlm.py's bf16 "
                    "products (its own ratio column).")
  flags.DEFINE_bool("trace", False, "Split one step of each JAX row into "
                    "head, recurrence, projections, optimizer, data, host.")
  flags.DEFINE_bool("quick", False, "A tiny corpus and model, 2 s a side "
                    "(unless --seconds says otherwise): a smoke test.")
  flags.DEFINE_string("json", None, "Also write the results here.")


if __name__ == "__main__":
  _define_flags()
  entry.run_tool(main)
