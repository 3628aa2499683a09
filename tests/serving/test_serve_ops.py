"""What a deployer leans on: Prometheus metrics read by prometheus_client's
own parser, an engine that survives a failed step (and stops, unhealthy,
when it cannot), a SIGTERM that drains, an access-log line per request,
CORS only where allowed, the API key from a file."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from zebra_jax.errors import UserError
from zebra_jax.inference import loading
from zebra_jax.serving import openai_api, serve
from zebra_jax.config import base
from tests.helpers import REPO, http_call, http_post, live_server

pytestmark = pytest.mark.timeout(300)
M = openai_api.MODEL_ID


@pytest.fixture(scope="module")
def loaded(char_run):
  return loading.load_for_inference(*char_run)


def _metrics(port) -> dict:
  """{(name, labels as a sorted tuple): value} of GET /metrics, read by
  prometheus_client's parser."""
  from prometheus_client.parser import (  # pylint: disable=import-outside-toplevel
      text_string_to_metric_families)
  status, headers, body = http_call(port, "GET", "/metrics")
  assert status == 200 and headers["Content-Type"].startswith("text/plain")
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(body.decode())
          for s in family.samples}


def test_metrics_count_requests_tokens_and_engine_readings(loaded):
  service = serve.Service(loaded, slots=4)
  try:
    with live_server(service) as httpd:
      port = httpd.server_port
      status, out = http_post(port, "/v1/completions", {
          "model": M, "prompt": ["the ", "line 2: "], "max_tokens": 7,
          "temperature": 0})
      assert status == 200
      assert http_post(port, "/v1/completions", {"model": M})[0] == 400
      got = _metrics(port)
  finally:
    service.close()
  ok = ("zebra_requests_total", (("endpoint", "/v1/completions"),
                                 ("status", "200")))
  assert got[ok] == 1
  assert got[("zebra_requests_total", (("endpoint", "/v1/completions"),
                                       ("status", "400")))] == 1
  assert got[("zebra_generation_tokens_total", ())] == 14
  assert got[("zebra_prompt_tokens_total", ())] == len("the line 2: ")
  assert got[("zebra_time_to_first_token_seconds_count", ())] == 1
  assert got[("zebra_request_seconds_count",
              (("endpoint", "/v1/completions"),))] == 2
  assert got[("zebra_engine_step_seconds_count", ())] >= 2
  assert got[("zebra_slots", ())] == 4
  assert got[("zebra_slots_busy", ())] == got[("zebra_queue_depth", ())] == 0
  assert got[("zebra_engine_restarts_total", ())] == 0
  assert got[("zebra_engine_healthy", ())] == 1


