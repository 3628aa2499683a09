"""The GPU report's results: OUT/gpu-results.json, rewritten whole after every
row, and the markdown page rendered from it; and the plan of calls that
fills it on a GPU node lent one command at a time.
"""

import json
import os
import textwrap

from zebra_jax import strict_json

STAGES = ("smoke", "quick", "bench", "wt103", "precision", "infer", "scaling")
# Seconds each stage may run on one H100, its process's start included.
STAGE_BUDGET_S = {"smoke": 60, "quick": 130, "bench": 310, "wt103": 170,
                  "precision": 150, "infer": 120, "scaling": 60}
# --dry_run: about twice or more each stage's seconds on a loaded 2-core CPU
# (smoke 33, quick 31, bench 128 with the speed rows, wt103 37 to 95,
# precision 50, infer 14 to 32, scaling 15 to 34), each call's within
# CALL_BUDGET_S as on the node.
DRY_BUDGET_S = {"smoke": 50, "quick": 70, "bench": 380, "wt103": 150,
                "precision": 200, "infer": 60, "scaling": 60}
# The node runs one command at a time, at most 10 minutes each: the report
# is two commands, each adding its stages to the same gpu-results.json.
CALLS = (("smoke", "quick", "bench"), ("wt103", "precision", "infer",
                                       "scaling"))
CALL_BUDGET_S = 540     # one command, its stages' budgets and overhead
CALL_OVERHEAD_S = 40    # outside the stages: jax probe, wheels, driver
START_UP_S = 180        # a cold start of the node, counted in its session
SESSION_S = 1500        # the node's time for the whole report


def call_command(stages) -> str:
  return "bash launch/gpu_report.sh " + " ".join(stages)


def sequence_lines() -> list[str]:
  """The calls as markdown: each command and its budget, and how the
  result file carries from one call to the next."""
  worst = sum(START_UP_S + CALL_BUDGET_S for _ in CALLS)
  lines = ["| call | command (repository root; the node sets $OUT) | "
           "stage budgets, s | call budget, s |", "|---|---|---|---:|"]
  for i, stages in enumerate(CALLS, 1):
    budgets = " + ".join(f"{s} {STAGE_BUDGET_S[s]}" for s in stages)
    lines.append(f"| {i} | `{call_command(stages)}` | {budgets} | "
                 f"{CALL_BUDGET_S} |")
  wrap = lambda text: textwrap.fill(text, 79, break_on_hyphens=False,
                                     break_long_words=False)
  return lines + [
      "",
      wrap("Each call's stages sum to at most "
           f"{CALL_BUDGET_S - CALL_OVERHEAD_S} "
      f"s, leaving {CALL_OVERHEAD_S} s for the jax probe, the wheels and "
      f"the driver; run it with a {CALL_BUDGET_S} s timeout. Both calls, "
      f"each from a cold start ({START_UP_S} s), take at most {worst} s of "
      f"the node's {SESSION_S} s."),
      "",
      wrap("Results carry in the working tree: a call reads "
      "`docs/gpu-results.json` (copied into `$OUT` first) and writes the "
      "merged `gpu-results.json` and `gpu-results.md` into `$OUT`. After "
      "each call, copy both back from the folder the node returns "
      "(RETURNED) over `docs/` before the next call, so that the next "
      "copy of the tree carries them:"),
      "",
      "    cp RETURNED/gpu-results.json RETURNED/gpu-results.md docs/",
      "",
      wrap("A stage run again replaces its own section only; every other "
           "stage's rows stay.")]

class Results:
  """OUT/gpu-results.json and the .md rendered from it, both rewritten
  after every change: written to a temporary file, then renamed over the
  old one, so a process killed at any moment leaves a whole file."""

  def __init__(self, out: str):
    self.out = out
    self.json_path = os.path.join(out, "gpu-results.json")
    self.md_path = os.path.join(out, "gpu-results.md")
    self.data = {}
    if os.path.exists(self.json_path):
      with open(self.json_path) as f:
        self.data = json.load(f)

  def save(self) -> None:
    os.makedirs(self.out, exist_ok=True)
    for path, text in ((self.json_path,
                        strict_json.dumps(self.data, indent=1, default=str)),
                       (self.md_path, render(self.data))):
      tmp = f"{path}.tmp{os.getpid()}"
      with open(tmp, "w") as f:
        f.write(text)
      os.replace(tmp, path)

  def section(self, stage: str) -> dict:
    return self.data.setdefault(stage, {})

  def update(self, stage: str, values: dict, rows: int = 1) -> None:
    """Sets keys of the stage's section; counts `rows` measured rows."""
    self.section(stage).update(values)
    self._count(stage, rows)

  def append(self, stage: str, key: str, rows: list) -> None:
    """Adds rows to the list section[key]."""
    self.section(stage).setdefault(key, []).extend(rows)
    self._count(stage, len(rows))

  def _count(self, stage: str, rows: int) -> None:
    status = self.data.setdefault("stages", {}).setdefault(stage, {})
    status["rows"] = status.get("rows", 0) + rows
    self.save()


