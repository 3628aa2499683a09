"""Striped vs classic LSTM: time to perplexity at equal wall-clock, over seeds.

  launch/compare_stripes.sh char       # results/stripes_vs_classic/char
  python -m lab.experiments --out=results/mine --budget_minutes=3.25 \
      --seeds=0,1,2 --stripes=1,4,8 --grouped=4,8,16 --equal_time=4,8,16 \
      --config=demo --config.optim.learning_rate=1e-3  # any field

The settings, the fairness rules and the outputs:
lab/benchmarks/stripes_experiment.py.
"""

from typing import Sequence

from absl import flags
from ml_collections import config_flags

from lab.benchmarks import stripes_experiment
from zebra_jax.cli import entry
from zebra_jax.errors import UserError


def main(argv: Sequence[str]) -> None:
  del argv  # everything comes from flags
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  f = flags.FLAGS
  if f.config is None:
    raise UserError("pass --config=FILE, e.g. --config=demo")
  ints = lambda values: [int(x) for x in values]
  results = stripes_experiment.run(
      f.config, f.out, f.budget_minutes, ints(f.seeds), ints(f.stripes),
      not f.no_classic, f.margin, f.eval_points, f.curve_eval_batches,
      grouped=ints(f.grouped), equal_time=ints(f.equal_time),
      targets=[float(x) for x in f.targets])
  print(results["markdown"], flush=True)


def _define_flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  config_flags.DEFINE_config_file(
      "config", entry.default_config("demo"), "Config file[:variant]; "
      "override fields with --config.x=y (default: demo).")
  flags.DEFINE_string("out", "runs/compare_stripes",
                      "Results go here; run folders in OUT/workdirs.")
  flags.DEFINE_float("budget_minutes", 3.25, "Wall-clock budget per run.")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  flags.DEFINE_list("stripes", ["1", "4", "8"],
                    "num_stripes values with dense stripe input.")
  flags.DEFINE_list("grouped", [], "num_stripes values with grouped stripe "
                    "input (model.stripe_input=grouped), e.g. 4,8,16.")
  flags.DEFINE_list("equal_time", [], "grouped num_stripes values also run "
                    "at the width whose step time is the classic LSTM's.")
  flags.DEFINE_list("targets", [], "Perplexities to report the time to reach "
                    "(default: the classic LSTM's final one, and 1.25x it).")
  flags.DEFINE_bool("no_classic", False,
                    "Skip the parameter-matched classic LSTMs.")
  flags.DEFINE_float("margin", 1.2,
                     "Planned steps = steps/s x budget x margin.")
  flags.DEFINE_integer("eval_points", 12, "In-loop valid evaluations per run.")
  flags.DEFINE_integer("curve_eval_batches", 10,
                       "Valid windows per in-loop evaluation (0 = all).")


if __name__ == "__main__":
  _define_flags()
  entry.run_tool(main)
