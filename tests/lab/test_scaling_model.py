"""The scaling model (lab/scaling.py) against the compiled step: the bytes
it predicts a device sends are those of the step's collectives."""

import pytest

from lab import scaling
from zebra_jax.model.config import ModelConfig
from tests import hlo_collectives as hc
from tests.helpers import compiled_train_step, stripe_config


@pytest.mark.parametrize("stripe_input,data", [("dense", 1), ("grouped", 1),
                                               ("grouped", 2)])
def test_scaling_model_counts_the_bytes_the_step_sends(stripe_input, data):
  """lab/notes/scaling-model.md's stripe-axis bytes per device and step are
  those of the collectives in the compiled step (without a data axis to mix
  in, or with only all-to-alls and all-gathers on the stripe axis)."""
  stripe = 8 // data
  cfg = stripe_config(stripe_input, stripe)
  text = compiled_train_step(cfg, data, stripe).as_text()
  stripe_kinds = ("all-gather", "reduce-scatter", "all-to-all") + (
      ("all-reduce",) if data == 1 else ())
  sent = sum(hc.ring_bytes_sent(k, b, stripe)
             for k, b in hc.collectives_in(text) if k in stripe_kinds)
  model = ModelConfig.of(cfg.model)
  predicted = scaling.sent_per_step(model, 8, 4, data, stripe, act_bytes=4)
  # Without a data axis the embedding's and head's all-reduce runs on
  # "stripe" alone.
  expected = predicted["stripe"] + (predicted["mesh"] if data == 1 else 0)
  assert sent == pytest.approx(expected, rel=1e-9)
