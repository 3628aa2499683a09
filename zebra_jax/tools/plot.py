"""Loss and perplexity curves from metrics.jsonl, several workdirs overlaid.

  python -m zebra_jax.tools.plot runs/s1 runs/s8 --out=runs/s1_vs_s8.png

The same figure as `zebra-jax --mode=plot` (zebra_jax/runtime/plots.py).
"""

from typing import Sequence

from absl import flags

from zebra_jax.cli import entry
from zebra_jax.runtime import plots


def main(argv: Sequence[str]) -> None:
  """absl entry point: the positional arguments are the workdirs."""
  plots.run(argv[1:], flags.FLAGS.out)


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "PNG path (default FIRST_WORKDIR/curves.png).")
  entry.run_tool(main)
