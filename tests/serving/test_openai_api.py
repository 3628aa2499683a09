"""The OpenAI-compatible routes of --mode=serve, driven by the real `openai`
client against a server on 127.0.0.1: greedy text equals --mode=sample's,
log-probabilities equal --mode=score's, seeds, n, token-id prompts, echo
scoring, penalties, streams, chat, vLLM's tokenizer endpoints, and bad
fields answered with errors that name them."""

import json
import logging

import numpy as np
import pytest

import zebra_jax

from zebra_jax.data.tokenizers.word import WordTokenizer
from zebra_jax.inference import loading, sample
from zebra_jax.serving import openai_answers, openai_api, serve
from tests.helpers import http_call, live_server

openai = pytest.importorskip("openai", reason="pip install openai (.[test])")
pytestmark = pytest.mark.timeout(180)  # every test talks to a live server

PROMPT = "line 7: the quick"
M = openai_api.MODEL_ID


@pytest.fixture(scope="module")
def server(char_run):
  cfg, workdir = char_run
  service = serve.Service(loading.load_for_inference(cfg, workdir),
                          serve.Limits(max_new_tokens=80, max_rows=4,
                                       max_body_bytes=4096), slots=8)
  with live_server(service) as httpd:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{httpd.server_port}/v1",
                           api_key="unused", max_retries=0, timeout=60)
    yield cfg, workdir, httpd.server_port, client, service
  service.close()  # the engine's thread


def sample_mode(cfg, workdir, prompts, max_new_tokens, seed=0):
  """What --mode=sample prints for these prompts, greedy."""
  cfg = cfg.copy_and_resolve_references()
  cfg.sample.update(temperature=0.0, max_new_tokens=max_new_tokens, seed=seed,
                    stop="", stream=False, num_samples=1)
  return sample.run(cfg, workdir, prompts)


def raw(port, method, path, body=None):
  status, _, answer = http_call(port, method, path, body)
  return status, answer


def test_greedy_completion_equals_sample_mode_and_generate(server):
  cfg, workdir, port, client, _ = server
  prompts = [PROMPT, "line 3: "]
  expected = sample_mode(cfg, workdir, prompts, 24, seed=5)
  out = client.completions.create(model=M, prompt=prompts, max_tokens=24,
                                  temperature=0, seed=5)
  assert [p + c.text for p, c in zip(prompts, out.choices)] == expected
  assert [c.index for c in out.choices] == [0, 1]
  assert {c.finish_reason for c in out.choices} == {"length"}
  assert out.usage.completion_tokens == 48
  assert out.usage.prompt_tokens == len(PROMPT) + len("line 3: ")
  status, body = raw(port, "POST", "/generate", {
      "prompts": prompts, "max_new_tokens": 24, "temperature": 0, "seed": 5})
  assert status == 200 and json.loads(body)["texts"] == expected
  assert [m.id for m in client.models.list().data] == [M]


def test_echo_logprobs_are_the_scorers_and_the_top_holds_the_chosen(server):
  """echo + logprobs: the prompt's log-probabilities (the first null), then
  the completion's; the same numbers --mode=score computes."""
  _, _, _, client, service = server
  out = client.completions.create(model=M, prompt=PROMPT, max_tokens=6,
                                  temperature=0, echo=True, logprobs=2)
  choice = out.choices[0]
  lp = choice.logprobs
  assert choice.text.startswith(PROMPT)
  assert len(lp.tokens) == len(PROMPT) + 6 and "".join(lp.tokens) == (
      choice.text)
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  ids = service.encode(choice.text)
  np.testing.assert_allclose(lp.token_logprobs[1:],
                             service.scorer.score_ids(ids), atol=2e-5)
  assert lp.text_offset == list(range(len(choice.text)))
  for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                               lp.top_logprobs[1:]):
    assert top[token] == value and len(top) in (2, 3)
  # Greedy: every generated token is its position's most likely one.
  for value, top in zip(lp.token_logprobs[-6:], lp.top_logprobs[-6:]):
    assert value == max(top.values())


def test_max_tokens_0_scores_the_prompt_alone(server):
  _, _, _, client, service = server
  ids = [int(i) for i in service.encode(PROMPT)]
  out = client.completions.create(model=M, prompt=[ids, ids[:5]],
                                  max_tokens=0, echo=True, logprobs=0)
  assert [c.text for c in out.choices] == [PROMPT, PROMPT[:5]]
  assert out.usage.completion_tokens == 0
  assert out.usage.prompt_tokens == len(ids) + 5
  scores = service.scorer.score_ids(np.array(ids))
  np.testing.assert_allclose(out.choices[0].logprobs.token_logprobs[1:],
                             scores, atol=2e-5)
  np.testing.assert_allclose(out.choices[1].logprobs.token_logprobs[1:],
                             scores[:4], atol=2e-5)


