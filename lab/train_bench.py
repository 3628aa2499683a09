"""End to end: the real training loop against a PyTorch loop of the same recipe.

  python -m lab.train_bench                  # shape A, S = 1 and 8
  python -m lab.train_bench --shape=word     # 16k-word vocabulary
  python -m lab.train_bench --stripes=8 --stripe_input=grouped
  python -m lab.train_bench --quick --json=/tmp/tb.json  # tiny,
      # a few steps, torch on 1 thread only: a smoke test

The shapes and how both sides are timed: lab/benchmarks/training_loop.py.
"""

from typing import Sequence

from absl import flags, logging

from lab.benchmarks import training_loop
from zebra_jax.cli import entry
from zebra_jax.errors import UserError


def main(argv: Sequence[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  f = flags.FLAGS
  if f.config is None:
    raise UserError("pass --config=FILE, e.g. --config=base")
  try:
    stripes = [int(s) for s in f.stripes]
  except ValueError as e:
    raise UserError(f"--stripes={','.join(f.stripes)}: expected integers, "
                    "e.g. --stripes=1,8") from e
  training_loop.run(f.config, "quick" if f.quick else f.shape, stripes,
                    f.stripe_input, f.steps, f.warmup, f.json)


def _define_flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file(
      "config", entry.default_config("base"), "Config file[:variant] "
      "whose optimizer, dropout and dtype both sides use; override fields "
      "with --config.x=y (default: base).")
  flags.DEFINE_enum("shape", "A",
                    [s for s in training_loop.SHAPES if s != "quick"],
                    "A: hidden 512, characters. word: hidden 256, 16k words.")
  flags.DEFINE_list("stripes", ["1", "8"], "num_stripes of the JAX rows.")
  flags.DEFINE_enum("stripe_input", "dense", ["dense", "grouped"],
                    "model.stripe_input of the JAX rows.")
  flags.DEFINE_integer("steps", 0, "Timed steps per row (0 = the shape's).")
  flags.DEFINE_integer("warmup", 0, "Steps before the timing starts, "
                       "compilation included (0 = the shape's).")
  flags.DEFINE_bool("quick", False, "Tiny shape, a few steps: seconds.")
  flags.DEFINE_string("json", None, "Also write the results here.")


if __name__ == "__main__":
  _define_flags()
  entry.run_tool(main)
