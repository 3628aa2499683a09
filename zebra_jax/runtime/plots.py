"""Loss and perplexity curves from metrics.jsonl, several workdirs overlaid.

Drawn by `zebra-jax --mode=plot` (--compare overlays more workdirs).

The figure has a row per quantity (loss, ppl) and a column per x axis (step,
wall-clock seconds): stripes trade speed for quality, so a comparison is only
honest when both axes are shown. Train records are solid lines, valid records
dashed with markers; each workdir keeps one colour.

Only matplotlib's file backend (Agg) is used, so it runs on headless machines.
"""

import dataclasses
import json
import os
from typing import Sequence

from zebra_jax.errors import UserError

# (record key, axis label); ppl spans orders of magnitude early on: log scale.
QUANTITIES = (("loss", "loss (nats/token)"), ("ppl", "perplexity"))
X_AXES = (("step", "step"), ("seconds", "wall-clock (s)"))


@dataclasses.dataclass
class Run:
  """One workdir's records and the wall-clock origin its seconds count from."""
  label: str
  records: list[dict]
  origin: float


def read_metrics(workdir: str) -> list[dict]:
  """The records of WORKDIR/metrics.jsonl, in file order (torn lines skipped)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise UserError(f"{path} does not exist: train in {workdir} first, or "
                    f"pass a workdir that has metrics.jsonl")
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # A run killed mid-write leaves a partial last line.
  return records


def start_time(records: list[dict]) -> float:
  """Unix time the run started: a "start" record, else estimated.

  Without a start record the first train record is taken back by the steps
  it covers at its own ms/batch, so the origin excludes compile time (a few
  seconds) but keeps runs of different speeds on a common footing.
  """
  for r in records:
    if r.get("kind") == "start":
      return r["time"]
  if not records:
    return 0.0
  first = records[0]
  if first.get("kind") == "train" and "ms_per_batch" in first:
    return first["time"] - first["step"] * first["ms_per_batch"] / 1000.0
  return first["time"]


def load_run(workdir: str, label: str | None = None) -> Run:
  records = read_metrics(workdir)
  return Run(label or os.path.basename(os.path.normpath(workdir)), records,
             start_time(records))


def series(run: Run, kind: str, key: str, x: str) -> tuple[list, list]:
  """(xs, ys) of `key` over records of `kind`; x is "step" or "seconds"."""
  xs, ys = [], []
  for r in run.records:
    if r.get("kind") == kind and key in r:
      xs.append(r["step"] if x == "step" else r["time"] - run.origin)
      ys.append(r[key])
  return xs, ys


def draw(runs: Sequence[Run], out: str, quantities=QUANTITIES, x_axes=X_AXES,
         kinds=("train", "valid"), colors=None, title: str = "") -> str:
  """Writes one PNG with a panel per (quantity, x axis); returns out.

  Args:
    runs: the curves to overlay.
    colors: one matplotlib colour per run (runs of one setting over several
      seeds share a colour); default: one per run from the colour cycle.
  """
  import matplotlib  # imported lazily: only plotting needs it
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  from matplotlib import ticker

  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  colors = colors or [cycle[i % len(cycle)] for i in range(len(runs))]
  fig, axes = plt.subplots(len(quantities), len(x_axes), squeeze=False,
                           figsize=(6 * len(x_axes), 3.6 * len(quantities)))
  labelled = set()
  for row, (key, key_label) in enumerate(quantities):
    for col, (x, x_label) in enumerate(x_axes):
      ax = axes[row][col]
      for run, color in zip(runs, colors):
        for kind in kinds:
          xs, ys = series(run, kind, key, x)
          if not xs:
            continue
          name = f"{run.label} {kind}" if len(kinds) > 1 else run.label
          style = (dict(linestyle="--", marker="o", markersize=3)
                   if kind != "train" else dict(linewidth=1, alpha=0.8))
          label = name if name not in labelled else None
          labelled.add(name)
          ax.plot(xs, ys, color=color, label=label, **style)
      if key == "ppl":
        ax.set_yscale("log")
        plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 20, not 2x10^1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
      ax.set_xlabel(x_label)
      ax.set_ylabel(key_label)
      ax.grid(True, alpha=0.3)
  handles, names = [], []
  for ax in axes.flat:  # One legend: every panel shows the same lines.
    for h, n in zip(*ax.get_legend_handles_labels()):
      if n not in names:
        handles.append(h)
        names.append(n)
  if handles:
    fig.legend(handles, names, loc="lower center", fontsize=8,
               ncol=min(4, len(names)), frameon=False)
  if title:
    fig.suptitle(title)
  rows = (len(names) + 3) // 4
  fig.tight_layout(rect=(0, 0.04 * rows, 1, 1))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def run(workdirs: Sequence[str], out: str | None = None) -> str:
  """--mode=plot: overlays the workdirs' curves; returns the PNG path.

  out defaults to FIRST_WORKDIR/curves.png.
  """
  if not workdirs:
    raise UserError("plot needs at least one workdir")
  runs = [load_run(w) for w in workdirs]
  if not any(series(r, k, "loss", "step")[0]
             for r in runs for k in ("train", "valid")):
    raise UserError(f"no train or valid records in {', '.join(workdirs)}: "
                    f"train for at least train.log_every steps first")
  out = out or os.path.join(workdirs[0], "curves.png")
  draw(runs, out)
  print(f"wrote {out}", flush=True)
  return out