def test_token_id_prompts_equal_text_prompts(server):
  _, _, _, client, service = server
  ids = [int(i) for i in service.encode(PROMPT)]
  texts = [client.completions.create(
      model=M, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
           for prompt in (PROMPT, ids, [ids])]
  assert texts[0] == texts[1] == texts[2]


def test_no_seed_is_random_a_seed_reproduces_and_n_draws_n(server):
  _, _, _, client, _ = server
  draw = lambda **kw: [c.text for c in client.completions.create(
      model=M, prompt="the ", max_tokens=20, temperature=1.0, **kw).choices]
  assert draw() != draw()  # a fresh seed per request
  assert draw(seed=3) == draw(seed=3)
  three = draw(seed=3, n=3)
  assert len(set(three)) == 3 and three[0] == draw(seed=3)[0]
  same_prompts = [c.text for c in client.completions.create(
      model=M, prompt=["the ", "the "], max_tokens=20, temperature=1.0,
      seed=9).choices]
  assert same_prompts[0] != same_prompts[1]  # choice i: seed and i


def test_penalties_and_logit_bias_are_honoured(server):
  _, _, _, client, service = server
  greedy = lambda **kw: client.completions.create(
      model=M, prompt=PROMPT, max_tokens=20, temperature=0, **kw
  ).choices[0].text
  plain = greedy()
  [first] = service.encode(plain[0])
  banned = greedy(logit_bias={str(int(first)): -100})
  assert banned[0] != plain[0]
  [z] = service.encode("z")
  assert greedy(logit_bias={str(int(z)): 100}) == "z" * 20
  assert greedy(frequency_penalty=2.0) != plain
  assert len(set(greedy(presence_penalty=2.0))) > len(set(plain))
  assert greedy(frequency_penalty=0, presence_penalty=0, extra_body={
      "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}) == plain


def test_stream_gives_the_same_text_with_logprobs_and_usage(server):
  cfg, workdir, port, client, _ = server
  [expected] = sample_mode(cfg, workdir, [PROMPT], 70)
  chunks = list(client.completions.create(
      model=M, prompt=PROMPT, max_tokens=70, temperature=0, stream=True,
      logprobs=1, stream_options={"include_usage": True}))
  texts = [c.choices[0].text for c in chunks if c.choices]
  assert PROMPT + "".join(texts) == expected
  assert len([t for t in texts if t]) >= 3  # chunks as they come
  tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens]
  assert "".join(tokens) == expected[len(PROMPT):]
  ends = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert ends[-1] == "length" and chunks[-1].usage.completion_tokens == 70
  status, body = raw(port, "POST", "/v1/completions", {
      "model": M, "prompt": PROMPT, "max_tokens": 4, "stream": True})
  events = body.decode().strip().split("\n\n")
  assert status == 200 and events[-1] == "data: [DONE]"
  assert all(e.startswith("data: {") for e in events[:-1])


def test_stop_string_cuts_and_usage_counts_what_is_returned(server):
  cfg, workdir, _, client, _ = server
  [full] = sample_mode(cfg, workdir, [PROMPT], 20)
  stop = full[len(PROMPT) + 2:len(PROMPT) + 4]
  out = client.completions.create(model=M, prompt=PROMPT, max_tokens=20,
                                  temperature=0, stop=[stop, "\u2603"])
  want = full[len(PROMPT):].split(stop, 1)[0]
  assert out.choices[0].text == want
  assert out.choices[0].finish_reason == "stop"
  assert out.usage.completion_tokens == len(want)  # one char a token


def test_chat_continues_the_transcript_streamed_or_not(server):
  _, _, _, client, service = server
  messages = [{"role": "system", "content": "the quick"},
              {"role": "user", "content": "line 9: the"}]
  out = client.chat.completions.create(model=M, messages=messages,
                                       max_tokens=30, temperature=0)
  transcript = "system: the quick\nuser: line 9: the\nassistant: "
  assert service.api.transcript(messages) == transcript
  plain = client.completions.create(model=M, prompt=transcript,
                                    max_tokens=30, temperature=0,
                                    stop=["\nuser:"]).choices[0]
  assert out.choices[0].message.content == plain.text
  assert out.choices[0].message.role == "assistant"
  assert out.choices[0].finish_reason == plain.finish_reason
  chunks = list(client.chat.completions.create(
      model=M, messages=messages, max_tokens=30, temperature=0, stream=True,
      logprobs=True, top_logprobs=2))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
      plain.text)
  content = [t for c in chunks if c.choices[0].logprobs
             for t in c.choices[0].logprobs.content]
  assert "".join(t.token for t in content) == plain.text
  assert all(len(t.top_logprobs) == 2 for t in content)


def test_tokenizer_endpoints_round_trip(server):
  _, _, port, _, service = server
  status, body = raw(port, "POST", "/tokenize", {"prompt": PROMPT,
                                                 "add_special_tokens": False})
  out = json.loads(body)
  assert status == 200 and out["tokens"] == [int(i) for i in
                                             service.encode(PROMPT)]
  assert out["count"] == len(PROMPT) and out["max_model_len"] == 4096
  status, body = raw(port, "POST", "/detokenize", {"tokens": out["tokens"]})
  assert status == 200 and json.loads(body)["prompt"] == PROMPT
  status, body = raw(port, "GET", "/tokenizer_info")
  info = json.loads(body)
  assert status == 200 and info["eos_token"] == "\n"
  assert raw(port, "POST", "/detokenize", {"tokens": [10**6]})[0] == 400


def test_unknown_fields_are_ignored_with_one_warning(server, caplog):
  _, _, port, _, _ = server
  caplog.set_level(logging.WARNING, logger="zebra_jax.serve")
  status, body = raw(port, "POST", "/v1/completions", {
      "model": M, "prompt": "the ", "max_tokens": 3, "colour": "red",
      "user": "u1", "frequency_penalty": 0, "presence_penalty": 0, "n": 1,
      "seed": None, "logprobs": None})
  assert status == 200, body
  warned = [r.getMessage() for r in caplog.records]
  assert len(warned) == 1 and "colour" in warned[0]


GOOD = {"model": M, "prompt": "the ", "max_tokens": 4}
BAD_FIELDS = [
    # (field, value or None to drop it, status)
    ("model", None, 400), ("model", "gpt-4", 404), ("prompt", None, 400),
    ("prompt", 7, 400), ("prompt", [], 400), ("prompt", "ZEBRA", 400),
    ("prompt", ["a", "b", "c", "d", "e"], 400), ("prompt", [[1], "a"], 400),
    ("prompt", [10**6], 400), ("max_tokens", -1, 400),
    ("max_tokens", 10_000, 400), ("max_tokens", "4", 400),
    ("temperature", 101, 400), ("temperature", "hot", 400),
    ("top_p", 0, 400), ("top_k", 3_000_000_000, 400), ("min_p", 2, 400),
    ("presence_penalty", 2.5, 400), ("frequency_penalty", -3, 400),
    ("repetition_penalty", 0, 400), ("seed", 1.5, 400),
    ("stop", ["a"] * 17, 400), ("stop", 3, 400), ("stream", "yes", 400),
    ("logprobs", 21, 400), ("n", 9, 400), ("n", 3, 400),
    ("best_of", 3, 400), ("echo", 1, 400), ("suffix", "x", 400),
    ("logit_bias", {"x": 1}, 400), ("logit_bias", {"1": 101}, 400),
    ("logit_bias", {"100000": 1}, 400),
]


@pytest.mark.parametrize("field, value, status", BAD_FIELDS,
                         ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_FIELDS])
