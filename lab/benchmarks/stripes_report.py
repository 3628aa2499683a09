"""The comparison's outputs: table (markdown + JSON), claims and the curves.

Kept apart from stripes_experiment.py so the numbers can be re-rendered from the
run records (results.json, which holds every run's valid curve) without
training anything.

Time to a perplexity: the first in-loop valid evaluation at or below the
target, interpolated (log perplexity, linear in training seconds) from the
evaluation before it. A claim is written only where the seeds' ranges
(min to max) of the two settings do not overlap.
"""

import math
import os
import platform
import statistics
from typing import Sequence

from zebra_jax import strict_json


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


def time_to(curve: Sequence[dict], target: float) -> float | None:
  """Training seconds at which the valid curve first reaches `target`."""
  before = None
  for point in curve:
    if point["ppl"] <= target:
      if before is None:
        return point["train_s"]
      t0, t1 = before["train_s"], point["train_s"]
      l0, l1 = math.log(before["ppl"]), math.log(point["ppl"])
      return t0 + (t1 - t0) * (l0 - math.log(target)) / (l0 - l1)
    before = point
  return None


def _is_classic(record: dict) -> bool:
  return record["num_stripes"] == 1 and not record.get("role")


def auto_targets(records: Sequence[dict]) -> list[float]:
  """Where the classic LSTM ends, and 1.25x that: the highest final curve
  perplexity over its seeds (so every classic seed reaches it), rounded up
  to 0.01. The tight target asks whether a striped setting gets where the
  classic one ends, and how much sooner; the loose one how fast everything
  gets most of the way."""
  finals = [r["curve"][-1]["ppl"] for r in records
            if _is_classic(r) and r.get("curve")]
  if not finals:
    return []
  up = lambda x: math.ceil(100 * x - 1e-9) / 100
  return [up(1.25 * max(finals)), up(max(finals))]


# A setting timed this far (as a fraction) off its calibration is named.
CALIBRATION_TOLERANCE = 0.15


def calibration_misses(records: Sequence[dict], calibrated: dict,
                       tolerance: float = CALIBRATION_TOLERANCE) -> list[str]:
  """Settings whose timed runs ran at another speed than their calibration.

  The plan's step counts and equal-time widths come from a short calibration
  run per setting; a calibration disturbed by other load on the machine
  shows up here, as the timed runs' median steps/s against the calibrated
  one, so the report says which equal-time width to distrust.
  """
  timed: dict[str, list[float]] = {}
  for r in records:
    if r.get("steps") and r.get("tokens_seen") and r.get("tok_per_s"):
      tokens_per_step = r["tokens_seen"] / r["steps"]
      timed.setdefault(r["setting"], []).append(r["tok_per_s"]
                                                / tokens_per_step)
  lines = []
  for name, rates in timed.items():
    planned, rate = calibrated.get(name), statistics.median(rates)
    if planned and abs(rate / planned - 1) > tolerance:
      lines.append(f"- {name}: calibrated at {planned:.2f} steps/s, timed "
                   f"runs at {rate:.2f} ({rate / planned:.2f}x)")
  return lines


def label(row: dict) -> str:
  if row["num_stripes"] == 1:
    return "classic" + (", params matched" if row.get("role") else "")
  kind = "grouped" if row["stripe_input"] == "grouped" else "dense"
  equal = ", = classic step time" if row.get("role") == "equal_time" else ""
  return f"{kind} S={row['num_stripes']}{equal}"


def table(records: Sequence[dict], targets: Sequence[float] = ()) -> list[dict]:
  """One row per setting, in the order settings first appear."""
  by_setting: dict[str, list[dict]] = {}
  for r in records:
    by_setting.setdefault(r["setting"], []).append(r)
  rows = []
  for name, runs in by_setting.items():
    first = runs[0]
    row = {"setting": name, "num_stripes": first["num_stripes"],
           "stripe_input": first["stripe_input"],
           "role": first.get("role", ""),
           "hidden_size": first["hidden_size"],
           "params": first["params"], "seeds": len(runs),
           # Stopped by the clock rather than at planned_steps: a load drop
           # after calibration can make a run finish its steps early.
           "budget_bound": sum(r["steps"] < r["planned_steps"] for r in runs)}
    for key in ("tok_per_s", "tokens_seen", "steps", "valid_ppl", "test_ppl",
                "startup_s", "train_s"):
      values = [r[key] for r in runs if key in r]
      if values:
        row[key], row[key + "_std"] = _mean_std(values)
    for key in ("valid_ppl", "test_ppl"):
      row[key + "_range"] = [min(r[key] for r in runs),
                             max(r[key] for r in runs)]
    row["to_target"] = []
    for target in targets:
      times = [time_to(r.get("curve", []), target) for r in runs]
      reached = [t for t in times if t is not None]
      entry = {"target": target, "seconds": times, "reached": len(reached)}
      if reached:
        entry["mean"], entry["std"] = _mean_std(reached)
        entry["range"] = [min(reached), max(reached)]
      row["to_target"].append(entry)
    rows.append(row)
  return rows


