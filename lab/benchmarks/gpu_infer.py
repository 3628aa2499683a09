"""What the GPU report's infer stage measures of the serving engine
(zebra_jax.engine, built as --mode=serve builds it: the config's serve
sizes, decode_block included): generated tokens/s with every slot busy,
where a one-slot decode step's time goes, and the WikiText-103 recipe's
model served with random weights (speed does not depend on the values).
"""

import time

import jax
import numpy as np

from lab.benchmarks.gpu_results import first_error_line
from lab.benchmarks.steps import IdText, random_model


def engine_tokens_per_s(generator, prompt_ids, slots: int,
                        new_tokens: int, rounds: int) -> dict:
  """The serving engine with `slots` slots, every slot busy: `slots`
  requests of new_tokens tokens each, submitted at once, `rounds` times
  after one untimed round (its programs compile); generated tokens/s and
  the microseconds a slot waits for each of its tokens."""
  from zebra_jax import engine as engines  # pylint: disable=g-import-not-at-top
  params = engines.SamplingParams(max_new_tokens=new_tokens, seed=0)
  engine = generator.engine

  def one_round():
    requests = engine.submit_many(
        [engines.Row("", params, prompt_ids, i) for i in range(slots)],
        block=True)
    for r in requests:
      r.result(timeout=600)
    return sum(r.completion_tokens for r in requests)

  one_round()
  start, tokens = time.perf_counter(), 0
  for _ in range(rounds):
    tokens += one_round()
  sec = time.perf_counter() - start
  return {"slots": slots, "decode_block": decode_block(engine, slots),
          "requests": slots * rounds, "prompt_len": len(prompt_ids),
          "new_tokens": new_tokens, "tokens": tokens, "seconds": sec,
          "tokens_per_s": tokens / sec,
          "us_per_token_per_slot": 1e6 * sec * slots / tokens}


def decode_block(engine, slots: int) -> int:
  """Tokens per decode call with every one of `slots` rows decoding and
  none waiting: the small batch's longer block up to small_batch_rows."""
  return (engine.long_block if slots <= engine.small_batch_rows
          else engine.block)


class StepClock:
  """Times an engine's steps from outside it: its on_step hook (a step's
  wall time on the engine's thread) and its decode program's call, wrapped
  so the call's return (the host's dispatch) and the tokens' arrival (the
  device's work not hidden behind it) are told apart. The engine reads the
  tokens right after the call, so waiting for them there moves nothing."""

  def __init__(self, engine):
    self.steps = []  # (start, wall s, [(dispatch s, wait s)], prompt work)
    self._calls, self._prefilled = [], False
    # pylint: disable=protected-access
    decode = engine._decode

    def timed_decode(*args):
      start = time.perf_counter()
      out = decode(*args)
      returned = time.perf_counter()
      jax.block_until_ready(out[1])
      self._calls.append((returned - start, time.perf_counter() - returned))
      return out

    def marked(program):
      def call(*args):
        self._prefilled = True
        return program(*args)
      return call

    engine._decode = timed_decode
    engine._prefill = marked(engine._prefill)
    engine._restore = marked(engine._restore)
    engine.on_step = self

  def __call__(self, seconds: float) -> None:  # on the engine's thread
    self.steps.append((time.perf_counter() - seconds, seconds, self._calls,
                       self._prefilled))
    self._calls, self._prefilled = [], False

  def split(self, block: int) -> dict:
    """Means over the steps that only decoded, each after one that did
    too, in microseconds per token (a step draws `block` tokens a slot):
    the cadence (one step's start to the next's, as a streaming client
    sees it) and its parts, which add up to it: the loop between steps
    (admission, locks), the decode call's dispatch, the device's work left
    after it, and the host's bookkeeping (tokens, stop checks, text) in
    the rest of the step. The cadence's median beside them."""
    parts = {"loop": [], "dispatch": [], "device_wait": [],
             "bookkeeping": []}
    cadence = []
    for (start, wall, calls, prompt), after in zip(self.steps,
                                                   self.steps[1:]):
      # Both decode-only: the gap is the loop's, not an idle wait's.
      if prompt or after[3] or len(calls) != 1 or len(after[2]) != 1:
        continue
      (dispatch, wait), = calls
      cadence.append(after[0] - start)
      parts["loop"].append(after[0] - start - wall)
      parts["dispatch"].append(dispatch)
      parts["device_wait"].append(wait)
      parts["bookkeeping"].append(wall - dispatch - wait)
    us = lambda x, f: 1e6 * float(f(x)) / block if x else None
    return {"decode_block": block, "steps": len(cadence),
            "cadence_us": us(cadence, np.mean),
            "cadence_median_us": us(cadence, np.median),
            **{f"{k}_us": us(v, np.mean) for k, v in parts.items()}}


def random_generators(cfg):
  """make(slots) -> a Generator (the engine as --mode=serve builds it from
  cfg, `slots` slots) over the config's model with random parameters,
  drawn once on the first call, and ids as text."""
  from zebra_jax.inference import sample  # pylint: disable=g-import-not-at-top
  built = []

  def make(slots: int):
    if not built:
      built.append(random_model(cfg.model))
    graphdef, params = built[0]
    return sample.Generator.from_parts(cfg, IdText(), graphdef, params,
                                       slots=slots)
  return make


def serve_row(results, model: str, slots: int, make, prompt_ids, *,
              new_tokens: int, rounds: int, deadline: float | None = None,
              margin: float = 0.0, split: bool = False) -> None:
  """The infer stage's row `{model}_slots{slots}`: make(slots)'s engine
  through `engine_tokens_per_s`, written as it lands; split: then the same
  engine's programs clocked (StepClock) over rows 8 times as long, the
  row `..._host_device`. Not started with less than `margin` seconds left
  before `deadline` (time.time()); a row that cannot run is its error."""
  name, key = f"{model}_slots{slots}", "results"
  if deadline is not None and deadline - time.time() < margin:
    results.append("infer", key, [{
        "name": name, "model": model, "slots": slots,
        "error": "not run: the stage's budget is spent"}])
    return
  prompt_ids = np.asarray(prompt_ids, np.int32)
  generator = None
  try:
    generator = make(slots)
    got = engine_tokens_per_s(generator, prompt_ids, slots, new_tokens,
                              rounds)
    results.append("infer", key, [{"name": name, "model": model, **got}])
    if split:
      key, name = "split", f"{name}_host_device"
      clock = StepClock(generator.engine)
      engine_tokens_per_s(generator, prompt_ids, slots, 8 * new_tokens,
                          rounds)
      results.append("infer", key, [{
          "name": name, "model": model, "slots": slots,
          **clock.split(decode_block(generator.engine, slots))}])
  except Exception as e:  # pylint: disable=broad-except
    results.append("infer", key, [{"name": name, "model": model,
                                   "slots": slots,
                                   "error": first_error_line(e)}])
  finally:
    if generator is not None:
      generator.close()
