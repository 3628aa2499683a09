"""--mode=serve: a JSON-over-HTTP server that many clients share.

  POST /generate  {"prompt": "The "} or {"prompts": [...]}, plus any
                  sampling parameter (max_new_tokens, temperature, top_k,
                  top_p, min_p, repetition_penalty, presence_penalty,
                  frequency_penalty, logit_bias, seed, stop) and num_samples
                  -> {"texts": [...], "step": N}
  POST /score     {"text": "..."} or {"texts": [...]}, "verbose": bool
                  -> {"results": [{"tokens", "loss", "ppl"[, "bpc"]
                                   [, "token_logprobs"]}], "step": N}
  GET  /health    -> 200 {"status": "ok", ...}; 503 while draining or
                     after the engine failed for good
  GET  /metrics   Prometheus' text format (zebra_jax.inference.metrics)
  POST /v1/completions, POST /v1/chat/completions, GET /v1/models: OpenAI's
                  API as vLLM serves a base model (openai_api)
  POST /tokenize, POST /detokenize, GET /tokenizer_info: vLLM's tokenizer
                  endpoints (lm-evaluation-harness's remote tokenizer)

Every generated row is one row of the engine's running batch: a request's
rows are admitted together or not at all, their text comes back through
callbacks from the engine's thread, so a request costs no thread while it
waits. The HTTP side is aiohttp, an asyncio server: one event loop holds
every kept-alive connection and stream; a client that hangs up cancels its
handler at once (handler_cancellation), even while it waits for a
non-streamed answer, so its engine slot is freed at the next step; replies
leave with TCP_NODELAY and headers and body in one write.

Bound to 127.0.0.1 unless --host says otherwise. With an API key
(serve.api_key, serve.api_key_file or $ZEBRA_JAX_API_KEY) every route but
/health and /metrics needs `Authorization: Bearer KEY`, compared in constant
time, else 401. Request bodies are strict JSON (NaN and Infinity are a 400).
A full queue gets 503 with Retry-After. A failed engine step fails only the
requests in it (500, saying so); an engine that cannot recover turns
/health to 503 and the process exits 1, for a supervisor to restart it.
SIGTERM or SIGINT drain: new requests get 503, those in flight finish
within serve.drain_seconds, then the process exits 0. One access-log line
per request (serve.access_log).
"""

import asyncio
import contextvars
import dataclasses
import gc
import hmac
import ipaddress
import json
import logging as py_logging
import math
import os
import signal
import socket
import sys
import threading
import time

from absl import logging
from aiohttp import web
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.inference import engine as engines
from zebra_jax.inference import loading, metrics, openai_api, sample, score
from zebra_jax import strict_json

API_KEY_ENV = "ZEBRA_JAX_API_KEY"
access_log = py_logging.getLogger("zebra_jax.access")
# The tokens a request generated, for its access-log line: a box per
# request, set in the task that runs its handler.
_TOKENS: contextvars.ContextVar[list] = contextvars.ContextVar("tokens")


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask for; beyond it the answer is a 4xx."""
  max_body_bytes: int = 1 << 20
  max_new_tokens: int = 1024
  max_prompt_tokens: int = 4096
  max_rows: int = 64              # prompts x num_samples (or n) per request
  max_score_tokens: int = 100_000

  @classmethod
  def from_config(cls, cfg) -> "Limits":
    """cfg.serve's values (config/base.py defines every field)."""
    return cls(**{f.name: int(cfg.serve[f.name])
                  for f in dataclasses.fields(cls)})


class BadRequest(Exception):
  """A request the client must fix: becomes HTTP `status` with the message."""

  def __init__(self, message: str, status: int = 400):
    super().__init__(message)
    self.status = status


class Unavailable(Exception):
  """The server cannot take requests now (draining, or its engine failed)."""


_SCORE_FIELDS = {"text": str, "texts": list, "verbose": bool}
# /generate's own fields; every sampling parameter is taken by its name.
_GENERATE_FIELDS = {"prompt": str, "prompts": list, "num_samples": int,
                    "stop": (str, list), "logit_bias": dict}
_PARAM_FIELDS = {f.name for f in dataclasses.fields(engines.SamplingParams)
                 } - {"stop", "logit_bias", "logprobs", "prompt_logprobs"}


