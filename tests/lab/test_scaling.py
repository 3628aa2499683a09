"""The scaling model's arithmetic (lab/notes/scaling-model.md):
efficiency, hidden communication, and the recurrence latency a target
tolerates."""

import pytest

from lab import scaling


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("data,stripe", [(8, 1), (1, 8)])
def test_recurrence_for_gives_the_target_efficiency(data, stripe, overlap):
  m = scaling.wt103_model()
  r = scaling.recurrence_for(0.5, m, 128, 128, data, stripe, overlap)
  assert r is not None and r > 0
  assert scaling.efficiency(m, 128, 128, data, stripe, r, overlap) == \
      pytest.approx(0.5, rel=1e-9)
  assert scaling.efficiency(m, 128, 128, data, stripe, 2 * r, overlap) < 0.5


def test_hiding_communication_only_shortens_the_step():
  m = scaling.wt103_model()
  for data, stripe in scaling.MESHES:
    hidden = scaling.step_seconds(m, 128, 128, data, stripe, overlap=True)
    plain = scaling.step_seconds(m, 128, 128, data, stripe)
    assert plain["total"] - plain["comm"] <= hidden["total"] <= plain["total"]
    if data * stripe == 1:  # nothing to send
      assert hidden["total"] == plain["total"]
    else:
      assert plain["comm"] > 0

