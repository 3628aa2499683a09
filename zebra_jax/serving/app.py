"""--mode=serve's HTTP routes over a Service: auth, errors in each API's shape,
streams, CORS, metrics and the access log.

The engine's thread hands a request's progress to the event loop through an
inbox per request (one wake-up per burst of tokens); a client that hangs up
cancels its handler at once (aiohttp's handler_cancellation), even while it
waits for a non-streamed answer, and its rows leave the batch at the next
step. Replies leave with TCP_NODELAY and headers and body in one write.
"""

import asyncio
import contextvars
import hmac
import json
import logging as py_logging
import math
import threading
import time

from absl import logging
from aiohttp import web

from zebra_jax import __version__
from zebra_jax.errors import UserError
from zebra_jax import engine as engines
from zebra_jax.serving import openai_answers, openai_api
from zebra_jax.serving.service import BadRequest, Service, Unavailable
from zebra_jax import strict_json

access_log = py_logging.getLogger("zebra_jax.access")
# The tokens a request generated, for its access-log line: a box per
# request, set in the task that runs its handler.
_TOKENS: contextvars.ContextVar[list] = contextvars.ContextVar("tokens")
# When the request arrived, on the engine's clock (time.monotonic()).
_ARRIVED: contextvars.ContextVar[float] = contextvars.ContextVar("arrived")


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
               stream: bool = False, prompt_tokens: int | None = None):
    self._inbox, self._open = _Inbox(loop), len(rows)
    # The request's prompt tokens as its usage counts them: a prompt once,
    # whatever the rows drawn from it.
    self.prompt_tokens = (sum(len(r.ids) for r in rows)
                          if prompt_tokens is None else prompt_tokens)
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
                   ("GET", "/version"): self._version,
                   ("POST", "/generate"): self._generate,
                   ("POST", "/score"): self._score,
                   ("POST", "/tokenize"): self._tokenize,
                   ("POST", "/detokenize"): self._detokenize,
                   ("GET", "/tokenizer_info"): self._tokenizer_info,
                   ("GET", "/v1/models"): self._models,
                   ("POST", "/v1/completions"): self._completions,
                   ("POST", "/v1/chat/completions"): self._chat}
    self._open = {"/health", "/metrics", "/version"}  # no API key asked

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
    _ARRIVED.set(time.monotonic())
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
    # JSON only: a browser sends text/plain and form bodies cross-site
    # without asking first (no CORS preflight).
    if request.content_type != "application/json":
      raise BadRequest("the body must be JSON sent as `Content-Type: "
                       f"application/json`, not {request.content_type!r}",
                       415)
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

  async def _version(self, request, body):
    del request, body
    return _json(200, {"version": __version__})

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
    del request
    rows = self.service.generate_rows(body)
    samples = body.get("num_samples", 1)  # rows of one prompt are adjacent
    rows = Rows(self.service, asyncio.get_running_loop(), rows,
                prompt_tokens=sum(len(r.ids) for r in rows[::samples]))
    done = await self._finish(rows)
    return _json(200, {"texts": [r.prompt + r.text for r in done],
                       "step": int(self.service.loaded.step)})

  async def _finish(self, rows: Rows) -> list[engines.Request]:
    """Every row's result; a hang-up meanwhile cancels them all."""
    try:
      done = await rows.wait()
    except asyncio.CancelledError:
      rows.cancel()
      self._account(rows)
      raise HangUp(f"hung up before its answer; {len(rows.requests)} "
                   f"row(s) cancelled after {rows.tokens} tokens") from None
    failed = [r for r in done if r.finish_reason == "error"]
    self._account(rows, served=not failed)
    if failed:
      raise GenerationFailed(
          f"the engine failed while generating this request "
          f"({type(failed[0].error).__name__}: {failed[0].error}); it "
          "rebuilt its state and serves on: retry the request")
    return done

  def _account(self, rows: Rows, served: bool = False) -> None:
    """Tokens into the metrics and the access log, once per request; for a
    request answered in full (`served`), its latencies too, timed from its
    arrival: to its first token produced, and to now, its last delivered."""
    tokens = rows.tokens
    _TOKENS.get([0])[0] = tokens
    metrics = self.service.metrics
    metrics.generation(sum(r.fed for r in rows.requests), tokens)
    if not served:
      return
    arrived = _ARRIVED.get()
    first = [r.first_token_at for r in rows.requests
             if r.first_token_at is not None]
    metrics.served(time.monotonic() - arrived,
                   min(first) - arrived if first else None,
                   rows.prompt_tokens, tokens,
                   max(r.completion_tokens for r in rows.requests))

  async def _completions(self, request, body):
    return await self._openai(request, self.api.completions(body))

  async def _chat(self, request, body):
    return await self._openai(request, self.api.chat(body))

  async def _openai(self, request, req: openai_api.Request):
    rows = Rows(self.service, asyncio.get_running_loop(),
                [engines.Row(req.prompts[p].text, req.params,
                             req.prompts[p].ids, i) for p, i in req.rows()],
                stream=req.stream,
                prompt_tokens=sum(len(p.ids) for p in req.prompts))
    answers = openai_answers.Answers(self.service.tokenizer, req)
    if req.stream:
      return await self._stream(request, answers, rows)
    done = await self._finish(rows)
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
      self._account(rows)
      raise HangUp(f"hung up mid-stream; {len(rows.requests)} row(s) "
                   f"cancelled after {rows.tokens} tokens") from None
    self._account(rows, served=not failed)
    return response
