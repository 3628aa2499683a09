"""The head's gradient dots in the compute dtype against float32 ones, in
the WikiText-103 recipe's train step, timed side by side on one GPU.

`mixed_precision.matmul` casts a float32-result matmul's cotangent to the
compute dtype (bf16), so its gradient dots read bf16 operands; a plain
`einsum(..., preferred_element_type=float32)` gets them promoted to float32
(TF32 on the GPU). Each row is the product's whole step with one or the
other standing in for `mixed_precision.matmul` while it is traced, with the
scan and with the fused kernel, all timed interleaved in one process:

  python -m lab.mixed_grads [--out=FILE.json] [--dry_run]

--dry_run: tiny shapes on any CPU (checks the tool, measures nothing).
"""

import contextlib
import json

import jax
import jax.numpy as jnp
from absl import flags

from lab.benchmarks import gpu_kernel, gpu_stages, table
from zebra_jax.cli import entry
from zebra_jax.errors import UserError
from zebra_jax.model import mixed_precision


def _flags():
  flags.DEFINE_string("out", None, "Also write the rows to this JSON file.")
  flags.DEFINE_bool("dry_run", False, "Tiny shapes (any CPU).")


def float32_gradients(spec, x, w, dtype):
  """The plain einsum: its gradient dots promote to float32."""
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32)


@contextlib.contextmanager
def _matmul(fn):
  saved = mixed_precision.matmul
  if fn is not None:
    mixed_precision.matmul = fn
  try:
    yield
  finally:
    mixed_precision.matmul = saved


def _build(cfg, recurrence: str, fn, dry: bool):
  """A step of the recipe traced with fn as the matmul (None: the
  product's); jit's caches cleared first, since the swapped function is
  not part of their key."""
  def built():
    jax.clear_caches()
    with _matmul(fn):
      return gpu_stages.wt103_step_runner(cfg, recurrence, dry)
  return built


def time_rows(dry: bool) -> list[dict]:
  cfg = gpu_stages.wt103_config(dry)
  cfg.model.dtype = "bfloat16"  # the recipe's; tiny's is float32
  m, d = cfg.model, cfg.data
  shape = {"batch": d.batch_size, "seq_len": d.seq_len}
  recurrences = ["scan"] + ([] if dry else ["pallas"])
  cands = []
  for recurrence in recurrences:
    cands += [(f"{recurrence} bf16 grads", _build(cfg, recurrence, None, dry)),
              (f"{recurrence} f32 grads",
               _build(cfg, recurrence, float32_gradients, dry))]
  rows = gpu_kernel.time_group(shape, m.dtype, m.num_stripes, cands,
                               rounds=2 if dry else 7)
  for row, (label, _) in zip(rows, cands):
    row["name"] = label
  by_name = {r["name"]: r for r in rows}
  for recurrence in recurrences:
    new, old = (by_name[f"{recurrence} {k} grads"] for k in ("bf16", "f32"))
    if "ms_per_step" in new and "ms_per_step" in old:
      new["x_f32_grads"] = old["ms_per_step"] / new["ms_per_step"]
  return rows


def main(argv):
  del argv
  f = flags.FLAGS
  if not f.dry_run and jax.default_backend() != "gpu":
    raise UserError("this compares GPU matmuls: run on a GPU, or pass "
                    "--dry_run to check the tool on this CPU")
  rows = time_rows(f.dry_run)
  table.print_step_rows(f"wt103 step ({jax.devices()[0].device_kind})",
                        rows, "x_f32_grads", "f32 grads", 20, digits=3)
  if f.out:
    with open(f.out, "w") as out:
      json.dump(rows, out, indent=1)


if __name__ == "__main__":
  _flags()
  entry.run_tool(main)
