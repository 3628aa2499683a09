"""The torch reference steps: float32 weights and Adam state, autocast in
bfloat16 as the JAX rows compute."""

import pytest

from lab.benchmarks import torch_reference
from lab.benchmarks.shapes import SHAPES


def test_torch_trains_float32_weights_under_bf16_autocast():
  torch = pytest.importorskip("torch")
  shape = {**SHAPES["quick"], "dtype": "bfloat16"}
  steps = torch_reference.torch_steps(shape, ("core", "lm"), "cpu")
  for group, step in steps.items():
    step()
    step()
    with step.autocast():
      assert torch.is_autocast_enabled("cpu")
      assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in step.params), group
    state = [v for s in step.opt.state.values() for k, v in s.items()
             if k in ("exp_avg", "exp_avg_sq")]
    assert len(state) == 2 * len(step.params), group
    assert all(v.dtype == torch.float32 for v in state), group
  fp32 = torch_reference.torch_steps(SHAPES["quick"], ("core",), "cpu")["core"]
  with fp32.autocast():
    assert not torch.is_autocast_enabled("cpu")
