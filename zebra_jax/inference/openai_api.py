"""OpenAI-compatible routes of --mode=serve: clients built for OpenAI's
completions API (the `openai` Python package, LangChain, curl scripts) talk
to a zebra_jax model unchanged.

  GET  /v1/models               -> {"object": "list", "data": [{"id": ...}]}
  POST /v1/completions          model, prompt (string or list of strings),
                                max_tokens (16), temperature (1), top_p (1),
                                seed (0), stop (string or list of up to 4),
                                stream (server-sent events, then
                                "data: [DONE]"), logprobs (0), echo, n (1),
                                user (ignored)

`logprobs: 0` returns each completion token's log-probability under the
model (temperature 1), scored after generation on the prompt + completion as
the tokenizer reads it back; alternatives (`logprobs` > 0) are not served.
Bad requests get 4xx answers in OpenAI's error shape:
{"error": {"message", "type", "param", "code"}}, `param` naming the field.
The limits are the server's (serve.max_new_tokens, max_rows, ...).
"""

import dataclasses
import json
import time
import uuid

from zebra_jax.errors import UserError
from zebra_jax.inference import sample
from zebra_jax import strict_json

MODEL_ID = "zebra_lstm"
MAX_STOPS = 4


class ApiError(Exception):
  """An error answer in OpenAI's shape (4xx, or 5xx with kind
  "server_error")."""

  def __init__(self, message: str, param: str | None = None,
               status: int = 400, code: str | None = None,
               kind: str = "invalid_request_error", headers=None):
    super().__init__(message)
    self.status, self.param, self.code, self.kind = status, param, code, kind
    self.headers = headers  # extra HTTP headers, e.g. WWW-Authenticate

  def payload(self) -> dict:
    return {"error": {"message": str(self), "type": self.kind,
                      "param": self.param, "code": self.code}}


_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed",
           "stop", "stream", "logprobs", "echo", "n", "user"}


def _number(body, name, default, low, high, integer=False, low_open=False):
  value = body.get(name, default)
  if value is None:
    return default
  kinds = int if integer else (int, float)
  if isinstance(value, bool) or not isinstance(value, kinds):
    raise ApiError(f"{name} must be {'an integer' if integer else 'a number'}"
                   f", got {json.dumps(value)}", name)
  if (value <= low if low_open else value < low) or value > high:
    lower = f"> {low}" if low_open else f">= {low}"
    raise ApiError(f"{name}={value} is outside the range: need {lower} and "
                   f"<= {high}", name)
  return value


def _strings(value, name, max_items, what):
  if isinstance(value, str):
    value = [value]
  if (not isinstance(value, list) or not value or len(value) > max_items
      or not all(isinstance(v, str) and v for v in value)):
    raise ApiError(f"{name} must be {what}", name)
  return value


@dataclasses.dataclass
class Request:
  """A checked /v1/completions request."""
  prompts: list
  ids: list       # each prompt's tokens, encoded once
  options: sample.Options
  stops: list
  stream: bool
  logprobs: bool
  echo: bool
  model: str


