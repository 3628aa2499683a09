"""The GPU report's results: OUT/gpu-results.json, rewritten whole after every
row, and the markdown page rendered from it. The budgets it shows come from
gpu_budget.py.
"""

import json
import os
import textwrap

from lab.benchmarks import gpu_budget
from zebra_jax import strict_json


def call_command(stages=()) -> str:
  return " ".join(["bash launch/gpu_report.sh", *stages])


def first_error_line(exc: BaseException) -> str:
  """The line of an exception that names the error (Triton's, ptxas' or
  XLA's first line saying error), else its first line; with its type. A
  first line that only points at a place ("at 251:27:", Triton's
  CompilationError, whose source excerpt follows) gets the message's last
  line, where the cause is."""
  lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
  named = [l for l in lines if "error" in l.lower()]
  line = (named or lines or [""])[0]
  if not named and len(lines) > 1 and line.endswith(":"):
    line = f"{line} ... {lines[-1]}"
  return f"{type(exc).__name__}: {line}"[:400]


def sequence_lines() -> list[str]:
  """The report's sequence as markdown: three steps, the stages' budgets
  and the device-time ledger, all from gpu_budget.py."""
  wrap = lambda text: textwrap.fill(text, 79, break_on_hyphens=False,
                                     break_long_words=False)
  return [
      "1. Here, with network: `bash launch/gpu_wheels.sh` puts the wheels "
      "the node lacks (ml-collections, tensorboardX, flashrnn and its "
      "needs) in `wheels/`.",
      "2. On the node, from the repository root, the tree and `wheels/` "
      f"(git-ignored: copy it by name) copied there: `{call_command()}`, "
      f"with a {gpu_budget.CALL_BUDGET_S} s timeout and `OUT` set to the "
      "folder the node sends back.",
      "3. Copy `gpu-results.json` and `gpu-results.md` from that folder "
      "over `lab/notes/` and commit them (the call's log `gpu-report.log` and "
      "the trace and XLA dump archives beside them stay out of the "
      "repository).",
      "",
      ] + gpu_budget.budget_table() + [
      "",
      wrap("Each stage writes its rows into `OUT` as it measures them, so a "
           "call stopped at any second returns every row measured before; "
           "a stage past its budget is killed and the next one runs. A "
           "second, optional call reruns named stages only "
           f"(`{call_command(('wt103', 'infer'))}`); it must start within "
           f"{gpu_budget.RELEASE_S} s of the first call's end, while the "
           "node is still warm, so it comes before step 3, and step 3 then "
           "puts its stages into the first call's file: `python -m "
           "lab.gpu_report --merge=RERUN/gpu-results.json --out=lab/notes`, "
           "RERUN being the folder the rerun sent back."),
      "",
      "```text"] + gpu_budget.ledger_lines() + ["```"]


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
    self._count(stage, rows, [key for key in values] if rows else [])

  def append(self, stage: str, key: str, rows: list) -> None:
    """Adds rows to the list section[key]."""
    found = self.section(stage).setdefault(key, [])
    ids = [_list_row_id(key, len(found) + i, row)
           for i, row in enumerate(rows)]
    found.extend(rows)
    self._count(stage, len(rows), ids)

  def _count(self, stage: str, rows: int, ids) -> None:
    status = self.data.setdefault("stages", {}).setdefault(stage, {})
    status["rows"] = status.get("rows", 0) + rows
    self.save()
    for row_id in ids:  # on disk first: what the log names, the file holds
      print(f"| measured {stage} {row_id}", flush=True)


def _list_row_id(key: str, index: int, row) -> str:
  name = row.get("name", "") if isinstance(row, dict) else ""
  return f"{key}/{index}/{name}"


def row_ids(report: dict):
  """(stage, row id) of every row a results file holds, as Results prints
  them when it writes them: a list section's rows and every other key."""
  for stage in report.get("stages", {}):
    for key, value in report.get(stage, {}).items():
      yield stage, key
      if isinstance(value, list):
        for i, row in enumerate(value):
          yield stage, _list_row_id(key, i, row)