def _cell(mean, std, fmt="{:,.0f}") -> str:
  return f"{fmt.format(mean)} ± {fmt.format(std)}"


def markdown(rows: Sequence[dict], targets: Sequence[float] = ()) -> str:
  reach = "".join(f" | s to ppl {t:g}" for t in targets)
  lines = [f"| setting | hidden | params | train tok/s | start-up s | train s "
           f"| steps | clock-bound{reach} | best valid ppl | test ppl |",
           "| --- |" + " ---: |" * (9 + len(targets))]
  for r in rows:
    cells = [label(r), str(r["hidden_size"]), f"{r['params']:,}",
             _cell(r["tok_per_s"], r["tok_per_s_std"]),
             _cell(r["startup_s"], r["startup_s_std"], "{:.1f}")
             if "startup_s" in r else "",
             _cell(r["train_s"], r["train_s_std"]) if "train_s" in r else "",
             f"{r['steps']:.0f}", f"{r['budget_bound']}/{r['seeds']}"]
    for entry in r["to_target"]:
      if not entry["reached"]:
        cells.append(f"not reached (0/{r['seeds']})")
      else:
        missed = (f" ({entry['reached']}/{r['seeds']})"
                  if entry["reached"] < r["seeds"] else "")
        cells.append(_cell(entry["mean"], entry["std"]) + missed)
    cells += [_cell(r["valid_ppl"], r["valid_ppl_std"], "{:.3f}"),
              _cell(r["test_ppl"], r["test_ppl_std"], "{:.3f}")]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _separate(a: Sequence[float], b: Sequence[float]) -> bool:
  return max(a) < min(b) or max(b) < min(a)


def best_classic(rows: Sequence[dict]) -> dict | None:
  """The classic (S = 1) setting, of any width, with the lowest valid ppl."""
  return min((r for r in rows if r["num_stripes"] == 1),
             key=lambda r: r["valid_ppl"], default=None)


def _called(row: dict) -> str:
  """How a claim names the setting it is measured against."""
  if row["num_stripes"] == 1:
    return f"the classic LSTM at hidden {row['hidden_size']}"
  return f"{label(row)} (hidden {row['hidden_size']})"


def _compare(r: dict, base: dict, overlaps: bool = True) -> list[str]:
  """`r` against `base`: per target and for the final test ppl, a claim where
  the seeds' ranges separate, "no claim" where they overlap (if `overlaps`)."""
  name, them = _called(r), _called(base)
  lines = []
  for mine, theirs in zip(r["to_target"], base["to_target"]):
    if mine["reached"] < r["seeds"] or theirs["reached"] < base["seeds"]:
      continue  # a seed that never got there has no time to compare
    if _separate(mine["range"], theirs["range"]):
      lines.append(f"- {name} reaches valid ppl {mine['target']:g} in "
                   f"{100 * mine['mean'] / theirs['mean']:.0f}% of the "
                   f"training time of {them} ({mine['mean']:.0f} s "
                   f"against {theirs['mean']:.0f} s; the seeds' ranges "
                   f"separate).")
    elif overlaps:
      lines.append(f"- {name} and {them} reach valid ppl "
                   f"{mine['target']:g} in overlapping times: no claim.")
  if _separate(r["test_ppl_range"], base["test_ppl_range"]):
    better = r["test_ppl"] < base["test_ppl"]
    lines.append(f"- {name} ends at a {'lower' if better else 'higher'} "
                 f"test ppl than {them} ({r['test_ppl']:.2f} against "
                 f"{base['test_ppl']:.2f}; ranges separate).")
  elif overlaps:
    lines.append(f"- {name} and {them} end at overlapping test ppl: no "
                 f"claim.")
  return lines


def claims(rows: Sequence[dict], base: dict | None = None) -> list[str]:
  """Each setting against `base` (default: the classic LSTM at the config's
  width), where the seeds' ranges separate; the rest are listed as not
  separated. Against another base only striped settings are compared."""
  at_width = base is None
  base = next((r for r in rows if _is_classic(r)), None) if at_width else base
  if base is None or base["seeds"] < 2:
    return []
  lines = []
  for r in rows:
    if r is base or r["seeds"] < 2 or (not at_width and r["num_stripes"] == 1):
      continue
    lines += _compare(r, base)
  return lines


