"""--mode=serve: a JSON-over-HTTP server that many clients share.

  POST /generate  {"prompt": "The "} or {"prompts": [...]}, plus any of
                  max_new_tokens, temperature, top_k, top_p,
                  repetition_penalty, stop, num_samples, seed
                  -> {"texts": [...], "step": N}
  POST /score     {"text": "..."} or {"texts": [...]}, "verbose": bool
                  -> {"results": [{"tokens", "loss", "ppl"[, "bpc"]
                                   [, "token_logprobs"]}], "step": N}
  GET  /health    -> {"status": "ok", "step": N, "tokenizer": ...,
                      "engine": {slots, busy, queued, compiled_programs},
                      "rss_bytes": ...}
  POST /v1/completions, GET /v1/models: OpenAI's completions API
                  (zebra_jax.inference.openai_api), errors in its shape

Every generated row is one request to the engine's running batch
(`Service.submit`): its text comes back through callbacks from the engine's
thread, so a request costs no thread while it waits. The HTTP side is
aiohttp, an asyncio server, rather than the standard library's
ThreadingHTTPServer because serving many streams at once needs what the
latter lacks: one event loop holds every kept-alive connection and stream
without a thread each; a client that hangs up cancels its handler at once
(aiohttp's handler_cancellation), even while it waits for a non-streamed
answer, so its engine slot is freed at the next step; replies leave with
TCP_NODELAY and headers and body in one write (the standard server sent
them in two writes, and Nagle's algorithm with delayed ACKs held every
non-streamed reply on a kept-alive connection ~40 ms); streams are
chunk-encoded, so their connection is kept alive too.

Bound to 127.0.0.1 unless --host says otherwise. With an API key
(serve.api_key, or the ZEBRA_JAX_API_KEY environment variable) every route
but /health needs `Authorization: Bearer KEY`, compared in constant time,
else 401. Every bad request (not JSON, unknown field, wrong type, too many
tokens, body too large) gets a 4xx with {"error": message} (OpenAI's shape
under /v1); a full queue gets 503 with Retry-After; the server keeps
serving.
"""

import asyncio
import dataclasses
import gc
import hmac
import ipaddress
import json
import math
import os
import socket
import threading
import time

from absl import logging
from aiohttp import web
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.inference import engine as engines
from zebra_jax.inference import loading, openai_api, sample, score
from zebra_jax import strict_json