def _check_fields(body, allowed: dict) -> dict:
  """Rejects non-objects, unknown fields and wrong types."""
  if not isinstance(body, dict):
    raise BadRequest("the body must be a JSON object, e.g. {\"prompt\": \"The \"}")
  unknown = sorted(set(body) - set(allowed))
  if unknown:
    raise BadRequest(f"unknown field(s) {', '.join(unknown)}: allowed are "
                     f"{', '.join(sorted(allowed))}")
  for name, value in body.items():
    kinds = allowed[name]
    # bool is an int in Python; refuse it where a number is wanted.
    if not isinstance(value, kinds) or (isinstance(value, bool)
                                        and kinds is not bool):
      raise BadRequest(f"field {name} has the wrong type "
                       f"({type(value).__name__})")
  return body


def _texts(body: dict, one: str, many: str) -> list[str]:
  if (one in body) == (many in body):
    raise BadRequest(f"give exactly one of {one} (a string) or {many} (a list "
                     "of strings)")
  texts = [body[one]] if one in body else body[many]
  if not texts or not all(isinstance(t, str) and t for t in texts):
    raise BadRequest(f"{many} must be a non-empty list of non-empty strings")
  return texts


def _rss_bytes() -> int:
  """This process's resident memory (Linux /proc; 0 elsewhere)."""
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


def eos_token(tokenizer) -> str | None:
  """The text that ends a document for this tokenizer (vLLM's eos_token):
  word-level `<eos>`, else a line break where the vocabulary has one."""
  for candidate in ("<eos>", "\n"):
    try:
      ids = tokenizer.encode_prompt(candidate)
    except (UserError, ValueError):
      continue
    if len(ids) == 1 and tokenizer.token_text(int(ids[0])) in (candidate,
                                                               "\n"):
      return candidate
  return None


