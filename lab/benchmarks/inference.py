"""Generation throughput and latency per batch size, of a trained workdir.

Like the Transformer-XL README's inference tables: for each batch size, a
request is one prompt of `prompt_len` tokens per row followed by `new_tokens`
sampled tokens, through the serving engine users run (zebra_jax.engine, as
--mode=sample builds it: the config's prefill chunk; its slots sized to the
rows as a preview sizes them). The engine decodes one token per call here,
so a token's latency is one engine step as the engine times it: the decode
call to completion, dispatch and the host's bookkeeping included, as a
client streaming tokens sees it. The step that consumes the prompt's last
chunk also draws the first token: it counts in the request's latency, not
as a token's. Per-request latency runs from submitting the rows to the
last row's end.

Reported per batch size: throughput (generated tokens/s over the timed
requests), and average, p50, p90, p95 and p99 latency per token and per
request, in milliseconds. The first request of every batch size is not
timed. Results go to stdout and to a JSON file.
"""

import os
import time

import jax
import numpy as np

from zebra_jax import engine, strict_json
from zebra_jax.errors import UserError

PERCENTILES = (50, 90, 95, 99)


def latency_stats(seconds) -> dict:
  """{avg, p50, p90, p95, p99} in milliseconds."""
  ms = np.asarray(seconds, np.float64) * 1e3
  out = {"avg": float(ms.mean())}
  out.update({f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES})
  return out


class _Steps:
  """The engine's steps (on_step): each one's seconds, and how many tokens
  it drew per row."""

  def __init__(self):
    self.engine, self.seconds, self.drawn, self._tokens = None, [], [], 0

  def __call__(self, seconds: float) -> None:  # on the engine's thread
    tokens = self.engine.stats()["tokens"]
    self.seconds.append(seconds)
    self.drawn.append(tokens - self._tokens)
    self._tokens = tokens


def _request(running, steps: _Steps, rows, token_times: list) -> float:
  """One timed request; appends per-token seconds; returns request seconds."""
  steps.seconds.clear()
  steps.drawn.clear()
  start = time.perf_counter()
  for request in running.submit_many(rows):
    request.result()
  seconds = time.perf_counter() - start
  # Steps that drew tokens, but the first (it consumed the prompt too).
  decoding = [t for t, n in zip(steps.seconds, steps.drawn) if n][1:]
  token_times.extend(decoding)
  return seconds


def bench_batch(generator, prompt: np.ndarray, batch_size: int,
                new_tokens: int, requests: int) -> dict:
  """Measures one batch size; the first request is not timed."""
  # Imported here: loading brings the multi-process flags, which importing a
  # benchmark should not define.
  from zebra_jax.inference import sample  # pylint: disable=g-import-not-at-top
  steps = _Steps()
  sizes = sample.engine_options(generator.loaded.cfg, slots=batch_size,
                                prefill_rows=batch_size, decode_block=1,
                                small_batch_blocks=1)
  running = engine.Engine(generator.engine_model(), on_step=steps, **sizes)
  steps.engine = running
  options = engine.SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                  seed=0)
  text = generator.tokenizer.decode(prompt)
  rows = [engine.Row(text, options, prompt, i) for i in range(batch_size)]
  try:
    _request(running, steps, rows, [])  # warm up
    token_times, request_times = [], []
    for _ in range(requests):
      request_times.append(_request(running, steps, rows, token_times))
  finally:
    running.close()
  return {"batch_size": batch_size, "prompt_len": int(len(prompt)),
          "new_tokens": new_tokens, "requests": requests,
          "tokens_per_s": batch_size * new_tokens * requests
                          / float(np.sum(request_times)),
          "token_latency_ms": latency_stats(token_times),
          "request_latency_ms": latency_stats(request_times)}


def format_row(r: dict) -> str:
  t, q = r["token_latency_ms"], r["request_latency_ms"]
  return (f"| batch {r['batch_size']:3d} | {r['tokens_per_s']:9.0f} tok/s "
          f"| token ms avg {t['avg']:.2f} p50 {t['p50']:.2f} p90 "
          f"{t['p90']:.2f} p95 {t['p95']:.2f} p99 {t['p99']:.2f} "
          f"| request ms avg {q['avg']:.1f} p50 {q['p50']:.1f} p90 "
          f"{q['p90']:.1f} p95 {q['p95']:.1f} p99 {q['p99']:.1f}")


def _check(batch_sizes, new_tokens, prompt_len, requests) -> list[int]:
  try:
    sizes = [int(b) for b in batch_sizes]
  except ValueError:
    raise UserError(f"--batch_sizes={','.join(batch_sizes)} must be "
                    "whole numbers, e.g. 1,2,4,8") from None
  if new_tokens < 2:
    raise UserError(f"--new_tokens={new_tokens} must be at least 2: the "
                    "first token is drawn with the prompt, the rest time "
                    "the tokens")
  for name, value in (("prompt_len", prompt_len), ("requests", requests)):
    if value < 1:
      raise UserError(f"--{name}={value} must be at least 1")
  if not sizes or min(sizes) < 1:
    raise UserError("--batch_sizes needs positive sizes, e.g. 1,8,64")
  return sizes


def run(cfg, workdir: str, batch_sizes=(1, 2, 4, 8, 16, 32, 64), *,
        new_tokens: int = 64, prompt_len: int = 32, requests: int = 5,
        json_path: str | None = None) -> dict:
  """Prints one line per batch size, writes JSON (default WORKDIR/infer_bench.json)."""
  # Imported here: loading brings the multi-process flags, which importing a
  # benchmark should not define.
  from zebra_jax.inference import loading, sample
  sizes = _check(batch_sizes, new_tokens, prompt_len, requests)
  loaded = loading.load_for_inference(cfg, workdir)
  valid = np.asarray(loaded.splits["valid"])
  if len(valid) < prompt_len:
    raise UserError(f"the valid split has {len(valid)} tokens, fewer than "
                    f"--prompt_len={prompt_len}: use a shorter prompt")
  prompt = valid[:prompt_len].astype(np.int32)  # real text as the prompt
  generator = sample.Generator(loaded)
  results = []
  for size in sizes:
    results.append(bench_batch(generator, prompt, size, new_tokens, requests))
    print(format_row(results[-1]), flush=True)
  device = jax.devices()[0]
  report = {"step": int(loaded.step), "device": device.device_kind,
            "platform": device.platform, "dtype": loaded.cfg.model.dtype,
            "model": {k: loaded.cfg.model[k] for k in
                      ("hidden_size", "num_layers", "num_stripes",
                       "vocab_size")},
            "engine": {"prefill_chunk": sample.engine_options(
                loaded.cfg)["prefill_chunk"], "decode_block": 1,
                       "slots": "the batch size"},
            "results": results}
  json_path = json_path or os.path.join(workdir, "infer_bench.json")
  with open(json_path, "w") as f:
    strict_json.dump(report, f, indent=2)
  print(f"| wrote {json_path}", flush=True)
  return report
