"""The comparison's outputs: table (markdown + JSON) and valid-ppl curves.

Kept apart from stripes_experiment.py so the numbers can be re-rendered from the
run records (results.json) without training anything.
"""

import json
import os
import platform
import statistics
from typing import Sequence

from zebra_jax.runtime import plots


def machine() -> str:
  """e.g. "x86_64, 2 CPU cores (Linux 6.1)": where the numbers were measured."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
      else os.cpu_count()
  return (f"{platform.machine()}, {cores} CPU cores "
          f"({platform.system()} {platform.release()})")


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 with a single seed)."""
  std = statistics.stdev(values) if len(values) > 1 else 0.0
  return statistics.fmean(values), std


def table(records: Sequence[dict]) -> list[dict]:
  """One row per setting, in the order settings first appear."""
  by_setting: dict[str, list[dict]] = {}
  for r in records:
    by_setting.setdefault(r["setting"], []).append(r)
  rows = []
  for name, runs in by_setting.items():
    first = runs[0]
    row = {"setting": name, "num_stripes": first["num_stripes"],
           "stripe_input": first["stripe_input"],
           "hidden_size": first["hidden_size"],
           "classic_matched": first["classic_matched"],
           "params": first["params"], "seeds": len(runs),
           # Stopped by the clock rather than at planned_steps: a load drop
           # after calibration can make a run finish its steps early.
           "budget_bound": sum(r["steps"] < r["planned_steps"] for r in runs)}
    for key in ("tok_per_s", "tokens_seen", "steps", "valid_ppl", "test_ppl"):
      row[key], row[key + "_std"] = _mean_std([r[key] for r in runs])
    rows.append(row)
  return rows


def markdown(rows: Sequence[dict]) -> str:
  lines = ["| stripes | hidden | params | train tok/s | tokens seen | steps "
           "| clock-bound | best valid ppl | test ppl |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in rows:
    stripes = f"{r['num_stripes']}" + (
        " grouped" if r["stripe_input"] == "grouped" else "") + (
        " (classic, = params)" if r["classic_matched"] else "")
    lines.append(
        f"| {stripes} | {r['hidden_size']} | {r['params']:,} "
        f"| {r['tok_per_s']:,.0f} ± {r['tok_per_s_std']:,.0f} "
        f"| {r['tokens_seen'] / 1e6:.2f}M | {r['steps']:.0f} "
        f"| {r['budget_bound']}/{r['seeds']} "
        f"| {r['valid_ppl']:.3f} ± {r['valid_ppl_std']:.3f} "
        f"| {r['test_ppl']:.3f} ± {r['test_ppl_std']:.3f} |")
  return "\n".join(lines)


def draw_curves(out_png: str, records: Sequence[dict], run_dirs: dict,
                title: str) -> str:
  """Valid ppl against wall-clock since launch: one colour per setting."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  names = list(dict.fromkeys(r["setting"] for r in records))
  runs, colors = [], []
  for r in records:
    run = plots.load_run(run_dirs[(r["setting"], r["seed"])], r["setting"])
    run.origin = r["launched"]  # The budget's clock: compile cache warm.
    runs.append(run)
    colors.append(cycle[names.index(r["setting"]) % len(cycle)])
  return plots.draw(runs, out_png, quantities=(("ppl", "valid perplexity"),),
                    x_axes=(("seconds", "wall-clock since launch (s)"),),
                    kinds=("valid",), colors=colors, title=title)


def write(out: str, records: Sequence[dict], meta: dict) -> dict:
  """results.md, results.json and valid_ppl_vs_time.png in out; returns all."""
  rows = table(records)
  text = markdown(rows)
  seeds = ",".join(str(s) for s in meta["seeds"])
  note = (f"{meta['budget_minutes']:g} min per run, seeds {seeds}, "
          f"{meta['machine']}, {meta['devices']}")
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(f"{text}\n\n{note}\n")
  run_dirs = {(r["setting"], r["seed"]): os.path.join(
      out, "runs", f"{r['setting']}_seed{r['seed']}") for r in records}
  title = (f"valid ppl, {meta['budget_minutes']:g} min per run, "
           f"{len(meta['seeds'])} seed(s) per setting")
  png = draw_curves(os.path.join(out, "valid_ppl_vs_time.png"), records,
                    run_dirs, title)
  results = {"meta": meta, "table": rows, "runs": list(records),
             "markdown": text, "png": png}
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  return results