def _fmt(x, spec=",.0f"):
  return "-" if x is None else format(x, spec)


def _mib(x):
  return _fmt(x and x / 2 ** 20)


def _kernel_rows(report: dict, dtype: str) -> list[dict]:
  return [r for r in report.get("kernel", {}).get("rows", [])
          if r["dtype"] == dtype]


def _ratio_text(ratios: dict, limit: int = 4) -> str:
  """'2.10 x torch_cudnn_bf16_S1, ...': the baselines in the order they ran."""
  return ", ".join(f"{v:.2f} x {k}" for k, v in list(ratios.items())[:limit])


def baseline_kind(impl: str) -> str:
  """What a baseline computes beside a ZebraLSTM row (gpu_kernel's
  docstring): the per-stripe loop, FlashRNN, or the same function."""
  if impl.endswith("_loop"):
    return "per-stripe loop"
  return "FlashRNN" if impl.startswith("flashrnn") else "same function"


def _kind(name: str) -> str:
  """baseline_kind of a row's name (its impl and _S suffix)."""
  return baseline_kind(name.rsplit("_S", 1)[0])


def _ratios_by_kind(against: dict, limit: int = 4) -> str:
  """The ratios to the same-function baselines first, then the per-stripe
  loops and FlashRNN, each labelled; '' where there are none."""
  parts = []
  for kind, label in (("same function", "same function"),
                      ("FlashRNN", "FlashRNN"),
                      ("per-stripe loop", "per-stripe loop (one cuDNN call "
                                          "a stripe, launch-bound)")):
    found = {k: v for k, v in against.items() if _kind(k) == kind}
    if found:
      parts.append(f"{label}: {_ratio_text(found, limit)}")
  return "; ".join(parts)


def clock_check(rows: list[dict]) -> str:
  """How the kernel rows' clocks agree, in one line ('' without GPU
  clocks): torch's CUDA events against the same rounds' wall time, and for
  the JAX rows (timed by back-to-back wall time) the profiler's GPU busy
  time and span as shares of it."""
  torch = [r["ms_per_step"] / r["wall_ms_per_step"] for r in rows
           if r.get("timer") == "CUDA events" and r.get("wall_ms_per_step")]
  jax = [r for r in rows if "busy_ms" in r and r.get("wall_ms_per_step")]
  parts = []
  if torch:
    parts.append(f"torch rows' CUDA events within "
                 f"{100 * max(abs(x - 1) for x in torch):.1f}% of their "
                 f"rounds' wall time ({len(torch)} rows)")
  if jax:
    busy = [r["busy_ms"] / r["wall_ms_per_step"] for r in jax]
    span = [r["span_ms"] / r["wall_ms_per_step"] for r in jax]
    parts.append(f"JAX rows timed by back-to-back wall time, the GPU busy "
                 f"{100 * min(busy):.0f}-{100 * max(busy):.0f}% of it; the "
                 f"profiler's span {min(span):.2f}-{max(span):.2f} x it")
  return "; ".join(parts)


def _speed(r: dict) -> str:
  """'1,856,455 tok/s, 2.21 ms/step (CUDA events, median of 5: 2.18-2.25),
  41.2 TFLOP/s = 4.2% of the bf16 peak'."""
  text = (f"{r['tokens_per_s']:,.0f} tok/s, {r['ms_per_step']:.2f} ms/step")
  if "min_ms" in r:
    text += (f" ({r['timer']}, median of {r['rounds']}: "
             f"{r['min_ms']:.2f}-{r['max_ms']:.2f})")
  if r.get("tflops") is not None:
    text += f", {r['tflops']:.1f} TFLOP/s"
    if r.get("peak_fraction") is not None:
      text += f" = {100 * r['peak_fraction']:.1f}% of the {r['math']} peak"
  return text


