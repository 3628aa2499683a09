"""Speed and memory benchmark: ZebraLSTM next to PyTorch nn.LSTM, one process.

Rows (tokens/s, ms/step, ratio to torch, model GFLOP/s and fraction of the
best matmul measured in this run, XLA's planned bytes per step):
  core_S{s}   stacked ZebraLSTMLayers + Adam, sum-of-squares loss on outputs
  core_S1_remat  core_S1 with model.remat (the gates recomputed), beside it
  core_S{s}_autodiff  the same with JAX's autodiff of the scan instead of the
              hand-written backward pass (recurrence.py)
  lm_S{s}     embedding -> layers -> tied head -> cross-entropy, + Adam
  eval_S{s}   the LM forward with carry (evaluate.eval_step)
  gen_S{s}_b{b}  one request of b rows through the serving engine
              (zebra_jax.engine, as --mode=sample runs it; steps.py
              gen_runner): a one-token prompt, then decode calls of
              sample.chunk tokens, from the full distribution; _nucleus:
              with the sample config's default temperature, top_k and top_p
  *_S{s}_grouped  the same with model.stripe_input=grouped: every matmul of
              a layer split in S blocks, stripes shuffled between layers
  *_native    the same with model.recurrence=native: the time loops as
              compiled C++ (model/recurrence/native.py; CPU shapes)
  core_*_native_bf16  the core's native rows with
              model.cpu_bf16_projections=auto: the window's products outside
              the time loops in bf16 with float32 sums (only where the CPU's
              AVX512_BF16 units run them)
  core_*_native_all_bf16  the same with model.cpu_bf16_recurrence=auto
              too: the time loops' recurrent products in bf16 as well
  word_S{s}[_grouped][_adaptive][_native]  the LM train step at the
              word-level shape (hidden 256, 16,384 words, Zipf-distributed
              tokens), full or adaptive head: where the softmax, not the
              recurrence, costs; _native as the product's default
              (model.recurrence=auto) runs it on a CPU
  head_tied   the head alone at the LM rows' shape: the tied 8,192-word
              matrix, bias and cross-entropy, forward and backward (the
              hidden states' gradient too), no optimizer
  *_cpu_bf16  head_tied and the LM's native rows with
              model.cpu_bf16_head=auto: the head's matmuls in bf16 on the
              CPU's AVX512_BF16 units (model/cpu_bf16_head.py; only where
              they run)
  *_fused_bf16  head_tied and the LM's native rows with both
              model.cpu_fused_head=auto and cpu_bf16_head=auto: the head's
              loss and gradients in one native call, its products in bf16
              (model/cpu_fused_head.py; only where they run)
  lm_*_all_bf16  the LM's native rows with every bf16 field configs/wlm.py
              sets: *_fused_bf16 and model.cpu_bf16_projections=auto
  head_adaptive  the same for the word-level shape's adaptive head, beside
              nn.AdaptiveLogSoftmaxWithLoss
  torch_*_{n}t  nn.LSTM (+ nn.Embedding and a tied head, or
              nn.AdaptiveLogSoftmaxWithLoss) of the same shape on n threads;
              ratios are against the faster thread count; float32 weights
              and Adam state, under torch.autocast in bfloat16 (as JAX
              keeps float32 parameters and computes in bfloat16)
  torch_*_bf16_{n}t  beside the JAX rows that multiply in bf16 on a float32
              shape (*_bf16): the same torch step under
              torch.autocast(bfloat16), oneDNN's bf16 kernels on where the
              CPU has them; those rows' "x torch bf16" is against its
              faster thread count, their "x torch" against float32 torch
Every timed function runs once untimed, then all run interleaved, round after
round, and each row reports its median: the machine's noise (other jobs) hits
every row alike, so on shared CPUs compare ratios, not absolute times. On a
CPU a row starts only once the last row's threads are idle (torch's OpenMP
workers spin on after a call: timing.settle).
Memory: one fresh process per window (peak RSS on CPU, peak_bytes_in_use on
GPU) and XLA's buffer plan.

FLOPs are the matmuls each step runs, counted analytically per token: input
projection 2*in*4H (grouped: /S), recurrence 2*H*4H/S, head 2*H*V (adaptive:
the shortlist, and each tail for the share of tokens it holds). A train step
runs each three times (forward, weight gradient, input gradient), except the
first layer's input gradient where nothing needs it: the core rows' inputs
are data (JAX never computes it; torch's autograd skips it too, the input not
requiring grad); the LM rows need it for the embedding. Remat's recomputed
matmuls are not counted (model FLOPs). The peak is the best measured matmul
of several shapes in the compute dtype, the steps' own among them, XLA's and
(torch installed) torch's timed interleaved, each call at least 10 ms of
work even at the datasheet's rate, both printed by shape, shown beside the
datasheet's dense bf16 figure where the device is known; a row above 100% of
it would mean the peak is wrong, and the output says so.
"""