def _fmt(x, spec=",.0f"):
  return "-" if x is None else format(x, spec)


def _mib(x):
  return _fmt(x and x / 2 ** 20)


def summary(report: dict) -> list[str]:
  """At most about 25 lines: the machine, the peak, the headline rows and
  each stage's status."""
  mach = report.get("machine", {})
  gpus = mach.get("gpus") or []
  quick, bench_ = report.get("quick", {}), report.get("bench", {})
  smoke = report.get("smoke", {})
  lines = [
      f"- machine: {', '.join(g['name'] for g in gpus) or 'no GPU'}"
      f" (driver {gpus[0]['driver'] if gpus else '-'}); jax "
      f"{mach.get('jax', '-')}, jaxlib {mach.get('jaxlib', '-')}, cuDNN "
      f"{_fmt(mach.get('cudnn_jax'), 'd')} (jax) / "
      f"{_fmt(mach.get('cudnn_torch'), 'd')} (torch {mach.get('torch')})"]
  outside = report.get("versions", {}).get("outside", [])
  if outside:
    lines.append(f"- versions outside pyproject.toml: {'; '.join(outside)}")
  if smoke.get("rows"):
    failed = [r for r in smoke["rows"] if r["status"] != "ok"]
    lines.append(f"- smoke ({smoke.get('backend', '-')}): "
                 f"{len(smoke['rows']) - len(failed)}/{len(smoke['rows'])} "
                 "Pallas kernels ran" + (
                     f"; {failed[0]['name']}: {failed[0]['error']}"
                     if failed else ""))
  peak = quick.get("peak")
  if peak:
    sheet = peak["datasheet_bf16_tflops"]
    lines.append(f"- best measured matmul: "
                 f"{peak['best_measured_matmul_tflops']:,.1f} TFLOP/s "
                 f"({peak['dtype']}); datasheet dense bf16: " +
                 (f"{sheet:,.0f} TFLOP/s ({peak['datasheet']})" if sheet
                  else "unknown"))
  for r in quick.get("rows", []):
    if not r["name"].startswith("torch"):
      lines.append(f"- {r['name']}: {r['tokens_per_s']:,.0f} tok/s, "
                   f"{_fmt(r['ratio_to_torch'], '.2f')} x torch, "
                   f"{100 * r['frac_of_peak']:.0f}% of the best matmul")
  pallas = bench_.get("pallas", [])
  widest = max((r["stripes"] for r in pallas), default=None)
  for r in pallas:
    if r.get("error"):
      lines.append(f"- {r['name']} ({r['dtype']}): error: {r['error']}")
    elif r["stripes"] == widest and not r["name"].startswith("scan_core"):
      lines.append(f"- {r['name']} ({r['dtype']}): {r['vs_scan']:.2f} x scan,"
                   f" {r['kernel']}")
  w = report.get("wt103", {})
  if "tokens_per_s" in w:
    lines.append(f"- wt103 recipe: {w['tokens_per_s']:,.0f} tok/s, "
                 f"{w['epoch_minutes_103M']:.1f} min per 103M-token epoch")
    lines.append(_wt103_pallas(w).replace("- ", "- wt103 ", 1))
  curves = report.get("precision", {}).get("curves", {})
  if curves:
    lines.append("- precision, max |loss - fp32| after warm-up: " + ", ".join(
        f"{d} {_fmt(c['max_abs_diff_vs_fp32'], '.3f')}"
        for d, c in curves.items()))
  infer = report.get("infer", {}).get("results", [])
  if infer:
    lines.append(f"- infer: batch 1 token p50 "
                 f"{infer[0]['token_latency_ms']['p50']:.2f} ms; batch "
                 f"{infer[-1]['batch_size']} {infer[-1]['tokens_per_s']:,.0f}"
                 " tok/s")
  scaling = report.get("scaling", {})
  if scaling.get("rows"):
    last = scaling["rows"][-1]
    lines.append(f"- scaling: {last['devices']} devices at "
                 f"{100 * last['efficiency']:.0f}% efficiency"
                 + (f" ({scaling['note']})" if scaling.get("note") else ""))
  for stage, st in report.get("stages", {}).items():
    lines.append(f"- stage {stage}: {st.get('status', '-')}, "
                 f"{st.get('rows', 0)} rows, {_fmt(st.get('seconds'))} s of "
                 f"{st.get('budget_s', '-')} s"
                 + (f" ({st['device']})" if st.get("device") else ""))
  return lines