class Service:
  """The model behind the endpoints; usable without HTTP (tests, embedding)."""

  def __init__(self, loaded: loading.Loaded, limits: Limits = Limits(),
               slots: int | None = None, queue: int | None = None,
               chat_template: str | None = None):
    self.loaded, self.limits = loaded, limits
    self.tokenizer = loaded.tokenizer
    self.vocab_size = int(loaded.cfg.model.vocab_size)
    sizes = {k: v for k, v in (("slots", slots), ("queue", queue))
             if v is not None}  # else cfg.serve's
    self._fatal_listeners = []
    self.metrics = metrics.Metrics(lambda: self.engine.stats())
    self.generator = sample.Generator(
        loaded, max_prompt_tokens=limits.max_prompt_tokens,
        on_fatal=self._engine_failed, on_step=self.metrics.step.observe,
        **sizes)
    self.scorer = score.Scorer(loaded, loaded.cfg.eval.seq_len)
    # The config's sampling defaults, but a fresh seed per request.
    self.defaults = sample.sampling_params(loaded.cfg.sample, seed=None)
    self.engine = self.generator.engine  # compiles its programs now
    template = (loaded.cfg.serve.get("chat_template", "")
                if chat_template is None else chat_template)
    self.api = openai_api.Api(self, template)
    self.eos_token = eos_token(self.tokenizer)
    self._score_lock = threading.Lock()  # one scoring call at a time

  def close(self) -> None:
    self.generator.close()

  def on_fatal(self, listener) -> None:
    """listener(error) runs once if the engine fails for good."""
    self._fatal_listeners.append(listener)

  def _engine_failed(self, error) -> None:
    for listener in self._fatal_listeners:
      listener(error)

  def stats(self) -> dict:
    return self.engine.stats()

  def health(self) -> dict:
    m = self.loaded.cfg.model
    stats = self.stats()
    status = "ok" if stats["healthy"] else "failed"
    return {"status": status, "step": int(self.loaded.step),
            "tokenizer": self.tokenizer.kind,
            "vocab_size": m.vocab_size, "num_layers": m.num_layers,
            "hidden_size": m.hidden_size, "num_stripes": m.num_stripes,
            "head": m.head, "limits": dataclasses.asdict(self.limits),
            "engine": stats, "rss_bytes": _rss_bytes()}

  def encode(self, prompt: str) -> np.ndarray:
    """A prompt's tokens; UserError for text the model cannot read."""
    return self.generator.encode(prompt)

  def prompt_ids(self, prompt: str) -> np.ndarray:
    """A prompt's tokens, encoded once: checked here, then handed to the
    engine. BadRequest (413) beyond the limit."""
    ids = self.encode(prompt)
    if len(ids) > self.limits.max_prompt_tokens:
      raise BadRequest(f"a prompt of {len(ids)} tokens is too many tokens: "
                       f"at most {self.limits.max_prompt_tokens}", 413)
    return ids

  # --- /generate ---

  def generate_rows(self, body) -> list[engines.Row]:
    """/generate's rows: prompt-major (p0 s0, p0 s1, ...), row i drawing
    from stream i of the request's seed."""
    body = _check_fields(body, {**_GENERATE_FIELDS, **{
        k: int if k in ("max_new_tokens", "top_k", "seed") else (int, float)
        for k in _PARAM_FIELDS}})
    prompts = _texts(body, "prompt", "prompts")
    values = {k: v for k, v in body.items() if k in _PARAM_FIELDS}
    if "stop" in body:
      values["stop"] = openai_api._stops(body["stop"])  # pylint: disable=protected-access
    if "logit_bias" in body:
      try:
        values["logit_bias"] = openai_api._logit_bias(body["logit_bias"])  # pylint: disable=protected-access
      except openai_api.ApiError as e:
        raise BadRequest(str(e)) from None
    params = dataclasses.replace(self.defaults, **values)
    try:
      params.check(self.vocab_size)
    except engines.ParamError as e:
      raise BadRequest(f"{e.field}={json.dumps(body.get(e.field))}: "
                       f"{e.reason}") from None
    num_samples = body.get("num_samples", 1)
    if num_samples < 1:
      raise BadRequest(f"num_samples={num_samples} must be at least 1")
    lim = self.limits
    if params.max_new_tokens > lim.max_new_tokens:
      raise BadRequest(f"max_new_tokens={params.max_new_tokens} is too many "
                       f"tokens: at most {lim.max_new_tokens}", 413)
    if len(prompts) * num_samples > lim.max_rows:
      raise BadRequest(f"{len(prompts)} prompts x num_samples={num_samples} "
                       f"is more than {lim.max_rows} rows", 413)
    ids = [self.prompt_ids(p) for p in prompts]
    order = [(p, t) for p, t in zip(prompts, ids) for _ in range(num_samples)]
    return [engines.Row(p, params, t, i) for i, (p, t) in enumerate(order)]

  def generate(self, body) -> dict:
    """/generate without HTTP: blocks until every row is done."""
    done = self.engine.submit_many(self.generate_rows(body))
    texts = [r.prompt + r.result() for r in done]
    return {"texts": texts, "step": int(self.loaded.step)}

  # --- /score ---

  def score(self, body) -> dict:
    body = _check_fields(body, _SCORE_FIELDS)
    texts = _texts(body, "text", "texts")
    results = []
    with self._score_lock:
      ids = [self.tokenizer.encode(t) for t in texts]
      total = sum(len(i) for i in ids)
      if total > self.limits.max_score_tokens:
        raise BadRequest(f"{total} tokens to score is too many tokens: at "
                         f"most {self.limits.max_score_tokens}", 413)
      for text in texts:
        s = self.scorer.score_text(text)
        res = s.summary()
        if body.get("verbose"):
          res["token_logprobs"] = [[t, float(lp)] for t, lp in
                                   zip(s.tokens[1:], s.logprobs)]
        results.append(res)
    return {"results": results, "step": int(self.loaded.step)}

  # --- vLLM's tokenizer endpoints ---

  def tokenize(self, body) -> dict:
    """{"prompt": text} or {"messages": [...]} -> its tokens."""
    if not isinstance(body, dict):
      raise BadRequest("the body must be a JSON object, e.g. "
                       "{\"prompt\": \"The \"}")
    if "messages" in body:
      text = self.api.transcript(body["messages"])
    else:
      text = body.get("prompt")
      if not isinstance(text, str):
        raise BadRequest("prompt must be a string (or send messages)")
    ids = [int(i) for i in self.encode(text)] if text else []
    out = {"count": len(ids), "max_model_len": self.limits.max_prompt_tokens,
           "tokens": ids, "token_strs": None}
    if body.get("return_token_strs"):
      out["token_strs"] = [self.tokenizer.token_text(i) for i in ids]
    return out

  def detokenize(self, body) -> dict:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and
        0 <= t < self.vocab_size for t in tokens):
      raise BadRequest(f"tokens must be a list of token ids in [0, "
                       f"{self.vocab_size})")
    return {"prompt": self.tokenizer.decode(tokens)}

  def tokenizer_info(self) -> dict:
    return {"tokenizer_class": f"zebra_jax.{self.tokenizer.kind}",
            "eos_token": self.eos_token, "bos_token": None,
            "pad_token": None, "unk_token": None,
            "model_max_length": self.limits.max_prompt_tokens,
            "vocab_size": self.vocab_size}


