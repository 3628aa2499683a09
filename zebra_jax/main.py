"""Command line: python -m zebra_jax.main --config=configs/demo.py --workdir=DIR.

Flags name things (what to run, where, which prompt); the config holds numbers.
Any config field can be overridden, e.g. --config.model.num_stripes=8.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from zebra_jax import distributed  # defines the multi-process flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/demo.py or "
    "configs/wt103.py:tiny.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: config.json, tokenizer/, checkpoints/, "
    "metrics.jsonl.")
_MODE = flags.DEFINE_enum(
    "mode", "train", ["train", "eval", "sample"],
    "train (then evaluate valid/test and print a sample), eval, or sample.")
_PROMPT = flags.DEFINE_string("prompt", None, "sample: text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None,
                                "sample: tokens to generate.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", None, "sample: softmax temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", None, "sample: keep the k most likely "
                              "tokens (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", None, "sample: nucleus mass to keep "
                            "(1 = off).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", None,
                                    "sample: continuations to draw.")
_SEED = flags.DEFINE_integer("seed", None, "sample: random seed.")
flags.mark_flags_as_required(["config", "workdir"])


def _sample_overrides(cfg):
  """Sampling flags given on the command line win over config.sample."""
  given = {"prompt": _PROMPT, "max_new_tokens": _MAX_NEW,
           "temperature": _TEMPERATURE, "top_k": _TOP_K, "top_p": _TOP_P,
           "num_samples": _NUM_SAMPLES, "seed": _SEED}
  with cfg.unlocked():
    for field, flag in given.items():
      if flag.value is not None:
        cfg.sample[field] = flag.value
  return cfg


def main(argv):
  del argv  # Everything comes from flags.
  # Imported here so --help and flag errors answer before JAX starts.
  from zebra_jax import evaluate, sample, train, writer
  from zebra_jax.errors import UserError
  distributed.initialize()  # before any JAX backend starts
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  cfg, workdir = _sample_overrides(_CONFIG.value), _WORKDIR.value
  try:
    if _MODE.value == "train":
      train.run(cfg, workdir)
      if cfg.train.report_at_end:
        evaluate.run(cfg, workdir)
        sample.run(cfg, workdir)
    elif _MODE.value == "eval":
      evaluate.run(cfg, workdir)
    else:
      sample.run(cfg, workdir)
  except UserError as e:
    writer.error(str(e))
    sys.exit(2)


def run():
  app.run(main)


if __name__ == "__main__":
  run()