import functools
import os

import jax

from lab.benchmarks.flops import head_step_flops, step_flops, torch_flops
from lab.benchmarks.memory import memory_rows
from lab.benchmarks.shapes import SHAPES, word_shape
from lab.benchmarks.steps import (core_runner, eval_runner, gen_runner,
                                  head_runner, lm_runner, word_runner)
from lab.benchmarks.table import print_rows, ratio_text, speed_columns
from lab.benchmarks.timing import datasheet, matmul_peak, time_interleaved
from lab.benchmarks.torch_reference import (TORCH_GROUPS, torch_matmuls,
                                            torch_runners)
from lab.benchmarks import traces
from lab.benchmarks.traces import trace_rows
from zebra_jax import strict_json
from zebra_jax.model import cpu_bf16_head
from zebra_jax.runtime import profiling

def row_specs(shape) -> dict:
  """{group: {row: (build, tokens per call, FLOPs per token)}}: build()
  compiles the row's runner, so that a caller compiles a group's rows just
  before timing them (and can time a few rows first)."""
  b, t = shape["batch"], shape["seq_len"]
  word = word_shape(shape)
  first, last = shape["stripes"][0], shape["stripes"][-1]
  grouped = shape["grouped_stripes"]
  lm_rows = [(s, False) for s in shape["lm_stripes"]] + [
      (s, True) for s in grouped]
  # model.recurrence=native beside the scan: the first dense and the last
  # grouped setting (CPU shapes only)
  native_rows = ([(first, False), (grouped[-1], True)] if shape.get("native")
                 else [])
  # model.cpu_bf16_head=auto beside float32 where it runs the bf16 units
  bf16 = bool(shape.get("native")) and not cpu_bf16_head.unavailable()
  suffix = lambda is_grouped: "_grouped" if is_grouped else ""
  core_flops = lambda s, g=False: step_flops(shape, s, grouped=g,
                                             input_grad=False)
  lm_flops = lambda s, g, train=True: step_flops(shape, s, grouped=g,
                                                 head="full", train=train)
  p = functools.partial
  groups = {
      "core": {
          **{f"core_S{s}": (p(core_runner, shape, s), b * t, core_flops(s))
             for s in shape["stripes"]},
          f"core_S{first}_remat": (p(core_runner, shape, first, remat=True),
                                   b * t, core_flops(first)),
          **{f"core_S{s}_grouped": (p(core_runner, shape, s, grouped=True),
                                    b * t, core_flops(s, True))
             for s in grouped},
          **{f"core_S{s}_autodiff": (p(core_runner, shape, s,
                                       custom_vjp=False),
                                     b * t, core_flops(s))
             for s in (first, last)},
          **{f"core_S{s}{suffix(g)}_native": (
              p(core_runner, shape, s, grouped=g, kernel="native"), b * t,
              core_flops(s, g)) for s, g in native_rows},
          **{f"core_S{s}{suffix(g)}_native_bf16": (
              p(core_runner, shape, s, grouped=g, kernel="native",
                bf16_projections=True), b * t,
              core_flops(s, g)) for s, g in native_rows if bf16},
          **{f"core_S{s}{suffix(g)}_native_all_bf16": (
              p(core_runner, shape, s, grouped=g, kernel="native",
                bf16_projections=True, bf16_recurrence=True), b * t,
              core_flops(s, g)) for s, g in native_rows if bf16}},
      "lm": {**{f"lm_S{s}{suffix(g)}": (p(lm_runner, shape, s, grouped=g),
                                        b * t, lm_flops(s, g))
                for s, g in lm_rows},
             **{f"lm_S{s}{suffix(g)}_native": (
                 p(lm_runner, shape, s, grouped=g, kernel="native"), b * t,
                 lm_flops(s, g)) for s, g in native_rows},
             **{f"lm_S{s}{suffix(g)}_native_cpu_bf16": (
                 p(lm_runner, shape, s, grouped=g, kernel="native",
                   cpu_bf16_head="auto"), b * t,
                 lm_flops(s, g)) for s, g in native_rows if bf16},
             **{f"lm_S{s}{suffix(g)}_native_fused_bf16": (
                 p(lm_runner, shape, s, grouped=g, kernel="native",
                   cpu_bf16_head="auto", cpu_fused_head="auto"), b * t,
                 lm_flops(s, g)) for s, g in native_rows if bf16},
             **{f"lm_S{s}{suffix(g)}_native_all_bf16": (
                 p(lm_runner, shape, s, grouped=g, kernel="native",
                   cpu_bf16_head="auto", cpu_fused_head="auto",
                   cpu_bf16_projections="auto", cpu_bf16_recurrence="auto"),
                 b * t,
                 lm_flops(s, g)) for s, g in native_rows if bf16}},
      "head": {"head_tied": (p(head_runner, shape), b * t,
                             head_step_flops(shape, "full")),
               **({"head_tied_cpu_bf16": (
                   p(head_runner, shape, cpu_bf16_head="auto"), b * t,
                   head_step_flops(shape, "full")),
                   "head_tied_fused_bf16": (
                       p(head_runner, shape, cpu_bf16_head="auto",
                         cpu_fused_head="auto"), b * t,
                       head_step_flops(shape, "full"))} if bf16 else {})},
      "eval": {**{f"eval_S{s}{suffix(g)}": (p(eval_runner, shape, s, g),
                                            b * t, lm_flops(s, g, train=False))
                  for s, g in lm_rows},
               **{f"eval_S{s}{suffix(g)}_native": (
                   p(eval_runner, shape, s, g, kernel="native"), b * t,
                   lm_flops(s, g, train=False)) for s, g in native_rows}},
      "gen": {f"gen_S{s}{suffix(g)}_b{gb}{'_nucleus' if n else ''}": (
                  p(gen_runner, shape, s, gb, g, nucleus=n),
                  gb * shape["gen_tokens"], lm_flops(s, g, train=False))
              for s, g in lm_rows for gb in (1, b) for n in (False, True)},
  }
  for head in ("full", "adaptive"):
    name = "word" if head == "full" else "word_adaptive"
    tag = "" if head == "full" else "_adaptive"
    rows = [(s, g, "scan") for s, g in ((1, False), (last, True))] + [
        (s, g, "native") for s, g in native_rows]
    groups[name] = {
        f"word_S{s}{suffix(g)}{tag}{'' if k == 'scan' else '_native'}": (
            p(word_runner, word, s, grouped=g, head=head, kernel=k), b * t,
            step_flops(word, s, grouped=g, head=head))
        for s, g, k in rows}
  groups["head_adaptive"] = {"head_adaptive": (
      p(head_runner, word, "adaptive"), b * t,
      head_step_flops(word, "adaptive"))}
  return groups