def summary(report: dict) -> list[str]:
  """At most about 25 lines: the machine, the backend, the headline rows
  and each stage's status."""
  mach = report.get("machine", {})
  gpus = mach.get("gpus") or []
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
  if "backend" in smoke:
    lowered = smoke.get("lowered_for_cuda", {})
    lines.append(f"- Pallas GPU backend: {lowered.get('backend', '-')} "
                 f"(jax {lowered.get('jax', '-')}"
                 + ("; jax warns: the Triton backend is deprecated"
                    if "deprecated" in (lowered.get("warning") or "")
                    else "") + ")")
  if smoke.get("rows"):
    failed = [r for r in smoke["rows"] if r["status"] != "ok"]
    lines.append(f"- smoke ({smoke.get('backend', '-')}): "
                 f"{len(smoke['rows']) - len(failed)}/{len(smoke['rows'])} "
                 "Pallas kernels ran" + (
                     f"; {failed[0]['name']}: {failed[0]['error']}"
                     if failed else ""))
  clocks = clock_check(report.get("kernel", {}).get("rows", []))
  if clocks:
    lines.append(f"- clocks: {clocks}")
  ratios = report.get("kernel", {}).get("ratios", {})
  for dtype in ("bfloat16", "float32"):
    for r in _kernel_rows(report, dtype):
      if r["impl"].startswith("zebra") and not (
          r["stripes"] == 1 and "error" in r):
        against = _ratios_by_kind(ratios.get(dtype, {}).get(r["name"], {}),
                                  limit=2)
        lines.append(
            f"- {r['name']} ({dtype}): " + (
                f"error: {r['error']}" if "error" in r else
                _speed(r) + (f"; {against}" if against
                             else "; no baseline ran")))
  w = report.get("wt103", {})
  if "tokens_per_s" in w:
    lines.append(f"- wt103 recipe ({w['params'] / 1e6:.0f}M parameters, "
                 "fresh batches through the input pipeline): "
                 f"{_streamed_text(w)}, compile {w['compile_s']:.0f} s, peak "
                 f"{_mib(w['peak_bytes'])} MB; {w['projected_hours']:.1f} h "
                 f"for its {w['recipe_tokens'] / 1e9:.2f}B tokens on one GPU")
  elif "compile_s" in w:
    lines.append(f"- wt103 recipe ({w['params'] / 1e6:.0f}M parameters): "
                 f"compiled in {w['compile_s']:.0f} s, no step timed")
  if w.get("variants"):
    lines.append("- wt103 candidates beside the recipe, interleaved: " + "; ".join(
        f"{v['name']} " + (f"{v['x_recipe']:.2f} x ({v['tokens_per_s']:,.0f}"
                           f" tok/s, |loss - recipe's| {v['loss_diff']:.4f})"
                           if "tokens_per_s" in v else
                           f"error: {v.get('error', '-')}")
        for v in w["variants"]))
  curves = report.get("precision", {}).get("curves", {})
  if curves:
    lines.append("- precision, max |loss - fp32| after warm-up: " + ", ".join(
        f"{d} {_fmt(c['max_abs_diff_vs_fp32'], '.3f')}"
        for d, c in curves.items()))
  infer = report.get("infer", {}).get("results", [])
  if infer:
    models = {r.get("model", "demo"): [] for r in infer}
    for r in infer:
      models[r.get("model", "demo")].append(r)
    lines.append("- infer: " + "; ".join(
        f"{m} at {'/'.join(str(r['slots']) for r in rows)} slots "
        + " / ".join(_fmt(r.get("tokens_per_s")) for r in rows) + " tok/s"
        for m, rows in models.items()))
  for r in report.get("infer", {}).get("split", []):
    if r.get("cadence_us") is not None:
      lines.append(f"- infer, {r['model']} one-slot token: "
                   f"{r['cadence_us']:.0f} us = " + " + ".join(
                       f"{part} {r[part + '_us']:.0f}"
                       for part in INFER_SPLIT_PARTS))
  scaling = report.get("scaling", {})
  if scaling.get("rows"):
    last = scaling["rows"][-1]
    lines.append(f"- scaling: {last['devices']} devices at "
                 f"{100 * last['efficiency']:.0f}% efficiency"
                 + (f" ({scaling['note']})" if scaling.get("note") else ""))
  profile = report.get("profile", {})
  if profile.get("trace_archive") or profile.get("error"):
    lines.append("- profile: " + (
        f"error: {profile['error']}" if profile.get("error") else
        f"{profile['trace_archive']}, {profile.get('dump_archive', '-')}"))
  stages = []
  for stage, st in report.get("stages", {}).items():
    status = st.get("status", "-")
    rows = "" if "rows" in status else f"{st.get('rows', 0)} rows, "
    stages.append(f"{stage} {status}, {rows}"
                  f"{_fmt(st.get('seconds'))} s of "
                  f"{st.get('budget_s', '-')} s"
                  + (f" ({st['device']})" if st.get("device") else ""))
  if stages:  # one line: the kernel rows keep the summary's room
    lines.append("- stages: " + "; ".join(stages))
  return lines


