"""The stripe-layout rows read what the compiled step holds and sends."""

from zebra_jax.configs import demo
from lab.benchmarks import stripe_layout


def test_rows_split_the_layers_and_keep_time_loops_free():
  cfg = demo.get_config("tiny")
  cfg.model.update(vocab_size=29, num_stripes=8, stripe_input="grouped",
                   dropout_hidden=0.0, dropout_output=0.0)
  one, eight = stripe_layout.layout_rows(cfg, [1, 8])
  assert (one["data"], eight["stripe"]) == (8, 8)
  # The layers' parameters (and Adam's two moments of them) split 8 ways;
  # the embedding and head stay whole on every device.
  assert one["layer_param_bytes"] == 8 * eight["layer_param_bytes"]
  assert (one["param_bytes"] - eight["param_bytes"]
          == one["layer_param_bytes"] * 7 // 8)
  assert one["opt_bytes"] - eight["opt_bytes"] == 2 * (
      one["param_bytes"] - eight["param_bytes"])
  assert one["collectives"]["all-gather"] == 0
  assert one["collectives"]["all-to-all"] == 0
  # the embedded window to the grouped first layer, the last window to the
  # head by rows: each forward and transposed
  assert eight["collectives"]["all-to-all"] == 4
  assert one["in_time_loops"] == eight["in_time_loops"] == 0
  table = stripe_layout.markdown(cfg, [one, eight])
  assert "| 8 x 1 |" in table and "| 1 x 8 |" in table
