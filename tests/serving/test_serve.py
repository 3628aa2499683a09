"""The HTTP server on 127.0.0.1: endpoints, and 4xx answers that keep it up."""

import http.client
import json
import threading

import pytest

from zebra_jax import engine
from zebra_jax.inference import loading
from zebra_jax.serving import serve


@pytest.fixture(scope="module")
def server(char_run):
  cfg, workdir = char_run
  service = serve.Service(loading.load_for_inference(cfg, workdir),
                          serve.Limits(max_new_tokens=64, max_rows=8,
                                       max_body_bytes=4096))
  httpd = serve.make_server(service, "127.0.0.1", 0)  # ephemeral port
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield service, httpd.server_port
  httpd.shutdown()
  httpd.server_close()
  thread.join(timeout=10)
  service.close()  # the engine's thread


def call(port, method, path, body=None, raw=None, headers=None):
  """One request on a fresh connection: (status, decoded JSON)."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  try:
    data = raw if raw is not None else (
        None if body is None else json.dumps(body).encode())
    sent = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, path, body=data, headers={**sent, **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read())
  finally:
    conn.close()


def test_health_generate_and_score(server):
  service, port = server
  status, health = call(port, "GET", "/health")
  assert status == 200 and health["status"] == "ok"
  assert health["tokenizer"] == "char" and health["limits"]["max_rows"] == 8
  status, out = call(port, "POST", "/generate", {
      "prompts": ["the ", "line 3: "], "max_new_tokens": 8,
      "temperature": 0})
  assert status == 200, out
  expected = service.generator.generate(
      ["the ", "line 3: "],
      engine.SamplingParams(max_new_tokens=8, temperature=0.0))
  assert out["texts"] == expected and out["step"] == health["step"]
  status, out = call(port, "POST", "/score", {"text": "the quick fox\n",
                                              "verbose": True})
  assert status == 200, out
  [res] = out["results"]
  want = service.scorer.score_text("the quick fox\n").summary()
  assert res["tokens"] == want["tokens"] == 13
  assert res["loss"] == pytest.approx(want["loss"]) and "bpc" in res
  assert [t for t, _ in res["token_logprobs"]][:3] == ["h", "e", " "]


BAD_REQUESTS = [
    # (method, path, raw body, extra headers, status, words in the error)
    ("POST", "/generate", b"{not json", {}, 400, "not valid JSON"),
    ("POST", "/generate", b"[1, 2]", {}, 400, "JSON object"),
    ("POST", "/generate", b'{"prompt": "the ", "colour": 1}', {}, 400,
     "unknown field(s) colour"),
    ("POST", "/generate", b'{"prompt": 3}', {}, 400, "wrong type"),
    ("POST", "/generate", b'{"prompt": "the ", "max_new_tokens": true}', {},
     400, "wrong type"),
    ("POST", "/generate", b'{"prompt": "the ", "prompts": ["a"]}', {}, 400,
     "exactly one"),
    ("POST", "/generate", b'{"prompt": "the ", "max_new_tokens": 100000}', {},
     413, "too many tokens"),
    ("POST", "/generate", b'{"prompts": ["a", "b", "c"], "num_samples": 3}',
     {}, 413, "more than 8 rows"),
    ("POST", "/generate", b'{"prompt": "the ", "temperature": -1}', {}, 400,
     "temperature=-1"),
    ("POST", "/generate", b'{"prompt": "ZEBRA"}', {}, 400,
     "not seen in training"),
    ("POST", "/score", b'{"texts": []}', {}, 400, "non-empty list"),
    ("POST", "/score", b'{"text": "t"}', {}, 400, "at least two tokens"),
    ("POST", "/score", b'{"text": "the", "max_new_tokens": 3}', {}, 400,
     "unknown field"),
    ("POST", "/generate", b"x" * 5000, {}, 413, "too large"),
    ("GET", "/generate", None, {}, 405, "not served"),
    ("POST", "/nowhere", b"{}", {}, 404, "not served"),
    ("GET", "/", None, {}, 404, "not served"),
]


@pytest.mark.parametrize("method, path, raw, headers, status, words",
                         BAD_REQUESTS, ids=[f"{i}-{r[4]}" for i, r in
                                            enumerate(BAD_REQUESTS)])
def test_bad_request_gets_4xx_and_server_keeps_serving(
    server, method, path, raw, headers, status, words):
  _, port = server
  got, out = call(port, method, path, raw=raw, headers=headers)
  assert got == status and words in out["error"], out
  assert call(port, "GET", "/health")[0] == 200


def test_concurrent_requests_all_answered(server):
  _, port = server
  results = []

  def client(i):
    results.append(call(port, "POST", "/generate", {
        "prompt": "the ", "max_new_tokens": 4, "seed": i}))

  threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert len(results) == 4 and all(s == 200 for s, _ in results)