API_KEY_ENV = "ZEBRA_JAX_API_KEY"


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask for; beyond it the answer is a 4xx."""
  max_body_bytes: int = 1 << 20
  max_new_tokens: int = 1024
  max_prompt_tokens: int = 4096
  max_rows: int = 64              # prompts x num_samples per request
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


_GENERATE_FIELDS = {"prompt": str, "prompts": list, "max_new_tokens": int,
                    "temperature": (int, float), "top_k": int,
                    "top_p": (int, float), "repetition_penalty": (int, float),
                    "stop": str, "num_samples": int, "seed": int}
_SCORE_FIELDS = {"text": str, "texts": list, "verbose": bool}


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


class Service:
  """The model behind the endpoints; usable without HTTP (tests, embedding)."""

  def __init__(self, loaded: loading.Loaded, limits: Limits = Limits(),
               slots: int | None = None, queue: int | None = None):
    self.loaded, self.limits = loaded, limits
    sizes = {k: v for k, v in (("slots", slots), ("queue", queue))
             if v is not None}  # else cfg.serve's
    self.generator = sample.Generator(
        loaded, max_prompt_tokens=limits.max_prompt_tokens, **sizes)
    self.scorer = score.Scorer(loaded, loaded.cfg.eval.seq_len)
    self.defaults = sample.Options.from_config(loaded.cfg.sample)
    self.engine = self.generator.engine  # compiles its programs now
    self._score_lock = threading.Lock()  # one scoring call at a time

  def close(self) -> None:
    self.generator.close()

  def stats(self) -> dict:
    return self.engine.stats()

  def health(self) -> dict:
    m = self.loaded.cfg.model
    return {"status": "ok", "step": int(self.loaded.step),
            "tokenizer": self.loaded.tokenizer.kind,
            "vocab_size": m.vocab_size, "num_layers": m.num_layers,
            "hidden_size": m.hidden_size, "num_stripes": m.num_stripes,
            "head": m.head, "limits": dataclasses.asdict(self.limits),
            "engine": self.stats(), "rss_bytes": _rss_bytes()}

  def prompt_ids(self, prompt: str) -> np.ndarray:
    """A prompt's tokens, encoded once: checked here, then handed to the
    engine. UserError for text the model cannot read, and BadRequest (413)
    beyond the limit."""
    ids = self.generator.encode(prompt)
    if len(ids) > self.limits.max_prompt_tokens:
      raise BadRequest(f"a prompt of {len(ids)} tokens is too many tokens: "
                       f"at most {self.limits.max_prompt_tokens}", 413)
    return ids

  def submit(self, prompt: str, options: sample.Options, stops=(),
             on_text=None, on_done=None, sample_index: int = 0,
             ids=None) -> "engines.Completion":
    """One row into the engine's running batch; returns at once. ids: the
    prompt's tokens (prompt_ids), if encoded already.

    on_text(delta) gets completion text as it is generated and
    on_done(finish_reason) once at the end; both run on the engine's
    thread. Raises engine.QueueFull when no slot or queue place is left.
    """
    settings = dataclasses.replace(sample.to_settings(options, stops),
                                   sample_index=sample_index)
    try:
      return self.engine.submit(prompt, settings, on_text=on_text,
                                on_done=on_done, ids=ids)
    except engines.BadPrompt as e:
      raise BadRequest(str(e), 413 if "too many" in str(e) else 400) from None

  def check_generate(self, body) -> tuple[list[str], list, sample.Options]:
    """/generate's prompts, their tokens and the settings."""
    body = _check_fields(body, _GENERATE_FIELDS)
    prompts = _texts(body, "prompt", "prompts")
    settings = {k: v for k, v in body.items() if k not in ("prompt", "prompts")}
    options = dataclasses.replace(self.defaults, **settings)
    options.check()
    lim = self.limits
    if options.max_new_tokens > lim.max_new_tokens:
      raise BadRequest(f"max_new_tokens={options.max_new_tokens} is too many "
                       f"tokens: at most {lim.max_new_tokens}", 413)
    if len(prompts) * options.num_samples > lim.max_rows:
      raise BadRequest(f"{len(prompts)} prompts x num_samples="
                       f"{options.num_samples} is more than {lim.max_rows} "
                       "rows", 413)
    return prompts, [self.prompt_ids(p) for p in prompts], options

  def rows(self, prompts: list[str], ids: list, options: sample.Options):
    """(prompt, its tokens, options, sample index) per generated row,
    prompt-major (p0 s0, p0 s1, ...); sample j of a prompt draws from its
    own stream of the seed."""
    one = dataclasses.replace(options, num_samples=1)
    return [(p, t, one, j) for p, t in zip(prompts, ids)
            for j in range(options.num_samples)]

  def generate(self, body) -> dict:
    """/generate without HTTP: blocks until every row is done."""
    rows = self.rows(*self.check_generate(body))
    done = [self.submit(p, o, sample_index=j, ids=t) for p, t, o, j in rows]
    texts = [p + c.result() for (p, *_), c in zip(rows, done)]
    return {"texts": texts, "step": int(self.loaded.step)}

  def score(self, body) -> dict:
    body = _check_fields(body, _SCORE_FIELDS)
    texts = _texts(body, "text", "texts")
    results = []
    with self._score_lock:
      ids = [self.loaded.tokenizer.encode(t) for t in texts]
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

  def logprobs(self, prompt: str, completion: str) -> dict:
    """The completion tokens' log-probabilities given what precedes them
    (OpenAI's `logprobs` object); blocks, so the server runs it off its
    event loop."""
    tokenizer, generator = self.loaded.tokenizer, self.generator
    head = len(generator.encode(prompt))
    ids = generator.encode(prompt + completion) if completion else []
    if len(ids) <= head:
      return {"tokens": [], "token_logprobs": [], "top_logprobs": None,
              "text_offset": []}
    with self._score_lock:
      scores = self.scorer.score_ids(ids)[head - 1:]
    tokens = [tokenizer.token_text(int(i)) for i in ids[head:]]
    offsets, at = [], len(prompt)
    for t in tokens:
      offsets.append(at)
      at += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in scores],
            "top_logprobs": None, "text_offset": offsets}


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


@dataclasses.dataclass
class Row:
  """One generated row as the HTTP side sees it."""
  prompt: str
  text: str = ""
  reason: str | None = None  # finish_reason once done
  completion: "engines.Completion | None" = None


class Rows:
  """A request's rows in the engine: submitted together, cancelled
  together, their text gathered on the event loop."""

  def __init__(self, service: Service, loop, rows, stops=(),
               stream: bool = False):
    self.rows = [Row(prompt) for prompt, *_ in rows]
    self._inbox, self._open = _Inbox(loop), len(rows)
    try:
      for i, (prompt, ids, options, j) in enumerate(rows):
        # Without a listener the engine looks at a row's text only at its
        # end (or for its stop strings).
        on_text = ((lambda delta, i=i: self._inbox.put((i, delta, None)))
                   if stream else None)
        self.rows[i].completion = service.submit(
            prompt, options, stops, sample_index=j, ids=ids, on_text=on_text,
            on_done=lambda reason, i=i: self._inbox.put((i, "", reason)))
    except BaseException:
      self.cancel()  # the rows already admitted leave with the request
      raise

  def cancel(self) -> None:
    for row in self.rows:
      if row.completion is not None and row.reason is None:
        row.completion.cancel()

  @property
  def tokens(self) -> int:
    return sum(r.completion.completion_tokens for r in self.rows
               if r.completion is not None)

  async def updates(self):
    """Yields [(row index, new text, finish_reason or None)] as they come,
    until every row is done."""
    while self._open:
      items = await self._inbox.take()
      for i, delta, reason in items:
        row = self.rows[i]
        row.text += delta
        if reason is not None:
          row.text, row.reason = row.completion.text, reason  # all of it
          self._open -= 1
      if items:
        yield items

  async def wait(self) -> list[Row]:
    async for _ in self.updates():
      pass
    return self.rows


class HangUp(Exception):
  """The client closed its connection before its answer was complete."""


def _overloaded(e: "engines.QueueFull", openai: bool) -> web.Response:
  retry = max(1, math.ceil(e.retry_after))
  message = (f"the server is busy: every slot and queue place is taken; "
             f"retry in {retry} s")
  payload = (openai_api.ApiError(message, status=503, code="overloaded",
                                 kind="server_error").payload()
             if openai else {"error": message})
  return _json(503, payload, {"Retry-After": str(retry)})


def _json(status: int, payload: dict, headers=None) -> web.Response:
  return web.Response(status=status,
                      body=strict_json.dumps(payload).encode("utf-8"),
                      content_type="application/json", headers=headers)


