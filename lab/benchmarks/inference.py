"""Generation throughput and latency per batch size, of a trained workdir.

Like the Transformer-XL README's inference tables: for each batch size, a
request is one prompt of `prompt_len` tokens per row followed by `new_tokens`
sampled tokens. Each new token is one jitted call timed to completion
(`block_until_ready`), so per-token latency includes dispatch, as a serving
loop that streams tokens sees it; per-request latency adds the prompt.

Reported per batch size: throughput (generated tokens/s over the timed
requests), and average, p50, p90, p95 and p99 latency per token and per
request, in milliseconds. The first request of every batch size compiles and
is not timed. Results go to stdout and to a JSON file.
"""

import os
import time

import jax
import numpy as np

from zebra_jax.errors import UserError
from lab.benchmarks import sampling_loop as sampling
from zebra_jax import strict_json

PERCENTILES = (50, 90, 95, 99)


def latency_stats(seconds) -> dict:
  """{avg, p50, p90, p95, p99} in milliseconds."""
  ms = np.asarray(seconds, np.float64) * 1e3
  out = {"avg": float(ms.mean())}
  out.update({f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES})
  return out


def _request(generator, rows, new_tokens: int, key, token_times: list):
  """One timed request; appends per-token seconds; returns request seconds."""
  start = time.perf_counter()
  state = sampling.prime(generator, rows)
  jax.block_until_ready(state)
  for i in range(new_tokens):
    t = time.perf_counter()
    tokens, state = sampling.generate_chunk(
        generator.step_fn, generator.params, state, key, i, num_new_tokens=1,
        temperature=1.0)
    jax.block_until_ready(tokens)
    token_times.append(time.perf_counter() - t)
  return time.perf_counter() - start


def bench_batch(generator, prompt: np.ndarray, batch_size: int,
                new_tokens: int, requests: int) -> dict:
  """Measures one batch size; the first (compiling) request is not timed."""
  rows = [prompt] * batch_size
  key = jax.random.PRNGKey(0)
  _request(generator, rows, new_tokens, key, [])  # compile + warm up
  token_times, request_times = [], []
  for _ in range(requests):
    request_times.append(_request(generator, rows, new_tokens, key,
                                  token_times))
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
  for name, value in (("new_tokens", new_tokens),
                      ("prompt_len", prompt_len),
                      ("requests", requests)):
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
            "results": results}
  json_path = json_path or os.path.join(workdir, "infer_bench.json")
  with open(json_path, "w") as f:
    strict_json.dump(report, f, indent=2)
  print(f"| wrote {json_path}", flush=True)
  return report
