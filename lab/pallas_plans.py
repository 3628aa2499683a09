"""The fused kernel's launch plans timed side by side on one GPU.

`pallas.launch_plan` picks a program's batch rows, warps, U_s strategy
(held in registers or streamed from L2) and block rows from a register
estimate; this tool times the alternatives, each in the product's whole
train step, interleaved with the scan's step in one process, so that the
estimate can be checked against the GPU:

  python -m lab.pallas_plans [--groups=core_bf16,core_fp32,wt103]
                             [--out=FILE.json] [--dry_run]

  core_bf16, core_fp32  the core step of the GPU report's kernel stage
                        (hidden 1024, S=8 grouped, batch 64 x 64, 2 layers):
                        G=128
  wt103                 the WikiText-103 recipe's step (hidden 2048, S=8,
                        batch 128 x 128, bf16, adaptive head): G=256

Each plan is forced by standing in for `launch_plan` while its step is
traced. The kernel's dots, like the scan's XLA matmuls, take jax's default
matmul precision (TF32 for float32 on GPUs with tensor cores); float32 rows
marked "highest" trace the whole step, scan or kernel, under
jax.default_matmul_precision("highest"): IEEE float32 products. A plan that
does not compile or run is a row with its first error line. --dry_run: tiny
shapes in interpret mode on any CPU (checks the tool, measures nothing).
"""

import contextlib
import json

import jax
from absl import flags

from lab.benchmarks import gpu_kernel, table
from lab.benchmarks.gpu_stages import wt103_config, wt103_step_runner
from lab.benchmarks.shapes import SHAPES
from lab.benchmarks.steps import core_runner
from zebra_jax.cli import entry
from zebra_jax.errors import UserError
from zebra_jax.model.recurrence import pallas

Plan = pallas.Plan
GROUPS = ("core_bf16", "core_fp32", "wt103")


def _flags():
  flags.DEFINE_list("groups", list(GROUPS), f"Which of {', '.join(GROUPS)}.")
  flags.DEFINE_string("out", None, "Also write the rows to this JSON file.")
  flags.DEFINE_bool("dry_run", False, "Tiny shapes in interpret mode.")


def plans(group: str, dry: bool) -> list[tuple[str, Plan | None, str | None]]:
  """[(label, plan, matmul precision)] to time in a group beside the scan;
  launch_plan's own choice first. plan None: the scan."""
  if dry:
    return [("held", Plan(4, 4, "held", 8), None),
            ("streamed k4", Plan(4, 4, "streamed", 4), None),
            ("held highest", Plan(4, 4, "held", 8), "highest")]
  if group == "core_bf16":
    return [("held w8", Plan(16, 8, "held", 128), None),
            ("held w4", Plan(16, 4, "held", 128), None),
            ("held w8 32 rows", Plan(32, 8, "held", 128), None),
            ("streamed k64 w8", Plan(16, 8, "streamed", 64), None),
            ("streamed k32 w4", Plan(16, 4, "streamed", 32), None)]
  if group == "core_fp32":
    return [("streamed k64 w8", Plan(16, 8, "streamed", 64), None),
            ("streamed k32 w8", Plan(16, 8, "streamed", 32), None),
            ("streamed k32 w4", Plan(16, 4, "streamed", 32), None),
            ("held w8", Plan(16, 8, "held", 128), None),
            ("scan highest", None, "highest"),
            ("streamed k64 w8 highest", Plan(16, 8, "streamed", 64),
             "highest"),
            ("streamed k32 w8 highest", Plan(16, 8, "streamed", 32),
             "highest")]
  return [("streamed k64 w8", Plan(16, 8, "streamed", 64), None),
          ("streamed k32 w8", Plan(16, 8, "streamed", 32), None),
          ("streamed k32 w4", Plan(16, 4, "streamed", 32), None),
          ("streamed k128 w8", Plan(16, 8, "streamed", 128), None),
          ("streamed k16 w4", Plan(16, 4, "streamed", 16), None),
          ("streamed k64 w8 32 rows", Plan(32, 8, "streamed", 64), None)]


@contextlib.contextmanager
def _forced(plan: Plan | None, precision: str | None):
  """launch_plan returns `plan` (unless None) under the given default
  matmul precision while a step is traced."""
  saved = pallas.launch_plan
  if plan is not None:
    pallas.launch_plan = lambda *a, **k: plan
  try:
    with jax.default_matmul_precision(precision):
      yield
  finally:
    pallas.launch_plan = saved


def _traced_under(build, plan, precision):
  """build() with the plan and precision in force at every call: the
  precision is part of jit's cache key, so a call outside it would trace
  the step again at the default. The plan is not part of that key: the
  caches are cleared first, so that a step traced under another plan is
  never served again."""
  def built():
    jax.clear_caches()
    with _forced(plan, precision):
      step = build()
      step()

    def run():
      with _forced(plan, precision):
        step()
    return run
  return built


def _core(dtype: str, dry: bool):
  shape = {**SHAPES["quick" if dry else "gpu"], "dtype": dtype}
  stripes = shape["stripes"][-1]
  return (shape, stripes,
          lambda kernel: lambda: core_runner(shape, stripes, grouped=True,
                                             kernel=kernel))


def _wt103(dry: bool):
  cfg = wt103_config(dry)
  m, d = cfg.model, cfg.data
  shape = {"batch": d.batch_size, "seq_len": d.seq_len}

  def build(kernel):
    return lambda: wt103_step_runner(cfg, kernel, dry)
  return shape, m.num_stripes, build


def time_plans(group: str, dry: bool) -> list[dict]:
  """The scan's row and one row per plan, timed interleaved."""
  dtype = "float32" if group == "core_fp32" or dry else "bfloat16"
  if group == "wt103":
    shape, stripes, build = _wt103(dry)
  else:
    shape, stripes, build = _core(dtype, dry)
  chosen = plans(group, dry)
  cands = [("scan", build("scan"))] + [
      (label, _traced_under(build("scan" if plan is None else "pallas"),
                            plan, precision))
      for label, plan, precision in chosen]
  rows = gpu_kernel.time_group(shape, dtype, stripes, cands,
                               rounds=2 if dry else 7)
  scan_ms = rows[0].get("ms_per_step")
  for row, (label, plan, precision) in zip(rows[1:], chosen):
    row.update(name=label, precision=precision or "default",
               plan=pallas.describe(plan) if plan else "scan")
    if scan_ms and "ms_per_step" in row:
      row["x_scan"] = scan_ms / row["ms_per_step"]
  for row in rows:
    row["group"] = group
  return rows


def main(argv):
  del argv
  f = flags.FLAGS
  unknown = set(f.groups) - set(GROUPS)
  if unknown:
    raise UserError(f"unknown --groups {sorted(unknown)}: choose from "
                    f"{', '.join(GROUPS)}")
  if not f.dry_run and jax.default_backend() != "gpu":
    raise UserError("the plans are GPU launch plans: run on a GPU, or pass "
                    "--dry_run to check the tool on this CPU")
  rows = []
  for group in f.groups:
    got = time_plans(group, f.dry_run)
    rows += got
    table.print_step_rows(f"{group} ({jax.devices()[0].device_kind})", got,
                          "x_scan", "scan", 26)
    if f.out:
      with open(f.out, "w") as out:
        json.dump(rows, out, indent=1)


if __name__ == "__main__":
  _flags()
  entry.run_tool(main)
