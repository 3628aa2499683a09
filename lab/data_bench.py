"""How fast the input pipeline feeds the train step, on synthetic ids.

  python -m lab.data_bench --step_tokens_per_s=250000   # wt103 shapes
  python -m lab.data_bench --quick                      # seconds

What is timed: lab/benchmarks/input_pipeline.py.
"""

from absl import flags

from lab.benchmarks import input_pipeline
from zebra_jax.cli import entry


def _define_flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_integer("num_tokens", 100_000_000,
                       "Synthetic ids in the memmap.")
  flags.DEFINE_integer("batch_size", 128, "Global batch rows.")
  flags.DEFINE_integer("seq_len", 128, "Tokens per window.")
  flags.DEFINE_integer("num_batches", 2000, "Batches timed per mode.")
  flags.DEFINE_integer("vocab_size", 267_735, "Id range.")
  flags.DEFINE_float("step_tokens_per_s", 0.0,
                     "The train step's tokens/s at these shapes.")
  flags.DEFINE_bool("quick", False, "1M tokens, 50 batches.")


def main(argv):
  del argv  # Everything comes from flags.
  f = flags.FLAGS
  input_pipeline.run(1_000_000 if f.quick else f.num_tokens, f.batch_size,
                     f.seq_len, 50 if f.quick else f.num_batches,
                     f.vocab_size, f.step_tokens_per_s)


if __name__ == "__main__":
  _define_flags()
  entry.run_tool(main)
