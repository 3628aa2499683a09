"""--mode=serve's Prometheus metrics (GET /metrics), through prometheus_client.

Each server has its own registry, so several in one process (tests, an
embedding application) do not share counts. Engine figures that are a
reading, not an event (queue depth, busy slots, restarts), are read from
the engine when Prometheus scrapes, so they cost nothing between scrapes.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Served routes; anything else counts as "other" (a scanner's thousand paths
# must not become a thousand series).
ENDPOINTS = ("/health", "/metrics", "/generate", "/score", "/tokenize",
             "/detokenize", "/tokenizer_info", "/v1/models",
             "/v1/completions", "/v1/chat/completions")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                   30, 60, 120)
STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 1)


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


class Metrics:
  """The server's counters and histograms."""

  def __init__(self, engine_stats):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("zebra_requests", "HTTP requests by endpoint "
                            "and status", ["endpoint", "status"], registry=r)
    self.latency = Histogram("zebra_request_seconds", "time to the whole "
                             "answer", ["endpoint"], registry=r,
                             buckets=LATENCY_BUCKETS)
    self.first_token = Histogram(
        "zebra_time_to_first_token_seconds", "time from a generation "
        "request's arrival to its first generated token", registry=r,
        buckets=LATENCY_BUCKETS)
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

  def generation(self, prompt_tokens: int, generated: int,
                 first_token_seconds: float | None) -> None:
    self.prompt_tokens.inc(prompt_tokens)
    self.generated_tokens.inc(generated)
    if first_token_seconds is not None:
      self.first_token.observe(first_token_seconds)

  def exposition(self) -> tuple[bytes, str]:
    """(the text format's bytes, its content type)."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST
