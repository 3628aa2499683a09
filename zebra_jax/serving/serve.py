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
  GET  /metrics   Prometheus' text format (zebra_jax.serving.metrics)
  POST /v1/completions, POST /v1/chat/completions, GET /v1/models: OpenAI's
                  API as vLLM serves a base model (openai_api)
  POST /tokenize, POST /detokenize, GET /tokenizer_info: vLLM's tokenizer
                  endpoints (lm-evaluation-harness's remote tokenizer)

Every generated row is one row of the engine's running batch (engine/):
a request's rows are admitted together or not at all. Four modules share
the work: service.py is the model behind the endpoints (usable without
HTTP), app.py the aiohttp routes over it (auth, errors, streams, CORS,
metrics, the access log), openai_api.py and openai_answers.py OpenAI's
requests and answers; this one is the process: the listening socket,
signals, the drain and the exit status.

Bound to 127.0.0.1 unless --host says otherwise. With an API key
(serve.api_key, serve.api_key_file or $ZEBRA_JAX_API_KEY) every route but
/health, /metrics and /version needs `Authorization: Bearer KEY`, compared
in constant time, else 401. Request bodies are strict JSON (NaN and Infinity are a 400).
A full queue gets 503 with Retry-After. A failed engine step fails only the
requests in it (500, saying so); an engine that cannot recover turns
/health to 503 and the process exits 1, for a supervisor to restart it.
SIGTERM or SIGINT drain: new requests get 503, those in flight finish
within serve.drain_seconds, then the process exits 0. One access-log line
per request (serve.access_log).
"""

import asyncio
import gc
import ipaddress
import logging as py_logging
import os
import signal
import socket
import sys
import threading
import time

from aiohttp import web

from zebra_jax.errors import UserError, read_user_file
from zebra_jax.inference import loading
from zebra_jax.serving import openai_api
from zebra_jax.serving.app import App, access_log
from zebra_jax.serving.service import BadRequest, Limits, Service

__all__ = ["API_KEY_ENV", "App", "BadRequest", "Limits", "Server", "Service",
           "api_key", "make_server", "run"]

API_KEY_ENV = "ZEBRA_JAX_API_KEY"


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
      try:
        self._loop.call_soon_threadsafe(
            self._loop.call_later, self.fatal_grace_seconds, self._stop.set)
      except RuntimeError:  # the loop has closed: the server is gone
        pass

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
    key = read_user_file(path, "serve.api_key_file",
                         "point it at a file holding the key").strip()
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
  # only what requests left, where it stalled every thread under many
  # clients (it was the p99 latency).
  gc.freeze()
  print(f"| serving step {loaded.step} on http://{host}:{server.server_port} "
        f"| {engine.slots} slots, queue {engine.queue_limit} "
        f"| API key {'required' if key else 'off'} "
        "| POST /v1/completions, /v1/chat/completions, /generate, /score, "
        "/tokenize, /detokenize; GET /v1/models, /health, /metrics, "
        "/tokenizer_info, /version", flush=True)
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