def between_striped(rows: Sequence[dict]) -> list[str]:
  """Every pair of striped settings: what separates them, the later setting
  of the table against the earlier. Choosing a default among striped
  settings needs these; a pair that separates in no column says so once."""
  striped = [r for r in rows if r["num_stripes"] > 1 and r["seeds"] >= 2]
  lines = []
  for i, base in enumerate(striped):
    for r in striped[i + 1:]:
      lines += _compare(r, base, overlaps=False) or [
          f"- {_called(r)} and {_called(base)}: "
          "no column separates, no claim."]
  return lines


def line_style(i: int, colors: Sequence[str]) -> tuple[str, str]:
  """Setting i's (colour, line style): past the last colour the colours come
  round again dashed, so no two of up to 4 x len(colors) settings look alike."""
  return colors[i % len(colors)], ("-", "--", "-.", ":")[i // len(colors) % 4]


def draw_bands(out_png: str, records: Sequence[dict],
               targets: Sequence[float], title: str) -> str:
  """Valid ppl against training seconds: per setting, the geometric mean of
  its seeds' curves and a band from the lowest to the highest."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  from matplotlib import ticker
  import numpy as np
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  fig, ax = plt.subplots(figsize=(9, 5.5))
  for i, row in enumerate(table(records)):
    curves = [r["curve"] for r in records
              if r["setting"] == row["setting"] and r.get("curve")]
    if not curves:
      continue
    color, style = line_style(i, cycle)
    start = max(c[0]["train_s"] for c in curves)
    stop = min(c[-1]["train_s"] for c in curves)
    grid = np.linspace(start, stop, 60) if stop > start else np.array([stop])
    logs = np.stack([np.interp(grid, [p["train_s"] for p in c],
                               [math.log(p["ppl"]) for p in c])
                     for c in curves])
    name = f"{label(row)}, H={row['hidden_size']} ({len(curves)} seeds)"
    ax.plot(grid, np.exp(logs.mean(0)), color=color, linestyle=style,
            label=name)
    ax.fill_between(grid, np.exp(logs.min(0)), np.exp(logs.max(0)),
                    color=color, alpha=0.2, linewidth=0)
  for target in targets:
    ax.axhline(target, color="gray", linestyle=":", linewidth=1)
  ax.set_yscale("log")
  plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
  ax.yaxis.set_major_formatter(plain)
  ax.yaxis.set_minor_formatter(plain)
  ax.set_xlabel("training time (s; evaluations and saves left out)")
  ax.set_ylabel("valid perplexity")
  ax.grid(True, alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, frameon=False)
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
  return out_png


def write(out: str, records: Sequence[dict], meta: dict) -> dict:
  """results.md, results.json and valid_ppl_vs_time.png in out; returns all."""
  targets = list(meta.get("targets") or auto_targets(records))
  meta = {**meta, "targets_used": targets}
  rows = table(records, targets)
  text = markdown(rows, targets)
  said = {"classic": claims(rows), "best_classic": [],
          "striped": between_striped(rows)}
  best = best_classic(rows)
  if best is not None and not _is_classic(best):
    said["best_classic"] = claims(rows, best)
  seeds = ",".join(str(s) for s in meta["seeds"])
  note = (f"{meta['budget_minutes']:g} min per run, seeds {seeds}, "
          f"{meta['machine']}, {meta['devices']}")
  misses = calibration_misses(records, meta.get("calibrated_steps_per_s", {}))
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(f"{text}\n\n{note}\n")
    if misses:
      f.write(f"\nTimed runs more than {CALIBRATION_TOLERANCE:.0%} off "
              "their calibrated speed (the step counts and equal-time widths "
              "were planned from it):\n\n" + "\n".join(misses) + "\n")
    for key, title in (("classic", "Against the classic LSTM at the "
                         "config's width"),
                       ("best_classic", "Against the classic LSTM with the "
                        "lowest valid ppl of any width"),
                       ("striped", "Between the striped settings (the "
                        "columns where a pair's seeds separate)")):
      if said[key]:
        f.write(f"\n{title}:\n\n" + "\n".join(said[key]) + "\n")
  title = (f"valid ppl, {meta['budget_minutes']:g} min per run, "
           f"band = seeds' range")
  png = draw_bands(os.path.join(out, "valid_ppl_vs_time.png"), records,
                   targets, title)
  results = {"meta": meta, "table": rows, "claims": said,
             "calibration_misses": misses,
             "runs": list(records), "markdown": text,
             "png": os.path.basename(png)}
  with open(os.path.join(out, "results.json"), "w") as f:
    strict_json.dump(results, f, indent=2)
  return results
