"""Every mode with the model's stripes split over devices, as a user runs it.

`--config.parallel.stripe_devices=4` on 8 emulated devices (data 2 x stripe
4): train past two evaluations that each sample -> eval -> sample -> score ->
export through the CLI. Sampling and scoring then run the layers split over 4
devices (`loading.placement`); the reference is the same workdir with
`--config.parallel.stripe_devices=1`, one device.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from zebra_jax.configs import demo
from zebra_jax.inference import loading, sample, score
from zebra_jax.training import loop
from tests.helpers import REPO, sampled_text, score_numbers

TEXT = "The module returns the value of the object."


def _cli(workdir, *args):
  out = subprocess.run(
      [sys.executable, "-m", "zebra_jax.main", f"--workdir={workdir}",
       *args], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _eval_samples(workdir):
  """{step: text} of the samples training wrote to TensorBoard at each
  evaluation (None without the tensorboard package)."""
  try:
    from tensorboard.backend.event_processing import event_accumulator
  except ImportError:
    return None
  acc = event_accumulator.EventAccumulator(
      os.path.join(workdir, "tensorboard"),
      size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return {e.step: e.tensor_proto.string_val[0].decode()
          for e in acc.Tensors("sample/text_summary")}


@pytest.mark.slow
def test_every_mode_with_stripe_devices(tmp_path):
  run = str(tmp_path / "run")
  # 20 steps, evaluated at 10 and 20: the second evaluation's sample runs
  # the sampler built at the first on the new weights.
  train = _cli(run, "--config=demo:tiny",
               "--config.parallel.stripe_devices=4",
               "--config.train.num_steps=20", "--config.train.eval_every=10",
               "--config.sample.temperature=0")
  assert "test ppl" in train
  assert "valid ppl" in _cli(run, "--mode=eval")
  greedy = ["--mode=sample", "--prompt=The ", "--config.sample.temperature=0"]
  one = ["--config.parallel.stripe_devices=1"]
  split = sampled_text(_cli(run, *greedy))
  assert split == sampled_text(_cli(run, *greedy, *one))
  samples = _eval_samples(run)
  if samples is not None:  # the loss fell: step 20 is the best checkpoint
    assert sorted(samples) == [10, 20]
    assert samples[20].strip() == split
  scored = ["--mode=score", f"--text={TEXT}"]
  # printed to 4 decimals: equal up to the last digit's rounding
  assert score_numbers(_cli(run, *scored)) == pytest.approx(
      score_numbers(_cli(run, *scored, *one)), abs=1e-4, rel=1e-4)
  assert "Triton model" in _cli(run, "--mode=export")


@pytest.mark.slow
def test_sampling_and_scoring_run_split_over_the_stripe_devices(tmp_path):
  cfg = demo.get_config("tiny")
  cfg.parallel.stripe_devices = 4
  cfg.train.update(num_steps=4, report_at_end=False)
  loop.run(cfg, str(tmp_path))
  loaded = loading.load_for_inference(cfg, str(tmp_path))
  generator = sample.Generator(loaded)
  w_h = generator.params["layers"][0]["w_h"][...]
  assert len(w_h.sharding.device_set) == 4
  assert w_h.addressable_shards[0].data.shape[0] == w_h.shape[0] // 4
  options = sample.sampling_params(cfg.sample, temperature=0.7,
                                   max_new_tokens=24)
  prompts = ["The ", "A value", "Return", "If the"]  # 4 rows: split by rows
  split = generator.generate(prompts, options)
  split_scores = score.Scorer(loaded, 16).score_ids(np.arange(40) % 30)
  loaded.cfg.parallel.stripe_devices = 1
  single = sample.Generator(loaded)
  assert len(single.params["layers"][0]["w_h"][...].sharding.device_set) == 1
  assert single.generate(prompts, options) == split
  np.testing.assert_allclose(
      score.Scorer(loaded, 16).score_ids(np.arange(40) % 30), split_scores,
      rtol=1e-5, atol=1e-6)
  assert jax.device_count() == 8
