"""Striped vs classic LSTM at equal wall-clock, over seeds.

  launch/compare_stripes.sh runs/compare 1.5 0,1,2      # OUT MINUTES SEEDS
  python -m zebra_jax.tools.experiments --out=runs/compare --budget_minutes=1.5 \
      --seeds=0,1,2 --stripes=1,2,4,8 --config=configs/demo.py \
      --config.optim.learning_rate=1e-3                 # any field, as in main

The settings, the fairness rules and the outputs:
zebra_jax/benchmarks/stripes_experiment.py.
"""

from typing import Sequence

from absl import flags
from ml_collections import config_flags

from zebra_jax.benchmarks import stripes_experiment
from zebra_jax.cli import entry
from zebra_jax.errors import UserError


def main(argv: Sequence[str]) -> None:
  del argv  # everything comes from flags
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  f = flags.FLAGS
  if f.config is None:
    raise UserError("pass --config=FILE, e.g. --config=configs/demo.py")
  ints = lambda values: [int(x) for x in values]
  results = stripes_experiment.run(
      f.config, f.out, f.budget_minutes, ints(f.seeds), ints(f.stripes),
      not f.no_classic, f.margin, f.eval_points, f.curve_eval_batches,
      grouped=ints(f.grouped))
  print(results["markdown"], flush=True)


def _define_flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  config_flags.DEFINE_config_file(
      "config", entry.default_config("demo.py"), "Config file[:variant]; "
      "override fields with --config.x=y (default: configs/demo.py).")
  flags.DEFINE_string("out", "runs/compare_stripes",
                      "Results and run folders go here.")
  flags.DEFINE_float("budget_minutes", 1.5, "Wall-clock budget per run.")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  flags.DEFINE_list("stripes", ["1", "2", "4", "8"],
                    "num_stripes values with dense stripe input.")
  flags.DEFINE_list("grouped", [], "num_stripes values with grouped stripe "
                    "input (model.stripe_input=grouped), e.g. 2,4,8.")
  flags.DEFINE_bool("no_classic", False,
                    "Skip the parameter-matched classic LSTMs.")
  flags.DEFINE_float("margin", 1.2,
                     "Planned steps = steps/s x budget x margin.")
  flags.DEFINE_integer("eval_points", 5, "In-loop valid evaluations per run.")
  flags.DEFINE_integer("curve_eval_batches", 10,
                       "Valid windows per in-loop evaluation (0 = all).")


if __name__ == "__main__":
  _define_flags()
  entry.run_tool(main)
