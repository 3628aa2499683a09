"""The server under concurrent clients, on 127.0.0.1: 16 threads of the real
`openai` client get the answers they get alone; a client that hangs up
mid-stream frees its slot with one log line; a full queue answers 503 with
Retry-After while admitted requests finish; an API key keeps out everyone
who does not send it."""

import contextlib
import http.client
import json
import logging
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from zebra_jax.inference import loading
from zebra_jax.serving import openai_api, serve
from tests import references
from tests.helpers import live_server

openai = pytest.importorskip("openai", reason="pip install openai (.[test])")
pytestmark = pytest.mark.timeout(300)  # live servers, bounded waits

# The char model knows only the characters of conftest's story.
STORY = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n"
                for i in range(40))


@contextlib.contextmanager
def running(service, api_key=""):
  """A server for `service` on a free loopback port, in a thread: its port."""
  with live_server(service, api_key) as httpd:
    yield httpd.server_port


@pytest.fixture(scope="module")
def loaded(char_run):
  return loading.load_for_inference(*char_run)


@pytest.fixture(scope="module")
def service(loaded):
  """4 slots: 16 clients queue, join the batch and leave it mid-flight."""
  svc = serve.Service(loaded, serve.Limits(max_new_tokens=1_000_000),
                      slots=4, queue=64)
  yield svc
  svc.close()


def client_for(port, key="unused"):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                       max_retries=0, timeout=120)


def health(port) -> dict:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())
  finally:
    conn.close()


def requests_mix(count, seed=0):
  """Varied prompt lengths (5-60 chars), temperatures, seeds, max_tokens,
  half streamed; every third greedy."""
  rng = random.Random(seed)
  out = []
  for i in range(count):
    length, at = rng.randint(5, 60), rng.randrange(0, 500)
    out.append(dict(prompt=STORY[at:at + length],
                    temperature=0.0 if i % 3 == 0 else rng.choice(
                        [0.3, 0.7, 1.0, 1.4]),
                    seed=rng.randrange(1 << 31), max_tokens=rng.randint(8, 48),
                    stream=i % 2 == 1))
  return out


def complete(client, req) -> tuple[str, str]:
  """(completion text, finish_reason) of one request, streamed or not."""
  kwargs = dict(model=openai_api.MODEL_ID, prompt=req["prompt"],
                max_tokens=req["max_tokens"], temperature=req["temperature"],
                seed=req["seed"])
  if not req["stream"]:
    [choice] = client.completions.create(**kwargs).choices
    return choice.text, choice.finish_reason
  text, reason = "", None
  for chunk in client.completions.create(stream=True, **kwargs):
    [choice] = chunk.choices
    text += choice.text
    reason = choice.finish_reason or reason
  return text, reason


def run_together(worker, count: int, timeout: float = 240) -> None:
  """worker(0) ... worker(count - 1), each on its own thread; all must end."""
  threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=timeout)
  assert not any(t.is_alive() for t in threads)


def test_16_concurrent_clients_get_what_they_get_alone(service):
  reqs = requests_mix(16)
  with running(service) as port:
    client = client_for(port)
    alone = [complete(client, r) for r in reqs]  # one at a time
    together = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def worker(i):
      start.wait(timeout=60)
      # Each thread its own client: its own connection pool.
      together[i] = complete(client_for(port), reqs[i])

    run_together(worker, len(reqs))
    assert together == alone
    # Greedy text is also what the reference outside the engine writes.
    for req, (text, reason) in zip(reqs, alone):
      assert reason == "length" and text
      if req["temperature"] == 0:
        assert text == references.greedy_text(
            service.generator, req["prompt"], req["max_tokens"])
    stats = health(port)["engine"]
    assert stats["busy"] == stats["queued"] == 0
    assert stats["compiled_programs"] == stats["startup_programs"]


def test_client_hanging_up_mid_stream_frees_its_slot_with_one_log_line(
    service, caplog):
  with running(service) as port:
    before = health(port)["engine"]["tokens"]
    body = json.dumps({"model": openai_api.MODEL_ID, "prompt": "line 3: the",
                       "max_tokens": 1_000_000, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    client_port = sock.getsockname()[1]
    caplog.set_level(logging.INFO)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    seen = b""
    while b"data: {" not in seen:  # the first event: the row is generating
      data = sock.recv(4096)
      assert data, "the server closed the stream"
      seen += data
    sock.close()
    # A million tokens take minutes; a freed slot takes a step or two.
    deadline = time.monotonic() + 60
    while health(port)["engine"]["busy"] and time.monotonic() < deadline:
      time.sleep(0.05)
    stats = health(port)["engine"]
    assert stats["busy"] == stats["queued"] == 0
    assert stats["tokens"] - before < 100_000
    mine = [r for r in caplog.records if f":{client_port} " in r.getMessage()]
    assert len(mine) == 1, [r.getMessage() for r in mine]
    assert "hung up" in mine[0].getMessage() and not mine[0].exc_info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # and the server keeps serving
    text, reason = complete(client_for(port), dict(
        prompt="line 3: the", max_tokens=8, temperature=0.0, seed=0,
        stream=True))
    assert reason == "length" and text


def post(port, path, body, headers=None):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  try:
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json",
                          **(headers or {})})
    response = conn.getresponse()
    return (response.status, dict(response.getheaders()),
            json.loads(response.read()))
  finally:
    conn.close()