def time_group(shape, group, specs, torch_fns, rounds, peak,
               trace_dir=None) -> tuple[list[dict], dict]:
  """(rows, trace breakdown) of one group: its rows compiled, then timed
  interleaved with torch's rows of the group (ratios are against the
  fastest torch thread count); trace_dir: one profiled step of each JAX row
  afterwards, into trace_dir/group."""
  b, t = shape["batch"], shape["seq_len"]
  runners = {name: build() for name, (build, _, _) in specs.items()}
  fns = dict(runners)
  torch_name = f"torch_{group}"
  for tag, by_threads in (("", torch_fns.get(group, {})),
                          ("_bf16", torch_fns.get(f"{group}_bf16", {}))):
    for threads, fn in by_threads.items():
      fns[f"{torch_name}{tag}_{threads}t"] = fn
  sec = time_interleaved(fns, rounds)
  torch_secs = {n: v for n, v in sec.items() if n.startswith(torch_name)}
  bf16_secs = [v for n, v in torch_secs.items() if "_bf16_" in n]
  base = min((v for n, v in torch_secs.items() if "_bf16_" not in n),
             default=None)
  bf16_base = min(bf16_secs) if bf16_secs else None
  rows = [_row(name, group, sec[name], tokens, flops, peak, base,
               getattr(runners[name], "compiled", None),
               bf16_base if name.endswith("_bf16") else None)
          for name, (_, tokens, flops) in specs.items()]
  rows += [_row(name, group, torch_sec, b * t, torch_flops(shape)[group],
                peak, base) for name, torch_sec in torch_secs.items()]
  breakdown = (trace_rows(os.path.join(trace_dir, group), runners)
               if trace_dir else {})
  return rows, breakdown