def test_bad_field_gets_openai_error_naming_it(server, field, value, status):
  _, _, port, _, _ = server
  body = dict(GOOD)
  if field == "n" and value == 3:  # 2 prompts x 3 > max_rows 4
    body["prompt"] = ["a", "b"]
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
  _, _, port, client, _ = server
  with pytest.raises(openai.BadRequestError) as raised:
    client.completions.create(model=M, prompt="the ", n=9)
  assert raised.value.body["param"] == "n"
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="gpt-4", prompt="the ")
  for body in (b"{not json",
               b'{"model": "zebra_lstm", "prompt": "a", "temperature": NaN}',
               b'{"model": "zebra_lstm", "prompt": "a", "top_p": Infinity}'):
    got, answer = raw(port, "POST", "/v1/completions", body)
    assert got == 400 and "not valid JSON" in json.loads(answer)["error"][
        "message"], answer
  got, answer = raw(port, "POST", "/v1/completions", b"x" * 5000)
  assert got == 413 and json.loads(answer)["error"]["type"]
  got, answer = raw(port, "GET", "/v1/models/zebra_lstm")
  assert got == 200 and json.loads(answer)["id"] == "zebra_lstm"
  got, answer = raw(port, "POST", "/generate", {"prompt": "the ",
                                                "top_k": 3_000_000_000})
  assert got == 400 and "top_k" in json.loads(answer)["error"]
  assert raw(port, "GET", "/health")[0] == 200  # the engine lives on


# --- every field the server takes is honoured; one it cannot is a 400 ---


def greedy_text(client, **kw):
  kw = {"model": M, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
        **kw}
  return client.completions.create(**kw).choices[0]


def streamed(client, **kw):
  """(text, last finish_reason) of a streamed completion."""
  chunks = list(client.completions.create(
      model=M, prompt=PROMPT, temperature=0, stream=True, **kw))
  return ("".join(c.choices[0].text for c in chunks),
          [c.choices[0].finish_reason for c in chunks][-1])