class App:
  """The routes, auth, errors and streams over one Service."""

  def __init__(self, service: Service, api_key: str = ""):
    self.service, self.api = service, openai_api.Api(service)
    self._key = api_key.encode("utf-8")
    self.routes = {("GET", "/health"): self._health,
                   ("POST", "/generate"): self._generate,
                   ("POST", "/score"): self._score,
                   ("GET", "/v1/models"): self._models,
                   ("POST", "/v1/completions"): self._completions}

  def application(self) -> web.Application:
    app = web.Application(
        client_max_size=self.service.limits.max_body_bytes + 1)
    app.router.add_route("*", "/{path:.*}", self.dispatch)
    return app

  async def dispatch(self, request: web.Request) -> web.StreamResponse:
    start, path = time.perf_counter(), request.path
    openai = path.startswith("/v1/")
    peer = _peer(request)
    try:
      response = await self._route(request, path, openai)
    except HangUp as e:
      logging.info("%s %s %s: %s", peer, request.method, path, e)
      raise asyncio.CancelledError() from None
    except asyncio.CancelledError:
      logging.info("%s %s %s: the client hung up", peer, request.method, path)
      raise
    logging.info("%s %s %s %d %.1f ms", peer, request.method, path,
                 response.status, 1e3 * (time.perf_counter() - start))
    return response

  async def _route(self, request, path, openai) -> web.StreamResponse:
    method = request.method
    try:
      if path != "/health":
        self._authorize(request)
      route = self.routes.get((method, path))
      if method == "GET" and path.startswith("/v1/models/"):
        return _json(200, self.api.model(path[len("/v1/models/"):]))
      if route is None:
        known = any(p == path for _, p in self.routes)
        raise BadRequest(f"{method} {path} is not served: use GET /health, "
                         "POST /generate, POST /score, GET /v1/models or "
                         "POST /v1/completions", 405 if known else 404)
      body = await self._body(request) if method == "POST" else None
      return await route(request, body)
    except openai_api.ApiError as e:  # (outside /v1: the 401 of a key)
      return _json(e.status, e.payload() if openai else {"error": str(e)},
                   e.headers)
    except (BadRequest, UserError) as e:  # UserError: e.g. unseen characters
      status = getattr(e, "status", 400)
      return _json(status, openai_api.ApiError(str(e), status=status)
                   .payload() if openai else {"error": str(e)})
    except engines.QueueFull as e:
      return _overloaded(e, openai)
    except (asyncio.CancelledError, HangUp):
      raise
    except Exception as e:  # pylint: disable=broad-except
      logging.exception("request failed")
      message = f"internal error: {type(e).__name__}: {e}"
      return _json(500, openai_api.ApiError(
          message, status=500, kind="server_error").payload()
                   if openai else {"error": message})

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
      return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      raise BadRequest(f"the body is not valid JSON: {e}") from None

  async def _off_loop(self, fn, *args):
    """A blocking call (scoring) on a worker thread."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

  async def _health(self, request, body):
    del request, body
    return _json(200, self.service.health())

  async def _models(self, request, body):
    del request, body
    return _json(200, self.api.models())

  async def _score(self, request, body):
    del request
    return _json(200, await self._off_loop(self.service.score, body))

  async def _generate(self, request, body):
    del request
    rows = self.service.rows(*self.service.check_generate(body))
    done = await self._finish(Rows(self.service, asyncio.get_running_loop(),
                                   rows))
    return _json(200, {"texts": [r.prompt + r.text for r in done],
                       "step": int(self.service.loaded.step)})

  async def _finish(self, rows: Rows) -> list[Row]:
    """Every row's text; a hang-up meanwhile cancels them all."""
    try:
      done = await rows.wait()
    except asyncio.CancelledError:
      rows.cancel()
      raise HangUp(f"the client hung up before its answer; "
                   f"{len(rows.rows)} row(s) cancelled after "
                   f"{rows.tokens} tokens") from None
    for row in done:
      if row.reason == "error":
        raise RuntimeError(f"generation failed: {row.completion.error}")
    return done

  async def _completions(self, request, body):
    req = self.api.check(body)
    rows = Rows(self.service, asyncio.get_running_loop(),
                [(p, t, req.options, 0) for p, t in zip(req.prompts, req.ids)],
                req.stops,
                stream=req.stream)
    if req.stream:
      return await self._stream(request, req, rows)
    done = await self._finish(rows)
    logprobs = None
    if req.logprobs:
      logprobs = [await self._off_loop(self.service.logprobs, r.prompt, r.text)
                  for r in done]
    return _json(200, self.api.response(req, done, logprobs))

  async def _stream(self, request, req, rows: Rows) -> web.StreamResponse:
    """Server-sent events as text comes, then `data: [DONE]`."""
    response = _EventStream(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    events = self.api.events(req)
    try:
      await response.prepare(request)
      if req.echo:
        await response.write(events.echo())
      async for updates in rows.updates():
        await response.write(events.chunk(updates))
      await response.write_eof(events.done())  # one write with the end
    except (asyncio.CancelledError, ConnectionError):
      rows.cancel()
      raise HangUp(f"the client hung up mid-stream; {len(rows.rows)} row(s) "
                   f"cancelled after {rows.tokens} tokens") from None
    return response


class _EventStream(web.StreamResponse):
  """A chunked stream whose headers leave with its first event: one write
  (one loopback wake-up) fewer per stream. Response, aiohttp's non-streamed
  reply, holds its headers the same way."""
  _send_headers_immediately = False


def _peer(request) -> str:
  peer = request.transport.get_extra_info("peername") if (
      request.transport is not None) else None
  return f"{peer[0]}:{peer[1]}" if peer else "?"


class Server:
  """The aiohttp app on a listening socket.

  Bound in the constructor (so a busy port fails early, and port 0's choice
  is known: `server_port`); `serve_forever()` runs the event loop in the
  calling thread until `shutdown()` from another one.
  """

  def __init__(self, service: Service, host: str = "127.0.0.1",
               port: int = 0, api_key: str = ""):
    self.service, self.app = service, App(service, api_key)
    self.socket = socket.create_server((host, port), backlog=1024)
    self.server_address = self.socket.getsockname()[:2]
    self.server_port = self.server_address[1]
    self._loop, self._stop = None, None
    self._started, self._stopped = threading.Event(), threading.Event()

  def serve_forever(self) -> None:
    try:
      asyncio.run(self._serve())
    finally:
      self._stopped.set()

  async def _serve(self) -> None:
    self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
    runner = web.AppRunner(self.app.application(), access_log=None,
                           handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    await web.SockSite(runner, self.socket).start()
    self._started.set()
    try:
      await self._stop.wait()
    finally:
      await runner.cleanup()

  def shutdown(self, timeout: float = 30.0) -> None:
    """Stops serve_forever (from another thread) and waits for it."""
    if self._started.wait(timeout) and not self._stopped.is_set():
      self._loop.call_soon_threadsafe(self._stop.set)
    self._stopped.wait(timeout)

  def server_close(self) -> None:
    self.socket.close()


def make_server(service: Service, host: str = "127.0.0.1", port: int = 0,
                api_key: str = "") -> Server:
  """Bound and listening; port 0 picks a free one (`server.server_port`)."""
  return Server(service, host, port, api_key)


def api_key(cfg) -> str:
  """serve.api_key, else $ZEBRA_JAX_API_KEY, else '' (no key asked)."""
  return str(cfg.serve.api_key) or os.environ.get(API_KEY_ENV, "")


def _loopback(host: str) -> bool:
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return host == "localhost"


def run(cfg, workdir: str, host: str = "127.0.0.1", port: int = 8000) -> None:
  """--mode=serve: serves until interrupted (Ctrl-C)."""
  loaded = loading.load_for_inference(cfg, workdir)
  key = api_key(cfg)
  service = Service(loaded, Limits.from_config(cfg))
  try:
    server = make_server(service, host, port, key)
  except OSError as e:
    service.close()
    raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): pick "
                    "another --port, or 0 for a free one") from None
  if not _loopback(host) and not key:
    print(f"| warning: serving on {host} without an API key: anyone who can "
          f"reach it can use it; set {API_KEY_ENV} or "
          "--config.serve.api_key", flush=True)
  engine = service.engine
  # What start-up built (the model, jax's and flax's objects) lives as long
  # as the server: out of the collector's sight, a full collection scans
  # only what requests left, where it stalled every thread for 130 ms under
  # 64 clients (the p99 latency).
  gc.freeze()
  print(f"| serving step {loaded.step} on http://{host}:{server.server_port} "
        f"| {engine.slots} slots, queue {engine.queue_limit} "
        f"| API key {'required' if key else 'off'} "
        "| POST /generate, POST /score, GET /health, POST /v1/completions, "
        "GET /v1/models", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    service.close()
