"""--mode=serve: a small JSON-over-HTTP server for users without Triton.

  POST /generate  {"prompt": "The "} or {"prompts": [...]}, plus any of
                  max_new_tokens, temperature, top_k, top_p,
                  repetition_penalty, stop, num_samples, seed
                  -> {"texts": [...], "step": N}
  POST /score     {"text": "..."} or {"texts": [...]}, "verbose": bool
                  -> {"results": [{"tokens", "loss", "ppl"[, "bpc"]
                                   [, "token_logprobs"]}], "step": N}
  GET  /health    -> {"status": "ok", "step": N, "tokenizer": ..., ...}
  POST /v1/completions, GET /v1/models: OpenAI's completions API
                  (zebra_jax.inference.openai_api), errors in its shape

Standard library only (`http.server.ThreadingHTTPServer`), bound to
127.0.0.1 by default. Every bad request (not JSON, unknown field, wrong type,
too many tokens, body too large) gets a 4xx with {"error": message} and the
server keeps serving. Model calls are serialized by a lock: one request
computes at a time, others wait; compiled code is reused across requests
(one compile per distinct prompt length and sampling setting).
"""

import dataclasses
import http.server
import json
import threading

from absl import logging

from zebra_jax.errors import UserError
from zebra_jax.inference import loading, openai_api, sample, score


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
    """cfg.serve's values (configs/base.py defines every field)."""
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


class Service:
  """The model behind the endpoints; usable without HTTP (tests, embedding)."""

  def __init__(self, loaded: loading.Loaded, limits: Limits = Limits()):
    self.loaded, self.limits = loaded, limits
    self.generator = sample.Generator(loaded)
    self.scorer = score.Scorer(loaded, loaded.cfg.eval.seq_len)
    self.defaults = sample.Options.from_config(loaded.cfg.sample)
    self._lock = threading.Lock()
    self.lock = self._lock  # one model call at a time, every route

  def health(self) -> dict:
    m = self.loaded.cfg.model
    return {"status": "ok", "step": int(self.loaded.step),
            "tokenizer": self.loaded.tokenizer.kind,
            "vocab_size": m.vocab_size, "num_layers": m.num_layers,
            "hidden_size": m.hidden_size, "num_stripes": m.num_stripes,
            "head": m.head, "limits": dataclasses.asdict(self.limits)}

  def generate(self, body) -> dict:
    body = _check_fields(body, _GENERATE_FIELDS)
    prompts = _texts(body, "prompt", "prompts")
    settings = {k: v for k, v in body.items() if k not in ("prompt", "prompts")}
    options = dataclasses.replace(self.defaults, **settings)
    lim = self.limits
    if options.max_new_tokens > lim.max_new_tokens:
      raise BadRequest(f"max_new_tokens={options.max_new_tokens} is too many "
                       f"tokens: at most {lim.max_new_tokens}", 413)
    if len(prompts) * options.num_samples > lim.max_rows:
      raise BadRequest(f"{len(prompts)} prompts x num_samples="
                       f"{options.num_samples} is more than {lim.max_rows} "
                       "rows", 413)
    with self._lock:
      for p in prompts:
        n = len(self.generator.encode(p))
        if n > lim.max_prompt_tokens:
          raise BadRequest(f"a prompt of {n} tokens is too many tokens: at "
                           f"most {lim.max_prompt_tokens}", 413)
      texts = self.generator.generate(prompts, options)
    return {"texts": texts, "step": int(self.loaded.step)}

  def score(self, body) -> dict:
    body = _check_fields(body, _SCORE_FIELDS)
    texts = _texts(body, "text", "texts")
    results = []
    with self._lock:
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


def make_handler(service: Service):
  """A request handler class bound to `service`."""

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every reply sets its length
    api = openai_api.Api(service)
    routes = {("GET", "/health"): lambda body: service.health(),
              ("POST", "/generate"): service.generate,
              ("POST", "/score"): service.score,
              ("GET", "/v1/models"): api.models,
              ("POST", "/v1/completions"): api.completions}

    def do_GET(self):  # noqa: N802 (http.server's naming)
      self._dispatch("GET")

    def do_POST(self):  # noqa: N802
      self._dispatch("POST")

    def _dispatch(self, method: str):
      path = self.path.split("?", 1)[0]
      openai = path.startswith("/v1/")
      try:
        body = self._read_body() if method == "POST" else None
        route = self.routes.get((method, path))
        if method == "GET" and path.startswith("/v1/models/"):
          route = lambda body: self.api.model(path[len("/v1/models/"):])
        if route is None:
          known = any(p == path for _, p in self.routes)
          raise BadRequest(f"{method} {path} is not served: use GET /health, "
                           "POST /generate, POST /score, GET /v1/models or "
                           "POST /v1/completions", 405 if known else 404)
        answer = route(body)
        if callable(answer):  # a stream: answer(write) sends its events
          self._stream(answer)
        else:
          self._reply(200, answer)
      except openai_api.ApiError as e:
        self._reply(e.status, e.payload())
      except (BadRequest, UserError) as e:  # UserError: e.g. unseen characters
        status = getattr(e, "status", 400)
        self._reply(status, openai_api.ApiError(str(e), status=status)
                    .payload() if openai else {"error": str(e)})
      except Exception as e:  # pylint: disable=broad-except
        logging.exception("request failed")
        message = f"internal error: {type(e).__name__}: {e}"
        self._reply(500, openai_api.ApiError(
            message, status=500, kind="server_error").payload()
                    if openai else {"error": message})

    def _stream(self, answer):
      """Server-sent events until the stream ends, then the connection
      closes (no Content-Length)."""
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.send_header("Connection", "close")
      self.end_headers()
      self.close_connection = True

      def write(data: bytes):
        self.wfile.write(data)
        self.wfile.flush()

      answer(write)

    def _read_body(self):
      length = self.headers.get("Content-Length")
      if length is None or not length.isdigit():
        raise BadRequest("a POST needs a Content-Length header", 411)
      if int(length) > service.limits.max_body_bytes:
        self.close_connection = True  # the unread body must not be parsed
        raise BadRequest(f"the body of {length} bytes is too large: at most "
                         f"{service.limits.max_body_bytes}", 413)
      raw = self.rfile.read(int(length))
      try:
        return json.loads(raw.decode("utf-8"))
      except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None

    def _reply(self, status: int, payload: dict):
      data = json.dumps(payload).encode("utf-8")
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, format, *args):  # pylint: disable=redefined-builtin
      logging.info("%s %s", self.address_string(), format % args)

  return Handler


def make_server(service: Service, host: str = "127.0.0.1",
                port: int = 0) -> http.server.ThreadingHTTPServer:
  """Bound and listening; port 0 picks a free one (`server.server_port`)."""
  server = http.server.ThreadingHTTPServer((host, port), make_handler(service))
  server.daemon_threads = True  # a stuck client must not block shutdown
  return server


def run(cfg, workdir: str, host: str = "127.0.0.1", port: int = 8000) -> None:
  """--mode=serve: serves until interrupted (Ctrl-C)."""
  loaded = loading.load_for_inference(cfg, workdir)
  service = Service(loaded, Limits.from_config(cfg))
  try:
    server = make_server(service, host, port)
  except OSError as e:
    raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): pick "
                    "another --port, or 0 for a free one") from None
  print(f"| serving step {loaded.step} on http://{host}:{server.server_port} "
        "| POST /generate, POST /score, GET /health, POST /v1/completions, "
        "GET /v1/models", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