class Api:
  """What the OpenAI routes accept and answer, over a serve.Service (its
  tokenizer, defaults and limits); serve.App runs the requests."""

  def __init__(self, service):
    self.service = service
    self.created = int(time.time())

  def models(self, body=None) -> dict:
    del body
    return {"object": "list", "data": [self._model()]}

  def _model(self) -> dict:
    return {"id": MODEL_ID, "object": "model", "created": self.created,
            "owned_by": "zebra_jax"}

  def model(self, name: str) -> dict:
    if name != MODEL_ID:
      raise ApiError(f"the model {name!r} does not exist: this server serves "
                     f"{MODEL_ID!r}", "model", 404, "model_not_found")
    return self._model()

  def check(self, body) -> Request:
    """The request, or ApiError naming the field at fault."""
    if not isinstance(body, dict):
      raise ApiError("the body must be a JSON object, e.g. {\"model\": "
                     f"\"{MODEL_ID}\", \"prompt\": \"The \"}}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
      raise ApiError(f"unknown field(s) {', '.join(unknown)}: this server "
                     f"takes {', '.join(sorted(_FIELDS))}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str):
      raise ApiError("model is required: a string, e.g. "
                     f"\"{MODEL_ID}\" (GET /v1/models lists it)", "model")
    self.model(model)
    if "prompt" not in body:
      raise ApiError("prompt is required: a string or a list of strings",
                     "prompt")
    prompts = _strings(body["prompt"], "prompt", 1 << 30,
                       "a non-empty string or a list of non-empty strings")
    lim = self.service.limits
    max_tokens = _number(body, "max_tokens", 16, 1, 1 << 30, integer=True)
    if max_tokens > lim.max_new_tokens:
      raise ApiError(f"max_tokens={max_tokens} is too many tokens: this "
                     f"server generates at most {lim.max_new_tokens}",
                     "max_tokens")
    if len(prompts) > lim.max_rows:
      raise ApiError(f"{len(prompts)} prompts is more than {lim.max_rows}",
                     "prompt")
    temperature = _number(body, "temperature", 1.0, 0, 2)
    top_p = _number(body, "top_p", 1.0, 0, 1, low_open=True)
    seed = _number(body, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True)
    n = _number(body, "n", 1, 1, 1 << 30, integer=True)
    if n != 1:
      raise ApiError(f"n={n}: this server returns one completion per prompt "
                     "(n=1); send the prompt several times with other seeds",
                     "n")
    stops = []
    if body.get("stop") is not None:
      stops = _strings(body["stop"], "stop", MAX_STOPS,
                       f"a non-empty string or a list of up to {MAX_STOPS}")
    flags = {}
    for name in ("stream", "echo"):
      flags[name] = body.get(name) or False
      if not isinstance(flags[name], bool):
        raise ApiError(f"{name} must be true or false", name)
    logprobs = body.get("logprobs")
    if logprobs is not None:
      if isinstance(logprobs, bool) or not isinstance(logprobs, int):
        raise ApiError("logprobs must be an integer (0) or null", "logprobs")
      if logprobs != 0:
        raise ApiError(f"logprobs={logprobs}: this server returns the "
                       "chosen tokens' log-probabilities (logprobs=0), not "
                       "alternatives", "logprobs")
    options = dataclasses.replace(
        self.service.defaults, max_new_tokens=max_tokens,
        temperature=float(temperature), top_p=float(top_p), top_k=0,
        repetition_penalty=1.0, num_samples=1, seed=seed,
        stop="")  # the stops travel apart: up to MAX_STOPS of them
    generator, ids = self.service.generator, []
    for p in prompts:
      try:
        ids.append(generator.encode(p))
      except UserError as e:
        raise ApiError(str(e), "prompt") from None
      if len(ids[-1]) > lim.max_prompt_tokens:
        raise ApiError(f"a prompt of {len(ids[-1])} tokens is too many "
                       f"tokens: at most {lim.max_prompt_tokens}", "prompt")
    return Request(prompts, ids, options, stops, flags["stream"],
                   logprobs is not None, flags["echo"], model)

  def response(self, req: Request, rows, logprobs=None) -> dict:
    """The completion object for finished rows (serve.Row: prompt, text,
    reason, completion), `logprobs` per row when asked for."""
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
    for i, row in enumerate(rows):
      choices.append({
          "text": (row.prompt if req.echo else "") + row.text, "index": i,
          "logprobs": logprobs[i] if logprobs else None,
          "finish_reason": row.reason})
      usage["prompt_tokens"] += row.completion.prompt_tokens
      usage["completion_tokens"] += row.completion.completion_tokens
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": usage}

  def events(self, req: Request) -> "Events":
    return Events(req)


class Events:
  """A stream's server-sent events: text as it is generated, every prompt
  at once (choice `index`), a last chunk per prompt with its finish_reason,
  then [DONE]."""

  def __init__(self, req: Request):
    self.req = req
    self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

  def _event(self, index: int, text: str, reason=None) -> bytes:
    chunk = {"id": self.id, "object": "text_completion",
             "created": self.created, "model": self.req.model,
             "choices": [{"text": text, "index": index, "logprobs": None,
                          "finish_reason": reason}]}
    return f"data: {strict_json.dumps(chunk)}\n\n".encode("utf-8")

  def echo(self) -> bytes:
    return b"".join(self._event(i, p) for i, p in enumerate(self.req.prompts))

  def chunk(self, updates) -> bytes:
    """Events for [(index, new text, finish_reason or None)]: one event per
    row's new text (a burst of tokens travels together), then its end."""
    texts, ends = {}, []
    for index, text, reason in updates:
      if text:
        texts[index] = texts.get(index, "") + text
      if reason is not None:
        ends.append((index, reason))
    return b"".join([self._event(i, t) for i, t in texts.items()]
                    + [self._event(i, "", r) for i, r in ends])

  @staticmethod
  def done() -> bytes:
    return b"data: [DONE]\n\n"