class _Inbox:
  """Events from the engine's thread to one request on the event loop.

  The engine thread appends under a lock and wakes the loop only when the
  inbox was empty, so a burst of tokens costs one wake-up and is written
  as one chunk: the busier the server, the fewer, larger writes.
  """

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self._loop, self._lock = loop, threading.Lock()
    self._items, self._woken = [], False
    self._ready = asyncio.Event()

  def put(self, item) -> None:  # any thread
    with self._lock:
      self._items.append(item)
      if self._woken:
        return
      self._woken = True
    try:
      self._loop.call_soon_threadsafe(self._ready.set)
    except RuntimeError:  # the loop has closed: nobody is listening
      pass

  async def take(self) -> list:
    await self._ready.wait()
    with self._lock:
      items, self._items, self._woken = self._items, [], False
      self._ready.clear()
    return items


_NO_TOKENS = range(0)


class Rows:
  """A request's rows in the engine: admitted together (or not at all),
  cancelled together, their progress gathered on the event loop."""

  def __init__(self, service: Service, loop, rows: list[engines.Row],
               stream: bool = False):
    self._inbox, self._open = _Inbox(loop), len(rows)
    for i, row in enumerate(rows):
      # Without a listener the engine looks at a row's text only at its
      # end (or for its stop strings).
      row.on_text = ((lambda delta, tokens, i=i:
                      self._inbox.put((i, delta, tokens, None)))
                     if stream else None)
      row.on_done = lambda reason, i=i: self._inbox.put(
          (i, "", _NO_TOKENS, reason))
    self.requests = service.engine.submit_many(rows)

  def cancel(self) -> None:
    for r in self.requests:
      if not r.done():
        r.cancel()

  @property
  def tokens(self) -> int:
    return sum(r.completion_tokens for r in self.requests)

  async def updates(self):
    """Yields [(row, new text, tokens it completes, finish_reason or
    None)] as they come, until every row is done."""
    while self._open:
      items = await self._inbox.take()
      self._open -= sum(reason is not None for *_, reason in items)
      if items:
        yield items

  async def wait(self) -> list[engines.Request]:
    async for _ in self.updates():
      pass
    return self.requests


class HangUp(Exception):
  """The client closed its connection before its answer was complete."""


class GenerationFailed(Exception):
  """An engine step failed under a request's rows; the engine serves on."""


def _json(status: int, payload: dict, headers=None) -> web.Response:
  return web.Response(status=status,
                      body=strict_json.dumps(payload).encode("utf-8"),
                      content_type="application/json", headers=headers)


def _refuse_constant(name: str):
  raise ValueError(f"{name} is not JSON: send numbers only")


class _EventStream(web.StreamResponse):
  """A chunked stream whose headers leave with its first event: one write
  (one loopback wake-up) fewer per stream."""
  _send_headers_immediately = False


def _peer(request) -> str:
  peer = request.transport.get_extra_info("peername") if (
      request.transport is not None) else None
  return f"{peer[0]}:{peer[1]}" if peer else "?"