def _streamed_text(row: dict) -> str:
  """'443,439 tok/s, 36.9 ms/step (wall, median of 5: 36.5-37.4), loss
  10.31 -> 8.02': a recipe row streamed through the input pipeline."""
  text = f"{row['tokens_per_s']:,.0f} tok/s, {row['ms_per_step']:.1f} ms/step"
  if "min_ms" in row:
    text += (f" (host wall, median of {row['rounds']}: "
             f"{row['min_ms']:.1f}-{row['max_ms']:.1f})")
  if "loss_first" in row:
    text += f", loss {row['loss_first']:.2f} -> {row['loss_last']:.2f}"
  return text


def _variant_text(row: dict) -> str:
  """A candidate beside the recipe's step, in one line: its speed against
  the recipe's and its loss, or why it did not run."""
  plan = f" ({row['plan']})" if row.get("plan") else ""
  if "tokens_per_s" in row:
    return (f"{_streamed_text(row)}, {row['x_recipe']:.2f} x the recipe, "
            f"|loss - recipe's| {row['loss_diff']:.4f}; compile "
            f"{row['compile_s']:.0f} s{plan}")
  return f"error: {row['error']}{plan}" if "error" in row else plan


def _precisions(found) -> str:
  """tt.dot input precisions as 'ieee x4', or '-' where none were read."""
  return ", ".join(f"{p} x{found.count(p)}" for p in sorted(set(found))) \
      if found else "-"


