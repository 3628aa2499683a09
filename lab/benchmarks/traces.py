"""Reading jax.profiler traces: device time by kind of op (matmul, data
movement, the rest) and by part of the step (layers, head, optimizer).
"""

import re

import jax

from zebra_jax.model.recurrence import native
from zebra_jax.runtime import profiling

def trace_rows(trace_dir, runners) -> dict:
  """One profiled call of every JAX row, each under its own step name;
  returns each row's device time by kind of op (`trace_breakdown`)."""
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  for i, (name, fn) in enumerate(runners.items()):
    with jax.profiler.StepTraceAnnotation(name, step_num=i):
      fn()
  jax.profiler.stop_trace()
  return trace_breakdown(trace_dir, list(runners))


# What the ops of a trace do, from their HLO names: matmuls (XLA's own dot
# ops, or the library calls it fuses them into: YNNPACK/XNNPACK/oneDNN on
# CPUs, cuBLAS/Triton GEMMs on GPUs), moves of data (layout copies, the
# per-time-step writes of a scan into its window buffers, concatenations), the
# native time loops (model.recurrence=native: custom calls, a whole loop's
# matmuls and gate math each), and the rest (elementwise fusions such as the
# gate math, reductions).
_MATMUL_OPS = ("dot", "ynn", "xnn", "onednn", "cublas", "gemm", "triton_gemm",
               "convolution")
_DATA_MOVES = ("copy", "dynamic-update-slice", "dynamic-slice", "concatenate",
               "transpose", "slice")


KINDS = ("matmul", "data movement", "native time loops", "elementwise & other")


def op_kind(hlo_op: str) -> str | None:
  """One of KINDS for an HLO op name; None for loop ops, whose events span
  their bodies' ops."""
  if hlo_op.startswith(("custom-call", "ffi_call")):  # jax.ffi.ffi_call
    return "native time loops"
  words = hlo_op.split(".")[0].split("_")
  if words[0] in ("while", "conditional", "call"):
    return None
  if any(w.startswith(_MATMUL_OPS) for w in words):
    return "matmul"
  if any(w in _DATA_MOVES for w in words):
    return "data movement"
  return "elementwise & other"


def trace_breakdown(trace_dir: str, names: list[str]) -> dict:
  """{row: {kind: ms, "ops": count}} from the perfetto trace of _trace_rows:
  the op events (args.hlo_op) inside each row's step annotation."""
  events = profiling.trace_op_events(trace_dir)
  if events is None:
    return {}
  spans = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
           if e.get("name") in names}
  result = {}
  for name, (start, end) in spans.items():
    kinds = dict.fromkeys(KINDS, 0.0)
    ops = 0
    for e in events:
      op = e.get("args", {}).get("hlo_op")
      kind = op_kind(op) if op else None
      if kind and start <= e["ts"] <= end:
        kinds[kind] += e.get("dur", 0) / 1e3
        ops += 1
    result[name] = {**kinds, "ops": ops}
  return result


def scope_category(op_name: str) -> str:
  """An HLO op's named-scope path (e.g. "jit(step)/transpose(jvp(head))/dot")
  -> the part of the step it belongs to."""
  words = set(re.findall(r"\w+", op_name))
  if "optimizer" in words:
    return "optimizer"
  if any(w.startswith("zebra_lstm") for w in words):
    return "lstm_layers"
  if words & {"head", "loss", "accuracy"}:
    return "head"
  if "embedding" in words:
    return "embedding"
  return "other"


def bf16_matmul_calls(hlo_text: str) -> frozenset:
  """The HLO instructions that call the native library's bf16 matmul
  (model.cpu_bf16_head, model.cpu_bf16_projections): custom calls that
  are matmuls, where `op_kind` takes a custom call for a time loop."""
  return frozenset(re.findall(
      r"%?([\w.\-]+) = [^\n]*?custom_call_target=\"" + native.BF16_MATMUL,
      hlo_text))


def hlo_op_scopes(hlo_text: str) -> dict:
  """{HLO instruction name: its op_name metadata} from compiled HLO text."""
  scopes = {}
  for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"",
                       hlo_text):
    scopes[m.group(1)] = m.group(2)
  return scopes


def summarise_trace(trace_dir: str, hlo_text: str) -> dict:
  """Device time per part of the step from a jax.profiler trace.

  Reads the trace's .trace.json.gz (written with create_perfetto_trace):
  every op event names its HLO instruction (args.hlo_op); the compiled
  HLO's metadata gives that instruction's named-scope path. Returns
  {category: share of the attributed time} and the seconds behind it.
  """
  events = profiling.trace_op_events(trace_dir)
  if events is None:
    return {"error": f"no .trace.json.gz under {trace_dir}"}
  scopes = hlo_op_scopes(hlo_text)
  seconds = {}
  for e in events:
    op = e.get("args", {}).get("hlo_op")
    if not op:
      continue
    category = scope_category(scopes.get(op, ""))
    seconds[category] = seconds.get(category, 0.0) + e.get("dur", 0) / 1e6
  total = sum(seconds.values())
  return {"seconds": seconds,
          "share": {k: v / total for k, v in seconds.items()} if total else {},
          "trace_dir": trace_dir}