def speed_rows(shape, rounds, trace_dir=None, groups=None):
  """Every timed row, group after group, each group compiled just before
  it is timed; groups: only these (None: all)."""
  specs_by_group = {g: specs for g, specs in row_specs(shape).items()
                    if groups is None or g in groups}
  torch_fns, torch_note = torch_runners(
      shape, tuple(g for g in TORCH_GROUPS if g in specs_by_group))
  # torch under autocast(bfloat16) beside the groups whose JAX rows
  # multiply in bf16 on this float32 shape
  bf16_groups = tuple(g for g, specs in specs_by_group.items()
                      if g in TORCH_GROUPS and shape["dtype"] == "float32"
                      and any(n.endswith("_bf16") for n in specs))
  if torch_fns and bf16_groups:
    bf16_fns, bf16_note = torch_runners(shape, bf16_groups,
                                        autocast_bf16=True)
    torch_fns.update({f"{g}_bf16": fns for g, fns in bf16_fns.items()})
    torch_note += f"; {bf16_note}"
  peak, peak_by_shape, torch_by_shape = matmul_peak(shape, rounds,
                                                    torch_matmuls(shape))
  rows, breakdown = [], {}
  for group, specs in specs_by_group.items():
    group_rows, group_breakdown = time_group(shape, group, specs, torch_fns,
                                             rounds, peak, trace_dir)
    rows += group_rows
    breakdown.update(group_breakdown)
  return rows, peak, peak_by_shape, torch_by_shape, torch_note, breakdown


def _row(name, group, sec, tokens, flops, peak, torch_sec, compiled=None,
         torch_bf16_sec=None):
  gflops = flops * tokens / sec / 1e9
  return {"name": name, "group": group, "tokens_per_s": tokens / sec,
          "ms_per_step": 1e3 * sec,
          "ratio_to_torch": None if torch_sec is None else torch_sec / sec,
          "ratio_to_torch_bf16": (None if torch_bf16_sec is None
                                  else torch_bf16_sec / sec),
          "gflops": gflops, "frac_of_peak": gflops * 1e9 / peak,
          "xla_bytes": profiling.compiled_bytes(compiled) if compiled else None}


# ------------------------------------------------------------ reporting


def _mb(x):
  return "-" if x is None else f"{x / 2 ** 20:,.0f} MB"


def peak_text(result) -> str:
  """The best measured matmul beside the datasheet's figure."""
  sheet = result["datasheet_bf16_tflops"]
  return (f"best measured matmul {result['matmul_peak_gflops']:,.0f} GFLOP/s "
          f"({result['config']['dtype']}); datasheet dense bf16 "
          + (f"{sheet:,.0f} TFLOP/s ({result['datasheet']})" if sheet
             else "unknown"))