def _kernel_section(report: dict) -> list[str]:
  k = report.get("kernel", {})
  if not k.get("rows"):
    return []
  shape = k.get("shape", {})
  lines = ["## kernel: core train step against every LSTM at hand", "",
           f"hidden {shape.get('hidden')}, batch {shape.get('batch')}, "
           f"window {shape.get('seq_len')}, {shape.get('layers')} layers; "
           "forward + backward + Adam per step; S > 1 grouped. Baselines: "
           "same function (one dense cuDNN LSTM of width H: the model at "
           "S = 1, a superset of it at S > 1), per-stripe loop (`_loop`: S "
           "cuDNN LSTMs of width H/S, one call each), FlashRNN (S heads). "
           "Rows of one dtype and group are timed interleaved, each round "
           "its steps dispatched back to back and waited for once: ms/step "
           "is the median of the rounds, read from CUDA events for torch "
           "and from the rounds' wall time for JAX (which has no CUDA "
           "events), with the spread, the wall time of every row, and a JAX "
           "row's GPU busy time from a profiler trace of the same rounds; "
           "TFLOP/s counts the matmuls the row computes, as a share of the "
           "chip's dense peak in the row's math.", ""]
  for dtype in ("bfloat16", "float32"):
    rows = _kernel_rows(report, dtype)
    if not rows:
      continue
    lines += [f"### {dtype}", "",
              "| group | row | baseline | tok/s | ms/step | spread | wall "
              "ms | GPU busy ms | TFLOP/s | % of peak | note |",
              "|---|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
      group = f"S={r.get('group', r['stripes'])}"
      kind = ("ours" if r["impl"].startswith("zebra")
              else _kind(r["name"]))
      if "error" in r:
        lines.append(f"| {group} | {r['name']} | {kind} | - | - | - | - | "
                     f"- | - | - | {r['error']} |")
        continue
      spread = (f"{r['min_ms']:.2f}-{r['max_ms']:.2f}" if "min_ms" in r
                else "-")
      peak = (f"{100 * r['peak_fraction']:.1f} ({r['math']})"
              if r.get("peak_fraction") is not None else
              f"- ({r.get('math', '-')})")
      note = f"{r.get('timer', 'host wall')}; built in {r['build_s']:.1f} s"
      if r.get("timer_note"):
        note += f"; {r['timer_note']}"
      lines.append(f"| {group} | {r['name']} | {kind} | "
                   f"{r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
                   f"{spread} | {_fmt(r.get('wall_ms_per_step'), '.2f')} | "
                   f"{_fmt(r.get('busy_ms'), '.2f')} | "
                   f"{_fmt(r.get('tflops'), '.1f')} | {peak} | {note} |")
    lines.append("")
    for name, against in k.get("ratios", {}).get(dtype, {}).items():
      if against:
        lines.append(f"- {name}: {_ratios_by_kind(against, limit=99)}")
    lines.append("")
  return lines


# The parts of a one-slot decode step's time, in the order they are spent
# (gpu_infer.StepClock.split): they add up to its cadence.
INFER_SPLIT_PARTS = ("loop", "dispatch", "device_wait", "bookkeeping")


def _infer_section(infer: dict) -> list[str]:
  """The infer stage's tables: tokens/s per model and slot count, then the
  one-slot decode's time per token split between host and device."""
  wt = infer.get("wt103_model", {})
  lines = ["## inference: the serving engine's tokens/s", "",
           "Every slot busy: as many requests as slots, submitted at once, "
           "each a prompt and its new tokens; one untimed round first; "
           "the engine as --mode=serve builds it (its decode block: tokens "
           "a slot per decode call). demo: the precision stage's float32 "
           "run" + (f"; wt103: the recipe's model ({wt['variant']}, "
                    f"{wt['dtype']}, {wt['vocab']:,} words) with random "
                    "weights" if wt else "") + ".", "",
           "| row | slots | decode block | requests | prompt | new tokens "
           "| tok/s | us/token a slot |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in infer["results"]:
    name = r.get("name", f"demo_slots{r['slots']}")
    if "error" in r:
      lines.append(f"| {name} | {r['slots']} | error: {r['error']} "
                   "| | | | | |")
      continue
    lines.append(f"| {name} | {r['slots']} | {r.get('decode_block', '-')} "
                 f"| {r['requests']} | {r['prompt_len']} | "
                 f"{r['new_tokens']} | {r['tokens_per_s']:,.0f} | "
                 f"{1e6 * r['slots'] / r['tokens_per_s']:,.0f} |")
  lines.append("")
  split = infer.get("split", [])
  if split:
    lines += ["One slot's decode, per token (a step's time over its decode "
              "block), the mean over steps that only decoded: the loop "
              "between steps (admission, locks), the decode call's host "
              "dispatch, the device's work left after it, and the host's "
              "bookkeeping; they add up to the cadence.", "",
              "| row | steps | cadence, us | median, us | "
              + " | ".join(f"{p}, us" for p in INFER_SPLIT_PARTS) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(INFER_SPLIT_PARTS)]
    for r in split:
      if "error" in r:
        lines.append(f"| {r['name']} | error: {r['error']} |")
        continue
      lines.append(f"| {r['name']} | {r['steps']} | "
                   + " | ".join(_fmt(r[f"{k}_us"], ".1f") for k in (
                       "cadence", "cadence_median", *INFER_SPLIT_PARTS))
                   + " |")
    lines.append("")
  return lines


def render(report: dict) -> str:
  """The markdown page, from whatever the JSON holds (a stage stopped
  midway shows the rows it finished)."""
  lines = ["# GPU results", "",
           "Measured by `bash launch/gpu_report.sh` (`python -m "
           "lab.gpu_report`) from the repository root; the JSON beside this "
           "page holds every number.", ""]
  if report.get("dry_run"):
    lines += ["**DRY RUN: tiny shapes, figures mean nothing.**", ""]
  lines += ["## Summary", ""] + summary(report) + [""]
  lines += ["## How this page is made", ""] + sequence_lines() + [
      "", "Each stage, its budget and how to rehearse the report on a CPU: "
      "[the GPU report](gpu-report.md).", ""]
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
    lowered = smoke.get("lowered_for_cuda", {})
    lines += [f"## smoke: tiny Pallas kernels ({smoke.get('backend')})", "",
              f"The stripe kernel lowered for CUDA calls "
              f"{', '.join(lowered.get('custom_calls') or ['-'])}: backend "
              f"{lowered.get('backend', '-')}"
              + (f"; jax warned: {lowered['warning']}"
                 if lowered.get("warning") else "") + ".", "",
              "| kernel | status | seconds | max abs error | tt.dot "
              "precision |", "|---|---|---:|---:|---|"]
    for r in smoke["rows"]:
      lines.append(f"| {r['name']} | "
                   f"{'ok' if r['status'] == 'ok' else r['error']} | "
                   f"{_fmt(r.get('seconds'), '.1f')} | "
                   f"{_fmt(r.get('max_abs_err'), '.2e')} | "
                   f"{_precisions(r.get('dot_precision'))} |")
    lines.append("")
  lines += _kernel_section(report)
  w = report.get("wt103", {})
  if "tokens_per_s" in w:
    lines += ["## WikiText-103 recipe step (synthetic corpus, streamed)", "",
              f"model {w['model']}, {w['params']:,} parameters, batch "
              f"{w['batch']} x {w['seq_len']}, {w['steps_timed']} timed "
              "steps. Every step takes a fresh window of a synthetic "
              "corpus of Zipf-distributed ids through the data config's "
              "batcher and onto the device, as the train loop does, while "
              "the last step runs; a round's host wall time over its steps "
              "is the figure, the input pipeline included. The loss stays "
              "above the ids' entropy"
              + (f" ({w['zipf_entropy']:.2f} nats)" if "zipf_entropy" in w
                 else "") + ": nothing can be memorised"
              + (f" (the timed steps read {w['epochs']:.2f} epochs of the "
                 "corpus)" if "epochs" in w else "") + ".", "",
              f"- compile {w['compile_s']:.1f} s; {_streamed_text(w)}",
              f"- peak memory {_mib(w['peak_bytes'])} MB "
              f"({w['peak_source']}"
              + ("; every candidate's state held at once"
                 if w.get("variants") else "")
              + f"); XLA plan of the recipe's step {_mib(w['xla_bytes'])} MB",
              f"- the recipe's {w['recipe_tokens']:,} tokens: "
              f"{w['projected_hours']:.1f} hours on one GPU"]
    for v in w.get("variants", []):
      lines.append(f"- with {v['name']}: {_variant_text(v)}")
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
  if report.get("infer", {}).get("results"):
    lines += _infer_section(report["infer"])
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
  prof = report.get("profile", {})
  if prof:
    share = prof.get("share", {})
    lines += ["## profile: three WikiText-103 steps", ""]
    if prof.get("error"):
      lines += [f"error: {prof['error']}", ""]
    if prof.get("trace_archive"):
      lines += [f"- trace: `{prof['trace_archive']}` "
                f"({_mib(prof['trace_bytes'])} MB); open it with "
                f"`{prof['tensorboard']}`",
                "- step time by part (device ops): " + (
                    ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                              sorted(share.items(), key=lambda kv: -kv[1]))
                    or prof.get("share_error", "-"))]
    if prof.get("dump_archive"):
      lines.append(f"- XLA dump of the step: `{prof['dump_archive']}` "
                   f"({prof['dump_files']} files, "
                   f"{_mib(prof['dump_bytes'])} MB)")
    lines.append("")
  return "\n".join(lines)
