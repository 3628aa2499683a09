"""Per-device memory and collectives of the train step, stripe devices 1..8.

  python -m lab.stripe_bench --config.model.num_stripes=8
  python -m lab.stripe_bench --config=wt103:tiny

The model is the config's (the demo's by default; a vocabulary of 256 when
the config leaves it to the corpus).
Runs on N emulated CPU devices (8 unless XLA_FLAGS already sets a count);
compiles, never times: what is read is lab/benchmarks/stripe_layout.py.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                 ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402  (jax must see XLA_FLAGS first)

from zebra_jax.cli import arguments, entry  # noqa: E402
from zebra_jax import strict_json


def main(argv) -> None:
  import jax  # here: importing the tool defines no flags
  from lab.benchmarks import stripe_layout
  from zebra_jax.runtime import parallel
  f = flags.FLAGS
  cfg, _ = arguments.load("stripe_bench", f.config, None, argv[1:])
  if not cfg.model.vocab_size:  # known only once a corpus is read
    cfg.model.vocab_size = 256
  stripes = [int(s) for s in f.stripe_devices]
  for s in stripes:
    parallel.check_stripe_devices(s, cfg.model.num_stripes,
                                  jax.device_count())
  rows = stripe_layout.layout_rows(cfg, stripes)
  print(stripe_layout.markdown(cfg, rows))
  if f.json:
    with open(f.json, "w") as out:
      strict_json.dump(rows, out, indent=1)


def _flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_string("config", "demo", "Config NAME or file[:variant]; "
                      "--config.x=y sets a field (the model needs "
                      "num_stripes divisible by every stripe count).")
  flags.DEFINE_list("stripe_devices", ["1", "2", "4", "8"],
                    "Stripe-axis sizes to compile.")
  flags.DEFINE_string("json", None, "Also write the rows here as JSON.")


if __name__ == "__main__":
  _flags()
  entry.run_tool(main, own_overrides=True)