def test_vllm_style_serving_metrics_agree_with_what_clients_saw(loaded):
  """Every generating endpoint, streamed and not: one observation per
  request in each per-request histogram, prompt-token sums equal to the
  usage the clients saw, and time to first token within the whole."""
  openai = pytest.importorskip("openai")
  from prometheus_client.parser import (  # pylint: disable=import-outside-toplevel
      text_string_to_metric_families)
  service = serve.Service(loaded, slots=4)
  try:
    with live_server(service) as httpd:
      port = httpd.server_port
      client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                             api_key="unused", max_retries=0, timeout=60)
      chat = [{"role": "user", "content": "line 9: the"}]
      answers = [
          client.completions.create(model=M, prompt=["the ", "line 2: "],
                                    max_tokens=7, temperature=0),
          client.chat.completions.create(model=M, messages=chat, n=2,
                                         max_tokens=6, temperature=0)]
      for create, kw in ((client.completions.create, {"prompt": "line 4"}),
                         (client.chat.completions.create,
                          {"messages": chat})):
        *_, last = create(model=M, max_tokens=5, temperature=0, stream=True,
                          stream_options={"include_usage": True}, **kw)
        answers.append(last)
      usage = [(a.usage.prompt_tokens, a.usage.completion_tokens)
               for a in answers]
      status, _ = http_post(port, "/generate", {
          "prompts": ["the ", "line 5: "], "num_samples": 2,
          "max_new_tokens": 4, "temperature": 0})
      assert status == 200
      usage.append((len("the line 5: "), 16))
      status, _, body = http_call(port, "GET", "/metrics")
  finally:
    service.close()
  families = {f.name: f for f in
              text_string_to_metric_families(body.decode())}
  sample = lambda name, suffix: next(
      s.value for s in families[name].samples if s.name == name + suffix)
  for name in ("zebra_time_to_first_token_seconds",
               "zebra_time_per_output_token_seconds",
               "zebra_e2e_request_latency_seconds",
               "zebra_request_prompt_tokens",
               "zebra_request_generation_tokens"):
    assert families[name].type == "histogram", name
    assert sample(name, "_count") == len(usage), name
  assert sample("zebra_request_prompt_tokens", "_sum") == sum(
      p for p, _ in usage)
  assert sample("zebra_request_generation_tokens", "_sum") == sum(
      g for _, g in usage)
  assert 0 < sample("zebra_time_to_first_token_seconds", "_sum") <= sample(
      "zebra_e2e_request_latency_seconds", "_sum")
  assert sample("zebra_time_per_output_token_seconds", "_sum") > 0
  for name, kind in (("zebra_num_requests_running", "gauge"),
                     ("zebra_num_requests_waiting", "gauge"),
                     ("zebra_prefix_cache_queries", "counter"),
                     ("zebra_prefix_cache_hits", "counter"),
                     ("zebra_prefix_cache_bytes", "gauge"),
                     ("zebra_prefix_cache_entries", "gauge")):
    assert families[name].type == kind, name
  assert sample("zebra_num_requests_running", "") == 0
  assert sample("zebra_num_requests_waiting", "") == 0
  hits = sample("zebra_prefix_cache_hits", "_total")
  assert 0 <= hits <= sample("zebra_prefix_cache_queries", "_total")


def test_a_failed_step_is_a_500_and_the_server_serves_on(loaded):
  service = serve.Service(loaded, slots=2)
  engine = service.engine
  decode = engine._decode
  failing = [True]

  def flaky(*args):
    if failing[0]:
      raise RuntimeError("device lost")
    return decode(*args)

  body = {"model": M, "prompt": "the ", "max_tokens": 5, "temperature": 0}
  try:
    with live_server(service, fatal_grace_seconds=30) as httpd:
      port = httpd.server_port
      good = http_post(port, "/v1/completions", body)
      engine._decode = flaky
      status, out = http_post(port, "/v1/completions", body)
      assert status == 500 and out["error"]["code"] == "engine_error"
      assert "serves on" in out["error"]["message"]
      failing[0] = False
      again = http_post(port, "/v1/completions", body)
      assert again[0] == 200 and (again[1]["choices"][0]["text"] ==
                                  good[1]["choices"][0]["text"])
      assert _metrics(port)[("zebra_engine_restarts_total", ())] == 1
      # Failing on and on: the engine gives up, /health says so, the
      # server stops itself (run() then exits 1).
      failing[0] = True
      for _ in range(engine.max_failures + 1):
        assert http_post(port, "/generate", {"prompt": "the "})[0] in (500, 503)
      status, _, answer = http_call(port, "GET", "/health")
      assert status == 503 and json.loads(answer)["status"] == "failed"
      assert http_post(port, "/generate", {"prompt": "the "})[0] == 503
      httpd.fatal_grace_seconds = 0
    assert isinstance(httpd.failure, RuntimeError)
  finally:
    service.close()