def _precisions(found) -> str:
  """tt.dot input precisions as 'ieee x4', or '-' where none were read."""
  return ", ".join(f"{p} x{found.count(p)}" for p in sorted(set(found))) \
      if found else "-"


def _bench_table(rows) -> list[str]:
  lines = ["| row | tok/s | ms/step | x torch | model TFLOP/s | % best matmul"
           " | XLA plan MB |", "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['ms_per_step']:.1f} | {_fmt(r['ratio_to_torch'], '.2f')}"
                 f" | {r['gflops'] / 1e3:.2f} | "
                 f"{100 * r['frac_of_peak']:.0f}% | {_mib(r['xla_bytes'])} |")
  return lines


def _wt103_pallas(w: dict) -> str:
  """The recipe's step with the fused kernel, as one list line."""
  p = w.get("pallas")
  if p is None:
    return "- model.recurrence=pallas: not measured (yet)"
  if p.get("error"):
    return f"- model.recurrence=pallas: error: {p['error']}"
  if p["kernel"] != "fused":
    return f"- model.recurrence=pallas: {p['kernel']}"
  return (f"- model.recurrence=pallas (fused kernel): "
          f"{p['tokens_per_s']:,.0f} tok/s, {p['ms_per_step']:.1f} ms/step, "
          f"{p['vs_scan']:.2f} x scan")


