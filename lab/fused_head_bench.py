"""The tied full head alone at the word_language_model shape (700 rows of
200 units, 10,000 words): value and gradients of the mean cross-entropy
(`lm.ZebraLM.token_sums` as the train step calls it), XLA's float32 head,
model.cpu_bf16_head=auto, model.cpu_fused_head=on (float32) and both, in
interleaved rounds so that a shared machine's load moves every row alike.

  python -m lab.fused_head_bench --rounds=7 --steps=10
"""

import argparse
import os
import statistics
import time

from zebra_jax.model import cpu_bf16_head, cpu_fused_head

SHAPE = dict(batch=20, seq_len=35, hidden=200, vocab=10_000, layers=2,
             dtype="float32", zipf=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=10, help="calls a round")
  args = parser.parse_args()
  # pylint: disable-next=g-import-not-at-top
  from lab.benchmarks.steps import head_runner
  rows = {"xla float32": {}}
  if not cpu_bf16_head.unavailable():
    rows["bf16 head"] = {"cpu_bf16_head": "auto"}
  if not cpu_fused_head.unavailable():
    rows["fused head"] = {"cpu_fused_head": "on"}
    if "bf16 head" in rows:
      rows["fused bf16"] = {"cpu_fused_head": "auto", "cpu_bf16_head": "auto"}
  runners = {name: head_runner(SHAPE, **kw) for name, kw in rows.items()}
  for run in runners.values():
    run()  # warm: the first call's allocations
  times = {name: [] for name in runners}
  load = os.getloadavg()[0]
  for _ in range(args.rounds):
    for name, run in runners.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        run()
      times[name].append(1e3 * (time.perf_counter() - start) / args.steps)
  first = statistics.median(times["xla float32"])
  print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f}; ms a call, median "
        f"(min) of {args.rounds} rounds of {args.steps}")
  for name, ms in times.items():
    median = statistics.median(ms)
    print(f"  {name:12s} {median:8.2f} ({min(ms):.2f})  "
          f"x{first / median:.2f} xla")


if __name__ == "__main__":
  main()