def _serve_process(workdir, *overrides):
  proc = subprocess.Popen(
      [sys.executable, "-m", "zebra_jax.main", f"--workdir={workdir}",
       "--mode=serve", "--port=0", *overrides],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
      env={**os.environ, "PYTHONUNBUFFERED": "1"})
  errors = []
  threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True
                   ).start()
  for line in proc.stdout:
    if "| serving step" in line:
      return proc, int(line.split("http://127.0.0.1:")[1].split()[0]), errors
  raise AssertionError("the server did not start: " + "".join(errors))


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(char_run):
  """A real --mode=serve process: a stream in flight when SIGTERM arrives
  finishes whole; a request after it gets 503; exit 0 with one line; one
  access-log line per request on stderr."""
  _, workdir = char_run
  proc, port, errors = _serve_process(workdir,
                                      "--config.serve.max_new_tokens=50000")
  try:
    conn_result = {}

    def stream():
      status, _, body = http_call(port, "POST", "/v1/completions", {
          "model": M, "prompt": "the ", "max_tokens": 20000,
          "temperature": 0, "stream": True})
      conn_result["status"], conn_result["body"] = status, body.decode()

    streamer = threading.Thread(target=stream)
    streamer.start()
    deadline = time.monotonic() + 60
    while not json.loads(http_call(port, "GET", "/health")[2])["engine"][
        "busy"] and time.monotonic() < deadline:
      time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    status, _, answer = http_call(port, "POST", "/v1/completions", {
        "model": M, "prompt": "the ", "max_tokens": 3})
    assert status == 503 and "shutting down" in json.loads(answer)["error"][
        "message"]
    streamer.join(timeout=120)
    assert proc.wait(timeout=120) == 0
    out = proc.stdout.read()
  finally:
    proc.kill()
  assert conn_result["status"] == 200
  events = conn_result["body"].strip().split("\n\n")
  assert events[-1] == "data: [DONE]"
  text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
  assert len(text) == 20000  # every token, not cut by the stop
  assert "| stopped (SIGTERM): 1 of 1 request(s) in flight finished" in out
  log = "".join(errors)
  assert '"POST /v1/completions" 200 20000 tokens' in log
  assert '"POST /v1/completions" 503 0 tokens' in log
  assert "Traceback" not in log


def test_cors_is_off_unless_an_origin_is_allowed(loaded):
  service = serve.Service(loaded, slots=1)
  page = {"Origin": "http://page.example"}
  try:
    with live_server(service) as httpd:
      _, headers, _ = http_call(httpd.server_port, "GET", "/health",
                                headers=page)
      assert "Access-Control-Allow-Origin" not in headers
    with live_server(service,
                     allowed_origins="http://page.example") as httpd:
      port = httpd.server_port
      status, headers, _ = http_call(port, "OPTIONS", "/v1/completions",
                                     headers={**page, "Access-Control-"
                                              "Request-Method": "POST"})
      assert status == 204
      assert headers["Access-Control-Allow-Origin"] == "http://page.example"
      assert "Authorization" in headers["Access-Control-Allow-Headers"]
      _, headers, _ = http_call(port, "POST", "/v1/completions", {
          "model": M, "prompt": "the ", "max_tokens": 2}, headers=page)
      assert headers["Access-Control-Allow-Origin"] == "http://page.example"
      _, headers, _ = http_call(port, "GET", "/health",
                                headers={"Origin": "http://evil.example"})
      assert "Access-Control-Allow-Origin" not in headers
  finally:
    service.close()


def test_the_api_key_comes_from_a_file(tmp_path, monkeypatch):
  cfg = base.get_config()
  monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
  assert serve.api_key(cfg) == ""
  key_file = tmp_path / "key"
  key_file.write_text("s3cret\n")
  cfg.serve.api_key_file = str(key_file)
  assert serve.api_key(cfg) == "s3cret"
  key_file.write_text("\n")
  with pytest.raises(UserError, match="is empty"):
    serve.api_key(cfg)
  cfg.serve.api_key_file = str(tmp_path / "missing")
  with pytest.raises(UserError, match="cannot read"):
    serve.api_key(cfg)