def print_table(result, trace_dir=None) -> None:
  print(f"\n{result['device']} | shape {result['shape']} | "
        f"{peak_text(result)} | {result['torch']}")
  for who, key in (("XLA", "matmul_gflops_by_shape"),
                   ("torch", "torch_matmul_gflops_by_shape")):
    if result.get(key):
      print(f"{who} matmul GFLOP/s by shape: " + ", ".join(
          f"{k} {v:,.0f}" for k, v in result[key].items()))
  bf16 = any(r.get("ratio_to_torch_bf16") for r in result["rows"])
  print_rows(result["rows"], speed_columns(28, 11) + [
      *([("x torch bf16", 14,
          lambda r: ratio_text(r["ratio_to_torch_bf16"]))] if bf16 else []),
      ("model GFLOP/s", 14, lambda r: f"{r['gflops']:.1f}"),
      ("% peak", 8, lambda r: f"{100 * r['frac_of_peak']:.0f}%"),
      ("XLA plan", 11, lambda r: _mb(r["xla_bytes"]))])
  if result.get("memory"):
    print(f"\nLM step S=1, batch {result['config']['batch']}: peak memory")
    print(f"{'window':>7}{'remat':>7}{'measured peak':>15}{'XLA plan':>11}")
    for m in result["memory"]:
      print(f"{m['seq_len']:>7}{str(m['remat']):>7}{_mb(m['peak_bytes']):>15}"
            f"{_mb(m['xla_bytes']):>11}   ({m['peak_source']})")
    fit = result["max_window"]
    print(f"largest window in {fit['budget_gb']} GB (XLA plan, linear fit): "
          f"{fit['max_seq_len']}")
  if result.get("trace_breakdown"):
    print(f"\ndevice time of one traced step, ms by kind of op "
          f"(trace in {trace_dir or 'the trace folder'})")
    print(f"{'row':<28}" + "".join(f"{k:>21}" for k in traces.KINDS)
          + f"{'ops':>8}")
    for name, b in result["trace_breakdown"].items():
      print(f"{name:<28}" + "".join(f"{b[k]:>21.1f}" for k in traces.KINDS)
            + f"{b['ops']:>8}")
  for note in result["notes"]:
    print(f"note: {note}")


def group_names(shape_name: str = "A") -> tuple:
  """The row groups of a shape, in the order they run."""
  return tuple(row_specs(SHAPES[shape_name]))


def run(quick: bool = False, shape_name: str = "A", json_path=None,
        rounds: int = 0, memory: bool = True, trace_dir=None,
        groups=None) -> dict:
  """Runs every row (of `groups`, None: all); prints the table; returns
  (and optionally writes) it."""
  shape = SHAPES["quick" if quick else shape_name]
  rounds = rounds or (3 if quick else 7)
  rows, peak, peak_by_shape, torch_by_shape, torch_note, breakdown = (
      speed_rows(shape, rounds, trace_dir, groups))
  notes = [torch_note] if torch_note else []
  # bf16 rows on a float32 shape multiply at a rate the float32 peak does
  # not bound; they are named once, apart from the rows that beat it
  bf16 = [r["name"] for r in rows
          if r["name"].endswith("_bf16") or "_bf16_" in r["name"]]
  over = [r["name"] for r in rows
          if r["frac_of_peak"] > 1.0 and r["name"] not in bf16]
  if over:  # nothing is clamped: the peak, not the row, is wrong
    notes.append(f"{', '.join(over)} above the best measured matmul: the "
                 "peak underestimates this machine (load changed while "
                 "timing, or a faster matmul shape exists)")
  if bf16 and shape["dtype"] == "float32":
    notes.append(f"{', '.join(bf16)} multiply in bf16: their % peak is of "
                 "the float32 peak, which bf16 units can exceed")
  sheet, sheet_name = datasheet(jax.devices()[0].device_kind)
  result = {"device": f"{jax.devices()[0].device_kind} x1 "
                      f"({os.cpu_count()} CPU cores visible)",
            "shape": "quick" if quick else shape_name,
            "config": {k: v for k, v in shape.items()},
            "matmul_peak_gflops": peak / 1e9,
            "datasheet_bf16_tflops": sheet and sheet / 1e12,
            "datasheet": sheet_name,
            "matmul_gflops_by_shape": peak_by_shape,
            "torch_matmul_gflops_by_shape": torch_by_shape,
            "torch": torch_note or "-",
            "rows": rows, "notes": notes}
  if breakdown:
    result["trace_breakdown"] = breakdown
  if memory:
    result["memory"], result["max_window"] = memory_rows(
        result["shape"], fresh_processes=not quick)
    if quick:
      notes.append("quick: memory rows share one process, so their peaks "
                   "are cumulative")
  print_table(result, trace_dir)
  if json_path:
    with open(json_path, "w") as f:
      strict_json.dump(result, f, indent=1)
  return result