def test_stop_token_ids_end_the_text_before_that_token(server):
  _, _, _, client, service = server
  plain = greedy_text(client).text
  at = 3
  [stop] = service.encode(plain[at])
  cut = plain[:plain.index(plain[at])]  # before its first appearance
  choice = greedy_text(client, extra_body={"stop_token_ids": [int(stop)]})
  assert choice.text == cut and plain[at] not in choice.text
  assert choice.finish_reason == "stop"
  assert streamed(client, max_tokens=20, extra_body={
      "stop_token_ids": [int(stop)]}) == (cut, "stop")
  chat = client.chat.completions.create(
      model=M, messages=[{"role": "user", "content": "line 9: the"}],
      max_tokens=20, temperature=0)
  content = chat.choices[0].message.content
  [chat_stop] = service.encode(content[2])
  cut_chat = client.chat.completions.create(
      model=M, messages=[{"role": "user", "content": "line 9: the"}],
      max_tokens=20, temperature=0,
      extra_body={"stop_token_ids": [int(chat_stop)]}).choices[0]
  assert cut_chat.message.content == content[:content.index(content[2])]
  assert cut_chat.finish_reason == "stop"


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(server):
  _, _, _, client, service = server
  plain = greedy_text(client).text
  [first] = (int(i) for i in service.encode(plain[0]))
  # Without min_tokens the first token ends it at once.
  at_once = greedy_text(client, extra_body={"stop_token_ids": [first]})
  assert at_once.text == "" and at_once.finish_reason == "stop"
  held = greedy_text(client, extra_body={"stop_token_ids": [first],
                                         "min_tokens": 6})
  assert len(held.text) >= 6 and plain[0] not in held.text
  assert held.finish_reason in ("stop", "length")
  assert streamed(client, max_tokens=20, extra_body={
      "stop_token_ids": [first], "min_tokens": 6}) == (
          held.text, held.finish_reason)
  stop = plain[:2]
  assert greedy_text(client, stop=[stop]).text == ""
  late = greedy_text(client, stop=[stop], extra_body={"min_tokens": 6})
  assert len(late.text) >= 6
  assert stop not in late.text[6:]
  assert late.text == plain[:len(late.text)]
  assert streamed(client, max_tokens=20, stop=[stop],
                  extra_body={"min_tokens": 6})[0] == late.text


def test_allowed_token_ids_restrict_every_draw(server):
  _, _, _, client, service = server
  allowed = sorted({int(i) for i in service.encode("the ")})
  draw = lambda **kw: client.completions.create(
      model=M, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=4,
      **kw).choices[0].text
  assert not set(draw()) <= set("the ")  # the model writes other letters
  for text in (draw(extra_body={"allowed_token_ids": allowed}),
               greedy_text(client, max_tokens=40,
                           extra_body={"allowed_token_ids": allowed}).text):
    assert len(text) == 40 and set(text) <= set("the ")
  assert streamed(client, max_tokens=40, extra_body={
      "allowed_token_ids": allowed})[0] == greedy_text(
          client, max_tokens=40,
          extra_body={"allowed_token_ids": allowed}).text
  for bad in ([], [10**6], "1"):
    with pytest.raises(openai.BadRequestError) as raised:
      greedy_text(client, extra_body={"allowed_token_ids": bad})
    assert raised.value.body["param"] == "allowed_token_ids"
  stats = service.engine.stats()  # per-row data: no new program
  assert stats["compiled_programs"] == stats["startup_programs"]


def test_prompt_logprobs_in_vllms_shape(server):
  _, _, _, client, service = server
  ids = [int(i) for i in service.encode(PROMPT)]
  out = client.completions.create(model=M, prompt=PROMPT, max_tokens=2,
                                  temperature=0,
                                  extra_body={"prompt_logprobs": 3})
  got = out.choices[0].prompt_logprobs
  scores = service.scorer.score_ids(np.array(ids))
  assert len(got) == len(ids) and got[0] is None
  for token, score, entry in zip(ids[1:], scores, got[1:]):
    mine = entry[str(token)]
    np.testing.assert_allclose(mine["logprob"], score, atol=2e-5)
    assert mine["decoded_token"] == service.tokenizer.token_text(token)
    top = sorted(entry.values(), key=lambda e: -e["logprob"])
    assert len(entry) in (3, 4)
    assert [e["rank"] for e in top[:3]] == [1, 2, 3]
    greater = sum(e["logprob"] > mine["logprob"] for e in entry.values())
    # Among the three most likely: its place; else past them.
    assert (mine["rank"] == 1 + greater if len(entry) == 3
            else mine["rank"] >= 4 and greater == 3)
  assert out.choices[0].logprobs is None  # logprobs were not asked
  messages = [{"role": "user", "content": "line 9: the"}]
  chat = client.chat.completions.create(
      model=M, messages=messages, max_tokens=2, temperature=0,
      extra_body={"prompt_logprobs": 0})
  transcript = service.api.transcript(messages)
  assert len(chat.prompt_logprobs) == len(transcript)
  assert all(len(e) == 1 for e in chat.prompt_logprobs[1:])
  with pytest.raises(openai.BadRequestError) as raised:
    list(client.completions.create(model=M, prompt=PROMPT, stream=True,
                                   extra_body={"prompt_logprobs": 1}))
  assert raised.value.body["param"] == "prompt_logprobs"


