"""The OpenAI-compatible routes of --mode=serve, driven by the real `openai`
client against a server on 127.0.0.1: greedy text equals --mode=sample's,
streaming gives the same text in chunks, bad fields get 4xx naming them."""

import http.client
import json
import threading

import pytest

from zebra_jax.inference import loading, openai_api, sample, serve

openai = pytest.importorskip("openai", reason="pip install openai (.[test])")
pytestmark = pytest.mark.timeout(120)  # every test talks to a live server

PROMPT = "line 7: the quick"


@pytest.fixture(scope="module")
def server(char_run):
  cfg, workdir = char_run
  service = serve.Service(loading.load_for_inference(cfg, workdir),
                          serve.Limits(max_new_tokens=80, max_rows=4,
                                       max_body_bytes=4096))
  httpd = serve.make_server(service, "127.0.0.1", 0)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{httpd.server_port}/v1",
                         api_key="unused", max_retries=0, timeout=60)
  yield cfg, workdir, httpd.server_port, client
  httpd.shutdown()
  httpd.server_close()
  thread.join(timeout=10)
  service.close()  # the engine's thread


def sample_mode(cfg, workdir, prompts, max_new_tokens, seed=0):
  """What --mode=sample prints for these prompts, greedy."""
  cfg = cfg.copy_and_resolve_references()
  cfg.sample.update(temperature=0.0, max_new_tokens=max_new_tokens, seed=seed,
                    stop="", stream=False, num_samples=1)
  return sample.run(cfg, workdir, prompts)


def raw(port, method, path, body=None):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  try:
    data = None if body is None else (
        body if isinstance(body, bytes) else json.dumps(body).encode())
    conn.request(method, path, body=data)
    response = conn.getresponse()
    return response.status, response.read()
  finally:
    conn.close()


def test_greedy_completion_equals_sample_mode_and_generate(server):
  cfg, workdir, port, client = server
  prompts = [PROMPT, "line 3: "]
  expected = sample_mode(cfg, workdir, prompts, 24, seed=5)
  out = client.completions.create(model=openai_api.MODEL_ID, prompt=prompts,
                                  max_tokens=24, temperature=0, seed=5)
  assert [p + c.text for p, c in zip(prompts, out.choices)] == expected
  assert [c.index for c in out.choices] == [0, 1]
  assert {c.finish_reason for c in out.choices} == {"length"}
  assert out.usage.completion_tokens == 48
  status, body = raw(port, "POST", "/generate", {
      "prompts": prompts, "max_new_tokens": 24, "temperature": 0, "seed": 5})
  assert status == 200 and json.loads(body)["texts"] == expected
  assert [m.id for m in client.models.list().data] == [openai_api.MODEL_ID]
  echoed = client.completions.create(model=openai_api.MODEL_ID, prompt=PROMPT,
                                     max_tokens=24, temperature=0, seed=5,
                                     echo=True, logprobs=0)
  assert echoed.choices[0].text == expected[0]
  lp = echoed.choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == 24
  assert all(x <= 0 for x in lp.token_logprobs)


def test_stream_gives_the_same_text_in_chunks(server):
  cfg, workdir, port, client = server
  [expected] = sample_mode(cfg, workdir, [PROMPT], 70)
  chunks = list(client.completions.create(
      model=openai_api.MODEL_ID, prompt=PROMPT, max_tokens=70, temperature=0,
      stream=True))
  texts = [c.choices[0].text for c in chunks]
  assert PROMPT + "".join(texts) == expected
  assert len([t for t in texts if t]) >= 3  # chunks of 32 tokens as they come
  assert chunks[-1].choices[0].finish_reason == "length"
  status, body = raw(port, "POST", "/v1/completions", {
      "model": openai_api.MODEL_ID, "prompt": PROMPT, "max_tokens": 4,
      "stream": True})
  events = body.decode().strip().split("\n\n")
  assert status == 200 and events[-1] == "data: [DONE]"
  assert all(e.startswith("data: {") for e in events[:-1])


def test_stop_string_cuts_and_reports_stop(server):
  cfg, workdir, _, client = server
  [full] = sample_mode(cfg, workdir, [PROMPT], 20)
  stop = full[len(PROMPT) + 2:len(PROMPT) + 4]
  out = client.completions.create(model=openai_api.MODEL_ID, prompt=PROMPT,
                                  max_tokens=20, temperature=0,
                                  stop=[stop, "\u2603"])
  want = full[len(PROMPT):].split(stop, 1)[0]
  assert out.choices[0].text == want
  assert out.choices[0].finish_reason == "stop"


GOOD = {"model": openai_api.MODEL_ID, "prompt": "the ", "max_tokens": 4}
BAD_FIELDS = [
    # (field, value or None to drop it, status)
    ("model", None, 400), ("model", "gpt-4", 404), ("prompt", None, 400),
    ("prompt", 7, 400), ("prompt", [], 400), ("prompt", "ZEBRA", 400),
    ("prompt", ["a", "b", "c", "d", "e"], 400), ("max_tokens", 0, 400),
    ("max_tokens", 10_000, 400), ("max_tokens", "4", 400),
    ("temperature", 3, 400), ("temperature", "hot", 400), ("top_p", 0, 400),
    ("seed", 1.5, 400), ("stop", ["a", "b", "c", "d", "e"], 400),
    ("stop", 3, 400), ("stream", "yes", 400), ("logprobs", 2, 400),
    ("n", 2, 400), ("echo", 1, 400), ("colour", "red", 400),
]


@pytest.mark.parametrize("field, value, status", BAD_FIELDS,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_bad_field_gets_openai_error_naming_it(server, field, value, status):
  _, _, port, _ = server
  body = dict(GOOD)
  if value is None:
    body.pop(field)
  else:
    body[field] = value
  got, answer = raw(port, "POST", "/v1/completions", body)
  error = json.loads(answer)["error"]
  assert got == status and error["param"] == field, error
  assert field in error["message"] and set(error) == {
      "message", "type", "param", "code"}


def test_bad_requests_through_the_client_and_raw(server):
  _, _, port, client = server
  with pytest.raises(openai.BadRequestError) as raised:
    client.completions.create(model=openai_api.MODEL_ID, prompt="the ", n=2)
  assert raised.value.body["param"] == "n"
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="gpt-4", prompt="the ")
  got, answer = raw(port, "POST", "/v1/completions", b"{not json")
  assert got == 400 and "not valid JSON" in json.loads(answer)["error"][
      "message"]
  got, answer = raw(port, "POST", "/v1/completions", b"x" * 5000)
  assert got == 413 and json.loads(answer)["error"]["type"]
  got, answer = raw(port, "GET", "/v1/models/zebra_lstm")
  assert got == 200 and json.loads(answer)["id"] == "zebra_lstm"
