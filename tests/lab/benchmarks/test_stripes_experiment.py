"""The stripes experiment's settings: parameter counts, the matched classic
LSTM and the equal-step-time width search."""

import math

from zebra_jax.configs import demo
from lab.benchmarks import stripes_experiment

_VOCAB = 112  # the embedded corpus' character vocabulary


def _tiny(vocab_size=_VOCAB):
  cfg = demo.get_config("tiny")
  cfg.model.vocab_size = vocab_size
  return cfg


def test_param_count_matches_the_lstm_formula():
  cfg = _tiny()  # E = H = 32 (tied), 2 layers
  for s in (1, 4):
    h = 32
    layer = 32 * 4 * h + s * (h // s) * 4 * (h // s) + 4 * h  # W_x, U, b
    expected = _VOCAB * 32 + _VOCAB + 2 * layer  # tied embedding, head bias
    setting = stripes_experiment.Setting(s, h, 32)
    assert stripes_experiment.param_count(cfg, setting) == expected


def test_matched_classic_is_the_nearest_width():
  cfg = _tiny()
  settings = stripes_experiment.make_settings(cfg, [1, 4], classic=True)
  assert [s.name for s in settings] == ["s1_h32", "s4_h32", "s1_h26_matched"]
  target = stripes_experiment.param_count(cfg, settings[1])
  matched = settings[2]
  assert matched.num_stripes == 1 and matched.embed_size == matched.hidden_size
  gap = lambda h: abs(stripes_experiment.param_count(
      cfg, stripes_experiment.Setting(1, h, h)) - target)
  assert gap(matched.hidden_size) <= min(gap(matched.hidden_size - 1),
                                         gap(matched.hidden_size + 1))


def test_grouped_settings_count_block_diagonal_weights_and_get_a_classic():
  cfg = _tiny()  # E = H = 32 (tied), 2 layers
  settings = stripes_experiment.make_settings(cfg, [1], classic=True,
                                             grouped=[4])
  assert [s.name for s in settings] == ["s1_h32", "s4_grouped_h32",
                                        "s1_h19_matched"]
  assert settings[2].role == "matched"
  g = 32 // 4  # stripe width: W_x [S, I/S, 4G] and U [S, G, 4G]
  layer = 4 * (32 // 4) * 4 * g + 4 * g * 4 * g + 4 * 32
  assert stripes_experiment.param_count(cfg, settings[1]) == (
      _VOCAB * 32 + _VOCAB + 2 * layer)
  target = stripes_experiment.param_count(cfg, settings[1])
  gap = lambda h: abs(stripes_experiment.param_count(
      cfg, stripes_experiment.Setting(1, h, h)) - target)
  h = settings[2].hidden_size
  assert gap(h) <= min(gap(h - 1), gap(h + 1))


def _power_law(exponent, overhead=0.0):
  """steps/s of a step costing overhead + width**exponent (arbitrary units)."""
  return lambda w: 1.0 / (overhead + (w / 256) ** exponent)


def test_equal_time_width_finds_the_width_of_a_power_law():
  for exponent, overhead in ((2.0, 0.0), (1.0, 0.0), (1.6, 0.5)):
    rate = _power_law(exponent, overhead)
    target = rate(256) / 2.5  # the classic step costs 2.5 grouped steps at H
    calls = []
    width, measured = stripes_experiment.equal_time_width(
        lambda w: calls.append(w) or rate(w), 256, rate(256), target,
        multiple=8)
    assert width % 8 == 0 and measured[0] == (256, rate(256))
    assert [w for w, _ in measured[1:]] == calls and len(calls) <= 4
    best = min(range(8, 4096, 8), key=lambda w: abs(math.log(rate(w) / target)))
    # Within one multiple of the best width, or within the 5% tolerance.
    assert abs(width - best) <= 8 or abs(rate(width) / target - 1) <= 0.05


def test_equal_time_width_stays_put_when_already_equal():
  width, measured = stripes_experiment.equal_time_width(
      lambda w: 1 / 0, 256, 10.0, 10.2, multiple=8)
  assert width == 256 and measured == [(256, 10.0)]