def test_chat_generates_past_16_tokens_without_max_tokens(server):
  _, _, _, client, service = server
  out = client.chat.completions.create(
      model=M, messages=[{"role": "user", "content": "line 9: the"}],
      temperature=0)
  limit = service.limits.max_new_tokens
  assert out.usage.completion_tokens > 16
  assert (out.choices[0].finish_reason, out.usage.completion_tokens) in (
      ("length", limit), ("stop", out.usage.completion_tokens))
  # Completions keep OpenAI's default of 16.
  plain = client.completions.create(model=M, prompt=PROMPT, temperature=0)
  assert plain.usage.completion_tokens == 16


def test_generation_prompt_and_continuing_the_last_message(server):
  _, _, port, client, service = server
  messages = [{"role": "user", "content": "line 9: the"},
              {"role": "assistant", "content": "line 10: the qu"}]
  tokens = lambda **kw: json.loads(raw(port, "POST", "/tokenize", {
      "messages": messages, **kw})[1])["tokens"]
  encode = lambda text: [int(i) for i in service.encode(text)]
  closed = "user: line 9: the\nassistant: line 10: the qu\n"
  assert tokens() == encode(closed + "assistant: ")
  assert tokens(add_generation_prompt=False) == encode(closed)
  assert tokens(continue_final_message=True) == encode(closed[:-1])
  status, body = raw(port, "POST", "/tokenize", {
      "messages": messages, "continue_final_message": True,
      "add_generation_prompt": True})
  assert status == 400 and "continue_final_message" in json.loads(body)[
      "error"]
  reply = client.chat.completions.create(
      model=M, messages=messages, max_tokens=12, temperature=0,
      extra_body={"continue_final_message": True,
                  "add_generation_prompt": False}).choices[0].message.content
  assert reply == client.completions.create(
      model=M, prompt=closed[:-1], max_tokens=12, temperature=0,
      stop=["\nuser:"]).choices[0].text


def test_text_offset_counts_the_echoed_texts_characters(server):
  _, _, _, client, service = server
  unk = service.tokenizer.unk_id
  ids = [unk] + [int(i) for i in service.encode(PROMPT)] + [unk]
  choice = client.completions.create(model=M, prompt=ids, max_tokens=3,
                                     temperature=0, echo=True,
                                     logprobs=0).choices[0]
  assert choice.text.startswith("\ufffd" + PROMPT + "\ufffd")
  assert choice.logprobs.tokens[0] == "<unk>"
  assert choice.logprobs.text_offset == list(range(len(choice.text)))


def test_word_offsets_follow_the_prompts_own_spacing():
  """Word tokens: text_offset indexes the text as sent, double spaces,
  unknown words and line breaks included."""
  tok = WordTokenizer.build("the cat sat\n")
  text = "the  cat zebra\nsat"
  ids = tok.encode_prompt(text)
  assert tok.token_text(int(ids[2])) == "<unk>"
  assert openai_answers.prompt_starts(tok, ids, text) == [0, 5, 9, 14, 15]
  decoded = tok.decode(ids)  # a token-id prompt echoes this
  assert openai_answers.prompt_starts(tok, ids, decoded) == [0, 4, 8, 13, 14]


def test_a_body_that_is_not_json_is_refused(server):
  _, _, port, _, _ = server
  body = json.dumps(GOOD).encode()
  for kind in ("text/plain", "application/x-www-form-urlencoded",
               "multipart/form-data; boundary=x", None):
    headers = {"Content-Type": kind} if kind else {"Content-Type": ""}
    status, _, answer = http_call(port, "POST", "/v1/completions", body,
                                  headers)
    assert status == 415, (kind, answer)
    assert "application/json" in json.loads(answer)["error"]["message"]
    status, _, _ = http_call(port, "POST", "/generate",
                             {"prompt": "the "}, headers)
    assert status == 415
  status, _, answer = http_call(port, "POST", "/v1/completions", body, {
      "Content-Type": "application/json; charset=utf-8"})
  assert status == 200 and json.loads(answer)["choices"][0]["text"]