class App:
  """The routes, auth, errors, streams, CORS, metrics and the access log
  over one Service."""

  def __init__(self, service: Service, api_key: str = "",
               allowed_origins: str = ""):
    self.service, self.api = service, service.api
    self._key = api_key.encode("utf-8")
    origins = [o.strip() for o in allowed_origins.split(",") if o.strip()]
    self._any_origin, self._origins = "*" in origins, set(origins)
    self.draining = False
    self.in_flight = 0
    self.routes = {("GET", "/health"): self._health,
                   ("GET", "/metrics"): self._metrics,
                   ("POST", "/generate"): self._generate,
                   ("POST", "/score"): self._score,
                   ("POST", "/tokenize"): self._tokenize,
                   ("POST", "/detokenize"): self._detokenize,
                   ("GET", "/tokenizer_info"): self._tokenizer_info,
                   ("GET", "/v1/models"): self._models,
                   ("POST", "/v1/completions"): self._completions,
                   ("POST", "/v1/chat/completions"): self._chat}
    self._open = {"/health", "/metrics"}  # no API key asked

  def application(self) -> web.Application:
    app = web.Application(
        client_max_size=self.service.limits.max_body_bytes + 1)
    app.router.add_route("*", "/{path:.*}", self.dispatch)
    if self._origins:
      app.on_response_prepare.append(self._cors)
    return app

  # --- CORS: off unless serve.allowed_origins names the page's origin ---

  def _allowed(self, request) -> str | None:
    origin = request.headers.get("Origin")
    if origin and (self._any_origin or origin in self._origins):
      return origin
    return None

  async def _cors(self, request, response) -> None:
    origin = self._allowed(request)
    if origin:
      response.headers["Access-Control-Allow-Origin"] = (
          "*" if self._any_origin else origin)
      response.headers["Vary"] = "Origin"

  def _preflight(self, request) -> web.Response | None:
    if request.method != "OPTIONS" or not self._allowed(request):
      return None
    return web.Response(status=204, headers={
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": "Authorization, Content-Type",
        "Access-Control-Max-Age": "600"})

  # --- every request ---

  async def dispatch(self, request: web.Request) -> web.StreamResponse:
    start, path = time.perf_counter(), request.path
    openai = path.startswith("/v1/")
    peer = _peer(request)  # before a hang-up takes the transport away
    tokens = [0]
    _TOKENS.set(tokens)
    self.in_flight += 1
    status, note = 499, ""
    try:
      response = self._preflight(request) or await self._route(
          request, path, openai)
      status = response.status
      return response
    except HangUp as e:
      note = f" {e}"
      raise asyncio.CancelledError() from None
    except asyncio.CancelledError:
      note = " the client hung up"
      raise
    finally:
      self.in_flight -= 1
      seconds = time.perf_counter() - start
      self.service.metrics.request(path, status, seconds)
      access_log.info("%s \"%s %s\" %d %d tokens %.1f ms%s", peer,
                      request.method, path, status, tokens[0],
                      1e3 * seconds, note)

  async def _route(self, request, path, openai) -> web.StreamResponse:
    method = request.method
    try:
      if self.draining and path != "/health":
        raise Unavailable("the server is shutting down: retry on another "
                          "instance or after it restarts")
      if path not in self._open:
        self._authorize(request)
      route = self.routes.get((method, path))
      if method == "GET" and path.startswith("/v1/models/"):
        return _json(200, self.api.model(path[len("/v1/models/"):]))
      if route is None:
        known = any(p == path for _, p in self.routes)
        served = ", ".join(f"{m} {p}" for m, p in self.routes)
        raise BadRequest(f"{method} {path} is not served: use {served}",
                         405 if known else 404)
      body = await self._body(request) if method == "POST" else None
      return await route(request, body)
    except openai_api.ApiError as e:  # (outside /v1: the 401 of a key)
      return _json(e.status, e.payload() if openai else {"error": str(e)},
                   e.headers)
    except (BadRequest, UserError, engines.BadPrompt) as e:
      status = getattr(e, "status", 413 if getattr(e, "too_long", False)
                       else 400)
      return self._error(status, str(e), openai)
    except engines.QueueFull as e:
      retry = max(1, math.ceil(e.retry_after))
      return self._error(503, "the server is busy: every slot and queue "
                         f"place is taken; retry in {retry} s", openai,
                         "overloaded", {"Retry-After": str(retry)})
    except (Unavailable, engines.EngineClosed) as e:
      return self._error(503, str(e), openai, "unavailable",
                         {"Retry-After": "5"})
    except GenerationFailed as e:
      return self._error(500, str(e), openai, "engine_error")
    except (asyncio.CancelledError, HangUp):
      raise
    except Exception as e:  # pylint: disable=broad-except
      logging.exception("request failed")
      return self._error(500, f"internal error: {type(e).__name__}: {e}",
                         openai)

  @staticmethod
  def _error(status, message, openai, code=None, headers=None):
    if not openai:
      return _json(status, {"error": message}, headers)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return _json(status, openai_api.ApiError(
        message, status=status, code=code, kind=kind).payload(), headers)

  def _authorize(self, request) -> None:
    if not self._key:
      return
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode("utf-8"), self._key)):
      raise openai_api.ApiError(
          "a valid API key is required: send the header `Authorization: "
          "Bearer KEY` (OpenAI clients: api_key=KEY)" if not given else
          "the API key is not valid: send `Authorization: Bearer KEY` with "
          "the key the server was started with", status=401,
          code="invalid_api_key",
          headers={"WWW-Authenticate": "Bearer"})

  async def _body(self, request):
    length = request.headers.get("Content-Length")
    if length is None or not length.isdigit():
      raise BadRequest("a POST needs a Content-Length header", 411)
    limit = self.service.limits.max_body_bytes
    if int(length) > limit:
      raise BadRequest(f"the body of {length} bytes is too large: at most "
                       f"{limit}", 413)
    raw = await request.read()
    try:
      return json.loads(raw.decode("utf-8"),
                        parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as e:
      raise BadRequest(f"the body is not valid JSON: {e}") from None

  async def _off_loop(self, fn, *args):
    """A blocking call (scoring) on a worker thread."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

  # --- routes ---

  async def _health(self, request, body):
    del request, body
    health = self.service.health()
    if self.draining:
      health["status"] = "draining"
    return _json(200 if health["status"] == "ok" else 503, health)

  async def _metrics(self, request, body):
    del request, body
    data, content_type = self.service.metrics.exposition()
    response = web.Response(body=data)
    response.headers["Content-Type"] = content_type
    return response

  async def _models(self, request, body):
    del request, body
    return _json(200, self.api.models())

  async def _score(self, request, body):
    del request
    return _json(200, await self._off_loop(self.service.score, body))

  async def _tokenize(self, request, body):
    del request
    try:
      return _json(200, self.service.tokenize(body))
    except openai_api.ApiError as e:
      raise BadRequest(str(e)) from None

  async def _detokenize(self, request, body):
    del request
    return _json(200, self.service.detokenize(body))

  async def _tokenizer_info(self, request, body):
    del request, body
    return _json(200, self.service.tokenizer_info())

  async def _generate(self, request, body):
    rows = Rows(self.service, asyncio.get_running_loop(),
                self.service.generate_rows(body))
    done = await self._finish(request, rows)
    return _json(200, {"texts": [r.prompt + r.text for r in done],
                       "step": int(self.service.loaded.step)})

  async def _finish(self, request, rows: Rows) -> list[engines.Request]:
    """Every row's result; a hang-up meanwhile cancels them all."""
    try:
      done = await rows.wait()
    except asyncio.CancelledError:
      rows.cancel()
      raise HangUp(f"hung up before its answer; {len(rows.requests)} "
                   f"row(s) cancelled after {rows.tokens} tokens") from None
    finally:
      self._account(request, rows)
    failed = [r for r in done if r.finish_reason == "error"]
    if failed:
      raise GenerationFailed(
          f"the engine failed while generating this request "
          f"({type(failed[0].error).__name__}: {failed[0].error}); it "
          "rebuilt its state and serves on: retry the request")
    return done

  def _account(self, request, rows: Rows) -> None:
    """Tokens into the metrics and the access log, once per request."""
    del request
    tokens = rows.tokens
    _TOKENS.get([0])[0] = tokens
    first = [r.first_token_at - r.created for r in rows.requests
             if r.first_token_at is not None]
    self.service.metrics.generation(
        sum(r.fed for r in rows.requests), tokens,
        min(first) if first else None)

  async def _completions(self, request, body):
    return await self._openai(request, self.api.completions(body))

  async def _chat(self, request, body):
    return await self._openai(request, self.api.chat(body))

  async def _openai(self, request, req: openai_api.Request):
    rows = Rows(self.service, asyncio.get_running_loop(),
                [engines.Row(req.prompts[p].text, req.params,
                             req.prompts[p].ids, i) for p, i in req.rows()],
                stream=req.stream)
    answers = openai_api.Answers(self.api, req)
    if req.stream:
      return await self._stream(request, answers, rows)
    done = await self._finish(request, rows)
    return _json(200, answers.whole(done))

  async def _stream(self, request, answers, rows: Rows):
    """Server-sent events as text comes, then `data: [DONE]`."""
    response = _EventStream(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
      await response.prepare(request)
      start = answers.start(rows.requests)
      if start:
        await response.write(start)
      async for updates in rows.updates():
        await response.write(answers.chunk(rows.requests, updates))
      failed = [r for r in rows.requests if r.finish_reason == "error"]
      if failed:  # the status is sent: say so in the stream, OpenAI-style
        error = openai_api.ApiError(
            f"the engine failed while generating this request "
            f"({failed[0].error}); retry the request", status=500,
            code="engine_error", kind="server_error").payload()
        await response.write(
            f"data: {strict_json.dumps(error)}\n\n".encode())
      await response.write_eof(answers.end(rows.requests))
    except (asyncio.CancelledError, ConnectionError):
      rows.cancel()
      self._account(request, rows)
      raise HangUp(f"hung up mid-stream; {len(rows.requests)} row(s) "
                   f"cancelled after {rows.tokens} tokens") from None
    self._account(request, rows)
    return response


class Server:
  """The aiohttp app on a listening socket.

  Bound in the constructor (so a busy port fails early, and port 0's choice
  is known: `server_port`); `serve_forever()` runs the event loop in the
  calling thread until `shutdown()` from another one, a drain (`drain()`,
  or SIGTERM/SIGINT with handle_signals) or an engine failure
  (`failure` is then set).
  """

  def __init__(self, service: Service, host: str = "127.0.0.1",
               port: int = 0, api_key: str = "", allowed_origins: str = "",
               drain_seconds: float = 30.0, fatal_grace_seconds: float = 2.0):
    self.service = service
    self.app = App(service, api_key, allowed_origins)
    self.drain_seconds = drain_seconds
    # After an engine failure: time for the failed requests' answers to
    # leave and for a health probe to read 503, before the server stops.
    self.fatal_grace_seconds = fatal_grace_seconds
    self.socket = socket.create_server((host, port), backlog=1024)
    self.server_address = self.socket.getsockname()[:2]
    self.server_port = self.server_address[1]
    self.failure: BaseException | None = None
    self.stop_line = ""
    self._loop, self._stop = None, None
    self._started, self._stopped = threading.Event(), threading.Event()
    service.on_fatal(self._engine_failed)

  def serve_forever(self, handle_signals: bool = False) -> None:
    try:
      asyncio.run(self._serve(handle_signals))
    finally:
      self._stopped.set()

  async def _serve(self, handle_signals: bool) -> None:
    self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
    runner = web.AppRunner(self.app.application(), access_log=None,
                           handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    await web.SockSite(runner, self.socket).start()
    if handle_signals:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._loop.add_signal_handler(sig, self._on_signal, sig)
    self._started.set()
    try:
      await self._stop.wait()
    finally:
      await runner.cleanup()

  def _on_signal(self, sig) -> None:
    if self.app.draining:  # a second signal: stop now
      self._stop.set()
      return
    asyncio.ensure_future(self._drain(signal.Signals(sig).name))

  async def _drain(self, why: str) -> None:
    """New requests get 503; those in flight get drain_seconds to finish."""
    self.app.draining = True
    start = time.monotonic()
    waiting = self.app.in_flight
    while self.app.in_flight and (time.monotonic() - start
                                  < self.drain_seconds):
      await asyncio.sleep(0.02)
    left = self.app.in_flight
    self.stop_line = (
        f"| stopped ({why}): {waiting - left} of {waiting} request(s) in "
        f"flight finished in {time.monotonic() - start:.1f} s"
        + (f", {left} cut off after serve.drain_seconds="
           f"{self.drain_seconds:g}" if left else ""))
    self._stop.set()

  def drain(self, why: str = "drain", timeout: float = 60.0) -> None:
    """From another thread: drain, then stop serve_forever."""
    if self._started.wait(timeout) and not self._stopped.is_set():
      asyncio.run_coroutine_threadsafe(self._drain(why), self._loop)
    self._stopped.wait(timeout)

  def _engine_failed(self, error) -> None:  # the engine's thread
    self.failure = error
    if self._loop is not None:
      self._loop.call_soon_threadsafe(
          self._loop.call_later, self.fatal_grace_seconds, self._stop.set)

  def shutdown(self, timeout: float = 30.0) -> None:
    """Stops serve_forever (from another thread) and waits for it."""
    if self._started.wait(timeout) and not self._stopped.is_set():
      self._loop.call_soon_threadsafe(self._stop.set)
    self._stopped.wait(timeout)

  def server_close(self) -> None:
    self.socket.close()


def make_server(service: Service, host: str = "127.0.0.1", port: int = 0,
                api_key: str = "", **options) -> Server:
  """Bound and listening; port 0 picks a free one (`server.server_port`).
  options: allowed_origins, drain_seconds, fatal_grace_seconds."""
  return Server(service, host, port, api_key, **options)


def api_key(cfg) -> str:
  """serve.api_key, else the file serve.api_key_file names, else
  $ZEBRA_JAX_API_KEY, else '' (no key asked)."""
  if cfg.serve.api_key:
    return str(cfg.serve.api_key)
  path = cfg.serve.get("api_key_file", "")
  if path:
    try:
      with open(path, encoding="utf-8") as f:
        key = f.read().strip()
    except OSError as e:
      raise UserError(f"cannot read serve.api_key_file {path}: {e.strerror}: "
                      "point it at a file holding the key") from None
    if not key:
      raise UserError(f"serve.api_key_file {path} is empty: write the key "
                      "into it")
    return key
  return os.environ.get(API_KEY_ENV, "")


def _loopback(host: str) -> bool:
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return host == "localhost"


def _access_log_to_stderr(on: bool) -> None:
  """One line per request on stderr, whatever absl's verbosity."""
  access_log.propagate = False
  access_log.setLevel(py_logging.INFO if on else py_logging.WARNING)
  if on and not access_log.handlers:
    handler = py_logging.StreamHandler(sys.stderr)
    handler.setFormatter(py_logging.Formatter("%(asctime)s %(message)s"))
    access_log.addHandler(handler)


def run(cfg, workdir: str, host: str = "127.0.0.1", port: int = 8000) -> None:
  """--mode=serve: serves until SIGTERM/SIGINT (then drains, exit 0) or an
  engine failure it cannot recover from (exit 1)."""
  try:
    openai_api.check_chat_template(cfg.serve.chat_template or
                                   openai_api.DEFAULT_CHAT_TEMPLATE)
  except ValueError as e:
    raise UserError(str(e)) from None
  key = api_key(cfg)
  loaded = loading.load_for_inference(cfg, workdir)
  service = Service(loaded, Limits.from_config(cfg))
  try:
    server = make_server(service, host, port, key,
                         allowed_origins=cfg.serve.allowed_origins,
                         drain_seconds=cfg.serve.drain_seconds)
  except OSError as e:
    service.close()
    raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): pick "
                    "another --port, or 0 for a free one") from None
  if not _loopback(host) and not key:
    print(f"| warning: serving on {host} without an API key: anyone who can "
          f"reach it can use it; set {API_KEY_ENV} or "
          "--config.serve.api_key", flush=True)
  _access_log_to_stderr(bool(cfg.serve.access_log))
  py_logging.getLogger("zebra_jax.serve").setLevel(py_logging.WARNING)
  engine = service.engine
  # What start-up built (the model, jax's and flax's objects) lives as long
  # as the server: out of the collector's sight, a full collection scans
  # only what requests left, where it stalled every thread for 130 ms under
  # 64 clients (the p99 latency).
  gc.freeze()
  print(f"| serving step {loaded.step} on http://{host}:{server.server_port} "
        f"| {engine.slots} slots, queue {engine.queue_limit} "
        f"| API key {'required' if key else 'off'} "
        "| POST /v1/completions, /v1/chat/completions, /generate, /score, "
        "/tokenize, /detokenize; GET /v1/models, /health, /metrics, "
        "/tokenizer_info", flush=True)
  try:
    server.serve_forever(handle_signals=True)
  finally:
    server.server_close()
    service.close()
  if server.failure is not None:
    print(f"error: the serving engine failed and could not recover "
          f"({type(server.failure).__name__}: {server.failure}): exiting 1 "
          "so that a supervisor restarts the server", file=sys.stderr,
          flush=True)
    raise SystemExit(1)
  print(server.stop_line or "| stopped", flush=True)
