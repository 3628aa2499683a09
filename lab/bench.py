"""Speed and memory benchmark: ZebraLSTM next to PyTorch nn.LSTM, one process.

  python -m lab.bench                      # shape A, CPU or GPU (minutes)
  python -m lab.bench --shape=gpu          # bf16, hidden 1024, batch 64
  python -m lab.bench --quick --json=/tmp/bench.json   # tiny, seconds
  python -m lab.bench --groups=lm,head --memory=false   # some rows only

The rows, how they are timed and how their FLOPs are counted:
lab/benchmarks/speed.py.
"""

import os

from absl import flags

from lab.benchmarks import speed
from lab.benchmarks.shapes import NO_PREALLOCATE
from zebra_jax.cli import entry
from zebra_jax.errors import UserError


def _flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_bool("quick", False, "Tiny shapes: a smoke test in seconds.")
  flags.DEFINE_string("json", None, "Also write the results here.")
  flags.DEFINE_enum("shape", "A", ["A", "gpu"], "A: hidden 512, batch 32, "
                    "fp32. gpu: hidden 1024, batch 64, bf16.")
  flags.DEFINE_integer("rounds", 0, "Timing rounds (0 = default).")
  flags.DEFINE_bool("memory", True, "Run the memory-per-window rows.")
  flags.DEFINE_list("groups", None, "Only these groups of rows, e.g. "
                    "lm,head (default: all): "
                    + ", ".join(speed.group_names()) + ".")
  flags.DEFINE_string("trace_dir", None, "jax.profiler trace of one step of "
                      "every JAX row, for TensorBoard/xprof, and a table of "
                      "its device time by kind of op.")


def main(argv):
  del argv
  f = flags.FLAGS
  # Before JAX starts its backend: the memory rows' processes need the GPU
  # memory this one would otherwise reserve.
  for key, value in NO_PREALLOCATE.items():
    os.environ.setdefault(key, value)
  groups = f.groups and tuple(f.groups)
  unknown = sorted(set(groups or ()) - set(speed.group_names(f.shape)))
  if unknown:
    raise UserError(f"--groups: no group {', '.join(unknown)} (there are "
                    f"{', '.join(speed.group_names(f.shape))})")
  speed.run(f.quick, f.shape, f.json, f.rounds, f.memory, f.trace_dir,
            groups)


if __name__ == "__main__":
  _flags()
  entry.run_tool(main)  # glibc's malloc set before JAX starts its backend