def test_stream_options_without_stream_is_refused(server):
  _, _, port, client, _ = server
  with pytest.raises(openai.BadRequestError) as raised:
    client.completions.create(model=M, prompt=PROMPT, max_tokens=2,
                              stream_options={"include_usage": True})
  assert raised.value.body["param"] == "stream_options"
  status, _ = raw(port, "POST", "/v1/chat/completions", {
      "model": M, "messages": [{"role": "user", "content": "the"}],
      "stream_options": {"include_usage": True}})
  assert status == 400
  with pytest.raises(openai.BadRequestError) as raised:
    client.completions.create(model=M, prompt=PROMPT, max_tokens=2,
                              stream=True, stream_options={
                                  "continuous_usage_stats": True})
  assert raised.value.body["param"] == "stream_options"
  assert "include_usage" in raised.value.body["message"]


REFUSED = [  # (route, field, value): what the server would not do
    ("completions", "use_beam_search", True),
    ("completions", "ignore_eos", False),
    ("completions", "include_stop_str_in_output", True),
    ("completions", "bad_words", ["the"]),
    ("completions", "response_format", {"type": "json_object"}),
    ("completions", "truncate_prompt_tokens", 0),
    ("completions", "truncate_prompt_tokens", 10**6),  # past the limit
    ("completions", "truncation_side", "middle"),
    ("completions", "return_token_ids", "yes"),
    ("completions", "skip_special_tokens", True),
    ("completions", "stop_token_ids", [10**6]),
    ("completions", "min_tokens", 5),  # more than max_tokens 4
    ("completions", "prompt_logprobs", -1),
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "echo", 1),
    ("chat", "truncate_prompt_tokens", -2),
    ("chat", "return_tokens_as_token_ids", 1),
    ("chat", "chat_template", "{{ messages }}"),
    ("chat", "guided_choice", ["a", "b"]),
    ("chat", "reasoning_effort", "high"),
    ("chat", "top_logprobs", 2),  # without logprobs
    ("chat", "stream_options", {"include_usage": True}),  # without stream
]


@pytest.mark.parametrize("route, field, value", REFUSED,
                         ids=[f"{r}:{f}" for r, f, _ in REFUSED])
def test_a_field_it_cannot_honour_is_refused(server, route, field, value):
  _, _, port, _, _ = server
  body = dict(GOOD) if route == "completions" else {
      "model": M, "messages": [{"role": "user", "content": "the"}],
      "max_tokens": 4}
  body[field] = value
  status, answer = raw(port, "POST", f"/v1/{route.replace('chat', 'chat/')}"
                       f"{'completions' if route == 'chat' else ''}", body)
  error = json.loads(answer)["error"]
  assert status == 400 and error["param"] == field, error
  assert field in error["message"]


def test_fields_that_ask_nothing_are_taken_without_a_warning(server, caplog):
  _, _, port, _, _ = server
  caplog.set_level(logging.WARNING, logger="zebra_jax.serve")
  plain = json.loads(raw(port, "POST", "/v1/completions", {
      **GOOD, "temperature": 0})[1])["choices"][0]["text"]
  status, answer = raw(port, "POST", "/v1/completions", {
      **GOOD, "temperature": 0, "ignore_eos": True, "length_penalty": 1.0,
      "skip_special_tokens": False, "response_format": {"type": "text"},
      "use_beam_search": False, "min_tokens": 0, "stop_token_ids": [],
      "allowed_token_ids": None, "user": "u", "request_id": "r1",
      "bad_words": []})
  assert status == 200 and json.loads(answer)["choices"][0]["text"] == plain
  assert not caplog.records


# --- vLLM's additions: token ids, truncation, chat echo, usage per event ---

CHAT = [{"role": "user", "content": "line 9: the"}]


def _ids(service, text):
  return [int(i) for i in service.encode(text)]


def test_return_token_ids_on_completions_whole_and_streamed(server):
  """vLLM's shape: a completion's choice holds its prompt's and its own
  token ids; a stream's first event per choice the prompt's, each event
  the tokens it brings."""
  _, _, _, client, service = server
  prompts = [PROMPT, "line 3: "]
  out = client.completions.create(
      model=M, prompt=prompts, max_tokens=9, temperature=0,
      extra_body={"return_token_ids": True})
  for prompt, choice in zip(prompts, out.choices):
    assert choice.prompt_token_ids == _ids(service, prompt)
    assert len(choice.token_ids) == 9
    assert service.tokenizer.decode(choice.token_ids) == choice.text
  plain = client.completions.create(model=M, prompt=PROMPT, max_tokens=9,
                                    temperature=0).choices[0]
  assert "token_ids" not in plain.model_extra
  chunks = list(client.completions.create(
      model=M, prompt=prompts, max_tokens=9, temperature=0, stream=True,
      extra_body={"return_token_ids": True}))
  for choice, prompt in zip(out.choices, prompts):
    mine = [c.choices[0] for c in chunks if c.choices[0].index ==
            choice.index]
    sent = [c.prompt_token_ids for c in mine
            if c.model_extra.get("prompt_token_ids") is not None]
    assert sent == [_ids(service, prompt)]  # once, in the first event
    assert mine[0].model_extra.get("prompt_token_ids") is not None
    assert [t for c in mine for t in c.token_ids] == choice.token_ids
  # With echo the prompt's ids ride on the echoed prompt's event.
  echoed = list(client.completions.create(
      model=M, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
      echo=True, extra_body={"return_token_ids": True}))
  assert echoed[0].choices[0].text == PROMPT
  assert echoed[0].choices[0].prompt_token_ids == _ids(service, PROMPT)


