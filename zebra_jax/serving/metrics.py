"""--mode=serve's Prometheus metrics (GET /metrics), through prometheus_client.

Each server has its own registry, so several in one process (tests, an
embedding application) do not share counts. Engine figures that are a
reading, not an event (queue depth, busy slots, restarts, the prefix
cache's counts), are read from the engine when Prometheus scrapes, so they
cost nothing between scrapes.

The per-request histograms carry vLLM's meanings (and bucket bounds) under
zebra_* names, so dashboards built for vLLM's vllm:* series read them with
the prefix changed; a request is one HTTP request that generates.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Served routes; anything else counts as "other" (a scanner's thousand paths
# must not become a thousand series).
ENDPOINTS = ("/health", "/metrics", "/version", "/generate", "/score",
             "/tokenize", "/detokenize", "/tokenizer_info", "/v1/models",
             "/v1/completions", "/v1/chat/completions")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                   30, 60, 120)
STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 1)
# vLLM's bounds for the same histograms.
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                       0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640,
                       2560)
PER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60,
               120, 240, 480, 960, 1920, 7680)


def buckets_1_2_5(largest: int) -> tuple:
  """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's token-count bounds)."""
  out, scale = [], 1
  while True:
    for m in (1, 2, 5):
      if m * scale > largest:
        return tuple(out)
      out.append(m * scale)
    scale *= 10


def endpoint(path: str) -> str:
  if path.startswith("/v1/models/"):
    return "/v1/models"
  return path if path in ENDPOINTS else "other"


class _EngineReadings:
  """A collector that reads the engine's stats at scrape time."""

  def __init__(self, stats):
    self._stats = stats

  def collect(self):
    s = self._stats()
    for name, text, value in (
        ("zebra_queue_depth", "requests waiting for a slot",
         s["queued_requests"]),
        ("zebra_slots_busy", "rows generating now", s["busy"]),
        ("zebra_slots", "rows the engine generates at once", s["slots"]),
        ("zebra_engine_healthy", "1 while the engine serves",
         int(s["healthy"]))):
      yield GaugeMetricFamily(name, text, value=value)
    yield CounterMetricFamily(
        "zebra_engine_restarts", "engine steps that failed and were "
        "recovered from", value=s["restarts"])
    # vLLM's scheduler gauges; a request here is a row (n=2 is two).
    yield GaugeMetricFamily("zebra_num_requests_running", "rows in the "
                            "running batch", value=s["busy"])
    yield GaugeMetricFamily("zebra_num_requests_waiting", "rows waiting "
                            "for a slot", value=s["queued"])
    # An engine without a prefix cache reads as an empty one.
    yield CounterMetricFamily(
        "zebra_prefix_cache_queries", "prompt tokens looked up in the "
        "prefix cache", value=s.get("prefix_cache_queries", 0))
    yield CounterMetricFamily(
        "zebra_prefix_cache_hits", "prompt tokens the prefix cache held",
        value=s.get("prefix_cache_hits", 0))
    yield GaugeMetricFamily("zebra_prefix_cache_bytes", "memory the prefix "
                            "cache holds", value=s.get("prefix_cache_bytes",
                                                       0))
    yield GaugeMetricFamily("zebra_prefix_cache_entries", "states the "
                            "prefix cache holds",
                            value=s.get("prefix_cache_entries", 0))


class Metrics:
  """The server's counters and histograms."""

  def __init__(self, engine_stats, max_prompt_tokens: int = 4096,
               max_new_tokens: int = 1024):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("zebra_requests", "HTTP requests by endpoint "
                            "and status", ["endpoint", "status"], registry=r)
    self.latency = Histogram("zebra_request_seconds", "time to the whole "
                             "answer", ["endpoint"], registry=r,
                             buckets=LATENCY_BUCKETS)
    histogram = lambda name, text, buckets: Histogram(
        name, text, registry=r, buckets=buckets)
    self.first_token = histogram(
        "zebra_time_to_first_token_seconds", "time from a generating "
        "request's arrival to its first generated token", FIRST_TOKEN_BUCKETS)
    self.per_token = histogram(
        "zebra_time_per_output_token_seconds", "a request's time between "
        "tokens: (e2e - first token) / (its longest row's tokens - 1)",
        PER_TOKEN_BUCKETS)
    self.e2e = histogram(
        "zebra_e2e_request_latency_seconds", "time from a generating "
        "request's arrival to its last token delivered", E2E_BUCKETS)
    self.request_prompt_tokens = histogram(
        "zebra_request_prompt_tokens", "prompt tokens per request (its "
        "usage's)", buckets_1_2_5(max_prompt_tokens))
    self.request_generation_tokens = histogram(
        "zebra_request_generation_tokens", "generated tokens per request "
        "(its usage's)", buckets_1_2_5(max_new_tokens))
    self.prompt_tokens = Counter("zebra_prompt_tokens", "prompt tokens "
                                 "consumed", registry=r)
    self.generated_tokens = Counter("zebra_generation_tokens", "generated "
                                    "tokens returned", registry=r)
    self.step = Histogram("zebra_engine_step_seconds", "one engine step "
                          "(prefill and decode calls)", registry=r,
                          buckets=STEP_BUCKETS)
    r.register(_EngineReadings(engine_stats))

  def request(self, path: str, status: int, seconds: float) -> None:
    name = endpoint(path)
    self.requests.labels(name, str(status)).inc()
    self.latency.labels(name).observe(seconds)

  def generation(self, prompt_tokens: int, generated: int) -> None:
    """Tokens a request consumed and returned, answered or not."""
    self.prompt_tokens.inc(prompt_tokens)
    self.generated_tokens.inc(generated)

  def served(self, e2e: float, first_token: float | None,
             prompt_tokens: int, generated: int, longest_row: int) -> None:
    """One request answered in full: seconds from its arrival to its last
    and (None: it generated none) first token, its usage, and the tokens
    of its longest row (rows decode side by side)."""
    self.e2e.observe(e2e)
    self.request_prompt_tokens.observe(prompt_tokens)
    self.request_generation_tokens.observe(generated)
    if first_token is None:
      return
    self.first_token.observe(first_token)
    if longest_row > 1:
      self.per_token.observe((e2e - first_token) / (longest_row - 1))

  def exposition(self) -> tuple[bytes, str]:
    """(the text format's bytes, its content type)."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST
