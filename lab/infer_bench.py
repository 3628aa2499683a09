"""Generation throughput and latency per batch size, of a trained workdir.

  python -m lab.infer_bench --workdir=runs/demo --batch_sizes=1,8,64

What is measured and how: lab/benchmarks/inference.py.
"""

from absl import flags

from zebra_jax.cli import arguments, entry
from lab.benchmarks import inference


def main(argv) -> None:
  """argv[1:]: the --config.x=y overrides, applied to the config read once."""
  f = flags.FLAGS
  cfg, workdir = arguments.load("infer_bench", f.config, f.workdir, argv[1:])
  inference.run(cfg, workdir, f.batch_sizes, new_tokens=f.new_tokens,
                prompt_len=f.prompt_len, requests=f.requests,
                json_path=f.json)


def _flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_string("config", None, "Config file[:variant] (default: the "
                      "workdir's config.json); --config.x=y sets a field.")
  flags.DEFINE_string("workdir", None, "A trained run directory.")
  flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32", "64"],
                    "Batch sizes to measure.")
  flags.DEFINE_integer("new_tokens", 64, "Tokens generated per request.")
  flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per request.")
  flags.DEFINE_integer("requests", 5, "Timed requests per batch size.")
  flags.DEFINE_string("json", None, "JSON output (default "
                      "WORKDIR/infer_bench.json).")


if __name__ == "__main__":
  _flags()
  entry.run_tool(main, own_overrides=True)