def test_return_token_ids_on_chat_whole_and_streamed(server):
  """Chat: the prompt's ids beside the choices (one prompt for all), each
  choice's own on it; streamed, the prompt's on the role's event."""
  _, _, port, client, _ = server
  prompt = json.loads(raw(port, "POST", "/tokenize",
                          {"messages": CHAT})[1])["tokens"]
  out = client.chat.completions.create(
      model=M, messages=CHAT, max_tokens=10, temperature=0, n=2,
      extra_body={"return_token_ids": True})
  assert out.prompt_token_ids == prompt
  assert out.usage.prompt_tokens == len(prompt)
  assert [len(c.token_ids) for c in out.choices] == [
      out.usage.completion_tokens // 2] * 2
  chunks = list(client.chat.completions.create(
      model=M, messages=CHAT, max_tokens=10, temperature=0, stream=True,
      extra_body={"return_token_ids": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[0].prompt_token_ids == prompt
  assert all(c.model_extra.get("prompt_token_ids") is None
             for c in chunks[1:])
  assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == (
      out.choices[0].token_ids)


def test_return_tokens_as_token_ids_names_every_logprob_token(server):
  _, _, _, client, service = server
  text = service.tokenizer.token_text
  plain = client.completions.create(model=M, prompt=PROMPT, max_tokens=6,
                                    temperature=0, logprobs=2,
                                    echo=True).choices[0].logprobs
  named = client.completions.create(
      model=M, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
      echo=True, extra_body={"return_tokens_as_token_ids": True,
                             "return_token_ids": True}).choices[0]
  ids = named.prompt_token_ids + named.token_ids
  assert named.logprobs.tokens == [f"token_id:{i}" for i in ids]
  assert named.logprobs.token_logprobs == plain.token_logprobs
  for mine, theirs in zip(named.logprobs.top_logprobs[1:],
                          plain.top_logprobs[1:]):
    assert {text(int(k.split(":")[1])): v for k, v in mine.items()} == theirs
  chat = client.chat.completions.create(
      model=M, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
      top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                  "return_token_ids": True}).choices[0]
  content = chat.logprobs.content
  assert [t.token for t in content] == [
      f"token_id:{i}" for i in chat.token_ids]
  assert all(t.bytes == list(text(i).encode()) for t, i in zip(
      content, chat.token_ids))  # the token's own text, as vLLM's
  assert all(a.token.startswith("token_id:") and len(t.top_logprobs) == 2
             for t in content for a in t.top_logprobs)
  streamed = list(client.chat.completions.create(
      model=M, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
      stream=True, extra_body={"return_tokens_as_token_ids": True}))
  assert [t.token for c in streamed if c.choices[0].logprobs
          for t in c.choices[0].logprobs.content] == [t.token for t in content]


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
  """vLLM's rule: the last N tokens (truncation_side "right": the first);
  -1 the longest prompt the server takes; usage counts what was kept."""
  _, _, _, client, service = server
  ids = _ids(service, PROMPT)
  cut = client.completions.create(
      model=M, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
      extra_body={"truncate_prompt_tokens": 5})
  alone = client.completions.create(model=M, prompt=ids[-5:], max_tokens=8,
                                    temperature=0, echo=True)
  assert cut.usage.prompt_tokens == 5
  assert cut.choices[0].text == alone.choices[0].text == PROMPT[-5:] + (
      alone.choices[0].text[5:])
  first = client.completions.create(
      model=M, prompt=[PROMPT], max_tokens=8, temperature=0,
      extra_body={"truncate_prompt_tokens": 4, "truncation_side": "right"})
  assert first.usage.prompt_tokens == 4
  assert first.choices[0].text == client.completions.create(
      model=M, prompt=ids[:4], max_tokens=8, temperature=0).choices[0].text
  whole = client.completions.create(
      model=M, prompt=PROMPT, max_tokens=1, temperature=0,
      extra_body={"truncate_prompt_tokens": -1})
  assert whole.usage.prompt_tokens == len(ids)
  chat = list(client.chat.completions.create(
      model=M, messages=CHAT, max_tokens=3, temperature=0, stream=True,
      stream_options={"include_usage": True},
      extra_body={"truncate_prompt_tokens": 6}))
  assert chat[-1].usage.prompt_tokens == 6


def test_truncate_prompt_tokens_minus_one_takes_an_overlong_prompt(char_run):
  cfg, workdir = char_run
  service = serve.Service(loading.load_for_inference(cfg, workdir),
                          serve.Limits(max_prompt_tokens=12), slots=2)
  try:
    with live_server(service) as httpd:
      client = openai.OpenAI(
          base_url=f"http://127.0.0.1:{httpd.server_port}/v1",
          api_key="unused", max_retries=0, timeout=60)
      long = PROMPT + " brown fox jumps"
      with pytest.raises(openai.BadRequestError):
        client.completions.create(model=M, prompt=long, max_tokens=2)
      out = client.completions.create(
          model=M, prompt=long, max_tokens=2, temperature=0, echo=True,
          extra_body={"truncate_prompt_tokens": -1})
  finally:
    service.close()
  assert out.usage.prompt_tokens == 12
  assert out.choices[0].text.startswith(long[-12:])


def test_chat_echo_repeats_the_last_message_of_the_replys_role(server):
  _, _, _, client, _ = server
  prefill = CHAT + [{"role": "assistant", "content": "line 10: the qu"}]
  ask = lambda messages, **kw: client.chat.completions.create(
      model=M, messages=messages, max_tokens=8, temperature=0, **kw)
  go_on = {"continue_final_message": True, "add_generation_prompt": False}
  plain = ask(prefill, extra_body=go_on).choices[0].message
  echoed = ask(prefill, extra_body={**go_on, "echo": True}).choices[0]
  assert echoed.message.role == plain.role == "assistant"
  assert echoed.message.content == "line 10: the qu" + plain.content
  streamed = list(ask(prefill, stream=True,
                      extra_body={**go_on, "echo": True}))
  assert "".join(c.choices[0].delta.content or "" for c in streamed) == (
      echoed.message.content)
  # A new assistant turn after a user's message: nothing to repeat.
  assert ask(CHAT, extra_body={"echo": True}).choices[0].message.content == (
      ask(CHAT).choices[0].message.content)
  # No turn opened: the reply speaks as the last message, which it echoes.
  user = ask(CHAT, extra_body={"echo": True,
                               "add_generation_prompt": False}).choices[0]
  assert user.message.role == "user"
  assert user.message.content.startswith("line 9: the")


def test_continuous_usage_stats_puts_usage_on_every_event(server):
  _, _, _, client, service = server
  for create, kw in ((client.completions.create,
                      {"prompt": [PROMPT, "the "], "n": 1}),
                     (client.chat.completions.create,
                      {"messages": CHAT, "n": 2})):
    chunks = list(create(model=M, max_tokens=7, temperature=0, stream=True,
                         stream_options={"include_usage": True,
                                         "continuous_usage_stats": True},
                         **kw))
    *events, final = chunks
    assert not final.choices and final.usage.completion_tokens == 14
    assert all(c.usage is not None for c in events)
    for index in (0, 1):
      mine = [c.usage for c in events if c.choices[0].index == index]
      done = [u.completion_tokens for u in mine]
      assert done == sorted(done) and done[-1] == 7
      assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens
                 for u in mine)
    if "prompt" in kw:
      assert {c.usage.prompt_tokens for c in events
              if c.choices[0].index == 1} == {len(_ids(service, "the "))}
    else:
      assert {c.usage.prompt_tokens for c in events} == {
          final.usage.prompt_tokens}


def test_version(server):
  _, _, port, _, _ = server
  status, body = raw(port, "GET", "/version")
  assert status == 200 and json.loads(body) == {
      "version": zebra_jax.__version__}


def test_offsets_of_joined_tokens_match_the_pairwise_count():
  """Characters and BPE tokens whose texts join into the prompt take the
  one-pass count; it gives the pairwise decodes' offsets, and a prompt
  whose tokens do not join (a character cut into bytes) still gets
  those."""
  pytest.importorskip("tokenizers")
  from zebra_jax.data.tokenizers import (BPESpec, BPETokenizer, CharSpec,
                                         CharTokenizer)
  text = "hello world, the wörld is big. é ü\n"
  bpe = BPETokenizer.build([text * 40], BPESpec(bpe_vocab_size=300))
  char = CharTokenizer.build(text, CharSpec())

  def pairwise(tok, ids):
    # Text the tokens cannot join into: the pairwise decodes run.
    return openai_answers.prompt_starts(tok, ids, "\0")

  for tok in (bpe, char):
    for prompt in (text, text[3:17], "ü" * 5 + text):
      ids = tok.encode_prompt(prompt)
      echoed = tok.decode(ids)
      assert openai_answers.prompt_starts(tok, ids, echoed) == (
          pairwise(tok, ids))
  arrow = bpe.encode_prompt("a→")  # unseen in training: byte tokens
  assert len(arrow) > 2
  assert openai_answers.prompt_starts(bpe, arrow, bpe.decode(arrow)) == (
      pairwise(bpe, arrow))