def test_full_queue_answers_503_with_retry_after_and_keeps_serving(loaded):
  svc = serve.Service(loaded, serve.Limits(max_new_tokens=1_000_000),
                      slots=1, queue=1)
  try:
    with running(svc) as port:
      results = [None] * 8
      start = threading.Barrier(len(results))

      def worker(i):
        start.wait(timeout=60)
        # Long enough that no request ends before the last one arrives.
        results[i] = (post(port, "/v1/completions", {
            "model": openai_api.MODEL_ID, "prompt": "line 5: the",
            "max_tokens": 6000, "temperature": 0}) if i % 2 else
                      post(port, "/generate", {
                          "prompt": "line 5: the", "max_new_tokens": 6000,
                          "temperature": 0}))

      run_together(worker, len(results))
      statuses = sorted(status for status, _, _ in results)
      assert statuses.count(200) == 2  # one slot, one queue place
      assert statuses.count(503) == 6
      for i, (status, headers, answer) in enumerate(results):
        if status != 503:
          continue
        assert int(headers["Retry-After"]) >= 1
        if i % 2:  # OpenAI's shape under /v1
          assert answer["error"]["type"] == "server_error"
          assert "busy" in answer["error"]["message"]
        else:
          assert "busy" in answer["error"]
      status, _, answer = post(port, "/generate", {
          "prompt": "line 5: the", "max_new_tokens": 4, "temperature": 0})
      assert status == 200 and answer["texts"][0].startswith("line 5: the")
  finally:
    svc.close()


def test_api_key_401_without_or_with_a_wrong_key(service):
  with running(service, api_key="s3cret key") as port:
    good = dict(prompt="line 2: the", max_tokens=6, temperature=0.0, seed=0)
    for key in ("wrong", "s3cret", "s3cret key!"):
      with pytest.raises(openai.AuthenticationError) as raised:
        complete(client_for(port, key), dict(good, stream=False))
      assert raised.value.status_code == 401
      assert raised.value.body["code"] == "invalid_api_key"
    status, headers, answer = post(port, "/v1/completions", dict(
        good, model=openai_api.MODEL_ID))  # no Authorization header
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    status, _, answer = post(port, "/generate", {"prompt": "the "})
    assert status == 401 and "API key" in answer["error"]
    client = client_for(port, "s3cret key")
    assert complete(client, dict(good, stream=False))[1] == "length"
    assert complete(client, dict(good, stream=True))[1] == "length"
    assert [m.id for m in client.models.list().data] == [openai_api.MODEL_ID]
    assert health(port)["status"] == "ok"  # /health stays open


@pytest.mark.slow
@pytest.mark.parametrize("client", ["aiohttp", "openai"])
def test_serve_bench_reports_every_phase(service, tmp_path, client):
  """lab/serve_bench.py against a live server, with either kind of client:
  every phase counted, no errors, the engine's programs unchanged, its JSON
  complete."""
  out = tmp_path / "bench.json"
  with running(service) as port:
    done = subprocess.run(
        [sys.executable, "-m", "lab.serve_bench",
         f"--url=http://127.0.0.1:{port}", "--seed_prompt=line 1: the ",
         "--clients=1,3", "--seconds=1", "--client_procs=2",
         "--max_tokens=8", f"--client={client}", f"--json={out}"],
        capture_output=True, text=True, timeout=240, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  report = json.loads(out.read_text())
  assert [p["clients"] for p in report["phases"]] == [1, 3]
  assert report["client"] == client
  for p in report["phases"]:
    assert p["requests"] > 0 and p["errors"] == 0 and p["tokens_per_s"] > 0
  programs = report["compiled_programs"]
  assert (programs["start"] == programs["end"]
          == report["engine"]["startup_programs"])
  assert report["novelty"]["requests"] == 8
  assert "| 3 |" in done.stdout
