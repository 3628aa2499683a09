"""Request latency of a running server, p50 and p99.

  python -m lab.latency --url=http://127.0.0.1:8000 \
      --path=generate|completions|triton [--batch=8] [--concurrent]
      [--requests=40] [--max_new_tokens=32] [--prompt="line 7: the quick"]

generate and completions talk to --mode=serve (POST /generate,
POST /v1/completions); triton to a tritonserver serving the export
(tritonclient.http, model --model). --batch prompts go in one request; with
--concurrent, --batch single-prompt requests are sent at once instead (what
Triton's dynamic batcher merges) and each one's latency counts. Greedy
decoding throughout.
"""

import argparse
import concurrent.futures
import http.client
import json
import time
import urllib.parse

import numpy as np

from zebra_jax import strict_json


def _post(url, path, body):
  parts = urllib.parse.urlsplit(url)
  conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
  try:
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
      raise RuntimeError(f"{path}: HTTP {response.status}: {data[:200]}")
  finally:
    conn.close()


def _sender(args):
  prompt, n = args.prompt, args.max_new_tokens
  if args.path == "generate":
    return lambda prompts: _post(args.url, "/generate", {
        "prompts": prompts, "max_new_tokens": n, "temperature": 0})
  if args.path == "completions":
    return lambda prompts: _post(args.url, "/v1/completions", {
        "model": "zebra_lstm", "prompt": prompts, "max_tokens": n,
        "temperature": 0})
  import tritonclient.http as th  # pylint: disable=g-import-not-at-top
  from zebra_jax.inference import triton_local  # pylint: disable=g-import-not-at-top
  host = urllib.parse.urlsplit(args.url).netloc
  del prompt

  def send(prompts):
    client = th.InferenceServerClient(host, network_timeout=300)
    inputs, outputs = triton_local.request(prompts, MAX_NEW_TOKENS=n,
                                           TEMPERATURE=0.0)
    client.infer(args.model, inputs, outputs=outputs)
    client.close()
  return send


def measure(args) -> dict:
  send = _sender(args)
  prompts = [args.prompt] * args.batch
  for _ in range(3):  # warm-up: compiles for this shape
    send(prompts)
  times = []
  before = _triton_counts(args)
  if args.concurrent:
    def one(_):
      start = time.perf_counter()
      send([args.prompt])
      return time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(args.batch) as pool:
      # Merged batches of every size up to --batch compile once each.
      for _ in range(args.warmup_rounds):
        list(pool.map(one, range(args.batch)))
      before = _triton_counts(args)
      for _ in range(max(1, args.requests // args.batch)):
        times += list(pool.map(one, range(args.batch)))
  else:
    for _ in range(args.requests):
      start = time.perf_counter()
      send(prompts)
      times.append(time.perf_counter() - start)
  ms = np.asarray(times) * 1e3
  out = {"path": args.path, "batch": args.batch,
         "concurrent": args.concurrent, "requests": len(ms),
         "p50_ms": round(float(np.percentile(ms, 50)), 1),
         "p99_ms": round(float(np.percentile(ms, 99)), 1)}
  if before is not None:  # Triton's own count: requests vs execute() calls
    after = _triton_counts(args)
    out["triton_requests"] = after[0] - before[0]
    out["triton_executions"] = after[1] - before[1]
  return out


def _triton_counts(args):
  """(requests, execute() calls) Triton has counted for the model."""
  if args.path != "triton":
    return None
  import tritonclient.http as th  # pylint: disable=g-import-not-at-top
  client = th.InferenceServerClient(urllib.parse.urlsplit(args.url).netloc)
  stats = client.get_inference_statistics(args.model)["model_stats"][0]
  client.close()
  return (int(stats["inference_stats"]["success"]["count"]),
          int(stats["execution_count"]))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--url", default="http://127.0.0.1:8000")
  parser.add_argument("--path", required=True,
                      choices=("generate", "completions", "triton"))
  parser.add_argument("--model", default="zebra_lstm")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--concurrent", action="store_true")
  parser.add_argument("--requests", type=int, default=40)
  parser.add_argument("--warmup_rounds", type=int, default=10,
                      help="--concurrent: rounds sent before timing")
  parser.add_argument("--max_new_tokens", type=int, default=32)
  parser.add_argument("--prompt", default="line 7: the quick")
  print(strict_json.dumps(measure(parser.parse_args(argv))), flush=True)


if __name__ == "__main__":
  main()
