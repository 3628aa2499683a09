"""The infer stage's parts that need no model: the step clock's split of
a token's time, and rows that cannot run becoming rows that say why."""

import time
import types

import jax.numpy as jnp
import pytest

from lab.benchmarks import gpu_infer, gpu_results


def _engine():
  """What StepClock wraps: the engine's programs and its on_step hook."""
  return types.SimpleNamespace(
      _decode=lambda *a: (None, jnp.zeros((1, 2), jnp.int32), None),
      _prefill=lambda *a: None, _restore=lambda *a: None, on_step=None)


def test_the_split_adds_up_over_decode_only_steps():
  engine = _engine()
  clock = gpu_infer.StepClock(engine)
  assert engine.on_step is clock
  for i in range(6):
    start = time.perf_counter()
    if i == 3:  # a prompt's step: it and the step after it are left out
      engine._prefill()  # pylint: disable=protected-access
    engine._decode()  # pylint: disable=protected-access
    time.sleep(0.001)  # bookkeeping
    engine.on_step(time.perf_counter() - start)
    time.sleep(0.0005)  # the loop between steps
  split = clock.split(block=2)
  assert split["steps"] == 3  # steps 0, 1 and 4, each to the next
  assert split["cadence_us"] == pytest.approx(sum(
      split[f"{p}_us"] for p in gpu_results.INFER_SPLIT_PARTS))
  assert split["bookkeeping_us"] >= 1000 / 2 * 0.9
  assert split["loop_us"] >= 500 / 2 * 0.9
  assert gpu_infer.StepClock(_engine()).split(4)["cadence_us"] is None


def test_a_row_that_cannot_run_is_its_error(tmp_path):
  results = gpu_results.Results(str(tmp_path))
  results.data["stages"] = {"infer": {}}

  def out_of_memory(slots):
    raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory for {slots} "
                       "slots\nmore lines")
  row = dict(new_tokens=4, rounds=1)
  gpu_infer.serve_row(results, "wt103", 64, out_of_memory, [1, 2], **row)
  gpu_infer.serve_row(results, "wt103", 16, out_of_memory, [1, 2],
                      deadline=time.time() + 3, margin=12, **row)
  rows = results.section("infer")["results"]
  assert rows == [
      {"name": "wt103_slots64", "model": "wt103", "slots": 64,
       "error": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory for 64 "
                "slots"},
      {"name": "wt103_slots16", "model": "wt103", "slots": 16,
       "error": "not run: the stage's budget is spent"}]
  page = gpu_results.render(results.data)
  assert "| wt103_slots64 | 64 | error: RuntimeError: RESOURCE_EXHAUSTED" \
      in page
  assert "wt103 at 64/16 slots - / - tok/s" in page