def render(report: dict) -> str:
  """The markdown page, from whatever the JSON holds (a stage stopped
  midway shows the rows it finished)."""
  lines = ["# GPU results", "",
           "Measured by `python -m lab.gpu_report` "
           "(`bash launch/gpu_report.sh`); the JSON beside this page holds "
           "every number.", ""]
  if report.get("dry_run"):
    lines += ["**DRY RUN: tiny shapes, figures mean nothing.**", ""]
  lines += ["## Summary", ""] + summary(report) + [""]
  lines += ["## How this page is made", "",
            "Two commands on a GPU node (what each stage measures: "
            "`python -m lab.gpu_report --help`):", ""]
  lines += sequence_lines() + [""]
  versions = report.get("versions", {})
  if versions.get("installed"):
    lines += ["Installed: " + ", ".join(
        f"{k} {v or 'missing'}" for k, v in versions["installed"].items())
              + (f"; outside pyproject.toml's bounds: "
                 f"{'; '.join(versions['outside'])}"
                 if versions.get("outside") else
                 "; all within pyproject.toml's bounds"), ""]
  smoke = report.get("smoke", {})
  if smoke.get("rows"):
    lines += [f"## smoke: tiny Pallas kernels ({smoke.get('backend')})", "",
              "| kernel | status | seconds | max abs error | tt.dot "
              "precision |", "|---|---|---:|---:|---|"]
    for r in smoke["rows"]:
      lines.append(f"| {r['name']} | "
                   f"{'ok' if r['status'] == 'ok' else r['error']} | "
                   f"{_fmt(r.get('seconds'), '.1f')} | "
                   f"{_fmt(r.get('max_abs_err'), '.2e')} | "
                   f"{_precisions(r.get('dot_precision'))} |")
    lines.append("")
  quick, b = report.get("quick", {}), report.get("bench", {})
  if quick.get("peak"):
    p = quick["peak"]
    call = p["seconds_per_call_at_least"]
    lines += ["## Best measured matmul", "",
              f"{p['device_kind']}, {p['dtype']}"
              + (f", every timed call at least {1e3 * call:.0f} ms of work at"
                 " the datasheet's rate" if call else "")
              + "; GFLOP/s by shape: " + ", ".join(
                  f"{k} {v:,.0f}" for k, v in p["by_shape_gflops"].items()),
              "", "Model TFLOP/s below count the matmuls a step needs "
              "(recomputation not counted).", ""]
  if quick.get("rows"):
    lines += ["## Core train step against torch (first figures)", "",
              quick.get("torch", ""), ""] + _bench_table(quick["rows"]) + [""]
  if b.get("rows"):
    lines += ["## bench --shape=gpu", "", b.get("torch", ""), ""]
    lines += _bench_table(b["rows"]) + [""]
  if b.get("memory_error"):
    lines.append(f"- peak memory: error: {b['memory_error']}")
  for m in b.get("memory") or []:
    lines.append(f"- peak memory, LM S=1, window {m['seq_len']}, remat "
                 f"{m['remat']}: {_mib(m['peak_bytes'])} MB "
                 f"({m['peak_source']}); XLA plan {_mib(m['xla_bytes'])} MB")
  if b.get("pallas"):
    lines += ["", "### pallas: the fused stripe kernel vs the scan "
              "(core train step)", "",
              "| row | dtype | tok/s | ms/step | x scan | model TFLOP/s | "
              "kernel |", "|---|---|---:|---:|---:|---:|---|"]
    for r in b["pallas"]:
      if r.get("error"):
        lines.append(f"| {r['name']} | {r['dtype']} | - | - | - | - | "
                     f"error: {r['error']} |")
        continue
      lines.append(f"| {r['name']} | {r['dtype']} | "
                   f"{r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                   f"{r['vs_scan']:.2f} | {r['model_tflops']:.2f} | "
                   f"{r['kernel']} |")
    lines.append("")
  w = report.get("wt103", {})
  if "tokens_per_s" in w:
    profile = w.get("profile", {})
    share = profile.get("share", {})
    lines += ["## WikiText-103 recipe shapes (synthetic ids)", "",
              f"model {w['model']}, batch {w['batch']} x {w['seq_len']}, "
              f"{w['steps_timed']} timed steps", "",
              f"- {w['tokens_per_s']:,.0f} tok/s, {w['ms_per_step']:.1f} "
              f"ms/step: {w['epoch_minutes_103M']:.1f} minutes per "
              "103M-token epoch",
              f"- peak memory {_mib(w['peak_bytes'])} MB "
              f"({w['peak_source']}); XLA plan {_mib(w['xla_bytes'])} MB",
              "- step time by part (device ops in a 3-step trace): " + (
                  ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                            sorted(share.items(), key=lambda kv: -kv[1]))
                  or profile.get("error", "not traced")),
              _wt103_pallas(w), ""]
  if report.get("infer", {}).get("results"):
    lines += ["## infer_bench (demo model)", "",
              "| batch | tok/s | token p50 ms | p90 | p99 | request p50 ms |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in report["infer"]["results"]:
      t, q = r["token_latency_ms"], r["request_latency_ms"]
      lines.append(f"| {r['batch_size']} | {r['tokens_per_s']:,.0f} | "
                   f"{t['p50']:.2f} | {t['p90']:.2f} | {t['p99']:.2f} | "
                   f"{q['p50']:.1f} |")
    lines.append("")
  p = report.get("precision", {})
  if p.get("curves"):
    lines += [f"## precision: demo corpus, {p['steps']} steps per dtype", "",
              "| dtype | final loss | max abs diff vs fp32 (after warm-up) |"
              " skipped after warm-up | loss scale |",
              "|---|---:|---:|---:|---:|"]
    for dtype, c in p["curves"].items():
      lines.append(f"| {dtype} | {_fmt(c['final_loss'], '.4f')} | "
                   f"{_fmt(c['max_abs_diff_vs_fp32'], '.4f')} | "
                   f"{_fmt(c['skipped_after_warmup'], 'd')} | "
                   f"{_fmt(c['loss_scale'], '.0f')} |")
    lines.append("")
  s = report.get("scaling", {})
  if s.get("rows"):
    lines += [f"## data-parallel weak scaling (LM S={s['stripes']}, hidden "
              f"{s['hidden']}, batch {s['per_device_batch']} x "
              f"{s['seq_len']} per device)", "",
              "| devices | tok/s | ms/step | efficiency |",
              "|---:|---:|---:|---:|"]
    for r in s["rows"]:
      lines.append(f"| {r['devices']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['ms_per_step']:.1f} | {100 * r['efficiency']:.0f}% |")
    if s.get("note"):
      lines += ["", s["note"]]
    lines.append("")
  return "\n".join(lines)
