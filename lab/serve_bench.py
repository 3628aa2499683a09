"""The HTTP server under concurrent OpenAI clients: throughput, latency, memory.

  python -m lab.serve_bench --workdir=runs/tiny \
      [--clients=1,16,64] [--seconds=15] [--soak_seconds=600] \
      [--soak_shared_prefix=1000] \
      [--client=aiohttp|openai] [--server_cpus=0 --client_cpus=1] \
      [--url=http://127.0.0.1:8000] [--config.serve.slots=64 ...]

Starts `--mode=serve` on the workdir (or talks to --url), then drives its
OpenAI completions API as users would: prompts of 5-60 characters cut from
text the model itself wrote, temperatures from greedy to 1.4, a seed each,
half of the requests streamed, `--max_tokens` each, no retries. The clients
(`--client`) are the real `openai` client, one thread and connection pool
each, or `aiohttp`: one asyncio task and kept-alive connection each, which
reads the same JSON and server-sent events for about half the CPU, so that
on a machine the clients share with the server more of it is left to the
server (load generators such as vLLM's benchmark_serving use aiohttp for
the same reason). Either way the clients are spread over --client_procs
processes. --server_cpus and --client_cpus give each side its own cores, so
that the figures measure the server rather than the cores its clients take. Per number of concurrent clients: generated tokens/s over the phase,
p50/p99 request latency, p50 time to the first streamed text, errors. Also:
the first request at a never-seen prompt length and temperature against the
same request repeated, the engine's compiled-program count (GET /health)
before and after, and the server's RSS at start, after the phases and over
an optional soak of varied traffic. Prints a table; writes JSON (--json,
default WORKDIR/serve_bench.json). --scenario=prefix instead measures the
prefix state cache, on against off (see prefix_scenario).
"""

import concurrent.futures
import json
import logging
import multiprocessing
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from absl import flags

from zebra_jax.cli import entry
from zebra_jax.errors import UserError

MODEL = "zebra_lstm"
TEMPERATURES = (0.0, 0.0, 0.3, 0.7, 1.0, 1.4)  # a third greedy


def _call(url: str, path: str, key: str = "", body=None) -> dict:
  """GET (or POST `body`) as JSON; an HTTP error is one UserError line."""
  headers = {"Content-Type": "application/json"}
  if key:
    headers["Authorization"] = f"Bearer {key}"
  data = None if body is None else json.dumps(body).encode()
  request = urllib.request.Request(url + path, data, headers)
  try:
    with urllib.request.urlopen(request, timeout=300) as response:
      return json.loads(response.read())
  except urllib.error.HTTPError as e:
    raise UserError(f"{path} answered HTTP {e.code}: "
                    f"{e.read()[:300].decode(errors='replace')}") from None
  except urllib.error.URLError as e:
    raise UserError(f"cannot reach {url}: {e.reason}") from None


def _get(url: str, path: str, key: str = "") -> dict:
  return _call(url, path, key)


def cpu_set(spec: str | None) -> set[int] | None:
  """'0' or '0,2-3' -> {0} or {0, 2, 3}; None or '' -> None (no pinning)."""
  if not spec:
    return None
  cpus = set()
  for part in spec.split(","):
    first, _, last = part.partition("-")
    cpus.update(range(int(first), int(last or first) + 1))
  allowed = os.sched_getaffinity(0)
  if not cpus <= allowed:
    raise UserError(f"CPUs {sorted(cpus - allowed)} are not among this "
                    f"process's {sorted(allowed)}: pick others")
  return cpus


def _pin(cpus: set[int] | None):
  """A function that pins the calling process to `cpus` (None: no-op)."""
  return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


class Server:
  """`--mode=serve` on a free port, as a child process (on `cpus` if given:
  XLA then sizes its thread pool to them)."""

  def __init__(self, workdir: str, overrides: list[str], timeout: float = 300,
               cpus: set[int] | None = None):
    self.log = tempfile.NamedTemporaryFile(
        "w+", prefix="serve_bench_", suffix=".log", delete=False)
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "zebra_jax.main", f"--workdir={workdir}",
         "--mode=serve", "--port=0", *overrides],
        stdout=subprocess.PIPE, stderr=self.log, text=True,
        preexec_fn=_pin(cpus))
    deadline = time.monotonic() + timeout
    for line in self.proc.stdout:
      found = re.search(r"on (http://[\w.:\[\]]+:\d+) ", line)
      if found:
        self.url = found.group(1)
        return
      if time.monotonic() > deadline:
        break
    self.close()
    raise UserError(f"the server did not start: see {self.log.name}")

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


def source_text(url: str, key: str, seed_prompt: str, chars: int) -> str:
  """Text the model writes from `seed_prompt`: prompts cut from it use only
  what the tokenizer knows (a drawn unknown token, which decodes as U+FFFD,
  is dropped: no prompt may contain it)."""
  text = seed_prompt
  while len(text) < chars:
    tail = text[-200:]
    out = _call(url, "/generate", key, {
        "prompt": tail, "temperature": 1.0, "max_new_tokens": 500,
        "seed": len(text)})["texts"][0]
    text += out[len(tail):].replace("\ufffd", "")
  return text


def seed_prompt_of(workdir: str) -> str:
  """A few letters the workdir's tokenizer knows, e.g. 'the '."""
  from zebra_jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.load(os.path.join(workdir, "tokenizer"))
  for candidate in ("The ", "the ", "A ", "a "):
    try:
      if len(tok.encode_prompt(candidate)):
        return candidate
    except UserError:
      continue
  texts = [tok.token_text(i) for i in range(tok.vocab_size)]
  letters = [t for t in texts if t.isalpha()]
  if not letters:
    raise UserError("found no letters in the workdir's tokenizer: pass "
                    "--seed_prompt")
  return "".join(letters[:3]) + (" " if " " in texts else "")


def request_mix(text: str, client: int, k: int, max_tokens: int,
                tag: str = "") -> dict:
  """Request k of a client: deterministic, varied, half streamed. With a
  `tag`, the prompt starts with the tag, the client and k: no two requests
  share a prefix (a phase meant to miss the prefix state cache)."""
  rng = random.Random(client * 1_000_003 + k)
  length = rng.randint(5, 60)
  at = rng.randrange(0, max(1, len(text) - length))
  unique = f"{tag}{client}.{k} " if tag else ""
  return {"prompt": unique + text[at:at + length], "max_tokens": max_tokens,
          "temperature": rng.choice(TEMPERATURES),
          "seed": rng.randrange(1 << 31), "stream": (client + k) % 2 == 1}


def complete(client, req: dict) -> tuple[int, float | None]:
  """(completion tokens, seconds to the first text or None) of a request."""
  start = time.perf_counter()
  if not req["stream"]:
    out = client.completions.create(model=MODEL, **req)
    return out.usage.completion_tokens, None
  first, reason, text = None, None, ""
  for chunk in client.completions.create(model=MODEL, **req):
    choice = chunk.choices[0]
    if choice.text and first is None:
      first = time.perf_counter() - start
    text += choice.text
    reason = choice.finish_reason or reason
  # No stop strings are sent: a stream ends by length, max_tokens tokens.
  if reason != "length":
    raise RuntimeError(f"stream ended by {reason!r}")
  return req["max_tokens"], first


def _clients(args) -> list[dict]:
  """One process's share of a phase: threads, one openai client each."""
  import threading  # pylint: disable=g-import-not-at-top
  import openai  # pylint: disable=g-import-not-at-top
  _quiet()
  url, key, text, ids, start_at, stop_at, max_tokens, tag = args
  records, lock = [], threading.Lock()

  def run(client_id):
    client = openai.OpenAI(base_url=url + "/v1", api_key=key or "unused",
                           max_retries=0, timeout=300)
    time.sleep(max(0.0, start_at - time.time()))
    k = 0
    while time.time() < stop_at:
      req = request_mix(text, client_id, k, max_tokens, tag)
      t0 = time.time()
      try:
        tokens, first = complete(client, req)
        error = None
      except Exception as e:  # pylint: disable=broad-except
        tokens, first, error = 0, None, f"{type(e).__name__}: {e}"[:200]
      with lock:
        records.append({"start": t0, "end": time.time(), "tokens": tokens,
                        "first": first, "error": error,
                        "stream": req["stream"]})
      k += 1
    client.close()

  threads = [threading.Thread(target=run, args=(i,)) for i in ids]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return records


def _aiohttp_clients(args) -> list[dict]:
  """One process's share of a phase: asyncio tasks on one event loop, each
  a client with its own kept-alive connection, reading what the openai
  client reads (usage; the stream's text and finish_reason)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import aiohttp  # pylint: disable=g-import-not-at-top
  url, key, text, ids, start_at, stop_at, max_tokens, tag = args
  headers = {"Authorization": f"Bearer {key}"} if key else {}

  async def complete_one(session, req):
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", headers=headers,
                            json=dict(req, model=MODEL)) as response:
      if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: "
                           f"{(await response.text())[:150]}")
      if not req["stream"]:
        return (await response.json())["usage"]["completion_tokens"], None
      first, reason = None, None
      async for line in response.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
          continue
        choice = json.loads(line[6:])["choices"][0]
        if choice["text"] and first is None:
          first = time.perf_counter() - start
        reason = choice["finish_reason"] or reason
    if reason != "length":
      raise RuntimeError(f"stream ended by {reason!r}")
    return req["max_tokens"], first

  async def run(client_id, records):
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1),
        timeout=aiohttp.ClientTimeout(total=300)) as session:
      await asyncio.sleep(max(0.0, start_at - time.time()))
      k = 0
      while time.time() < stop_at:
        req = request_mix(text, client_id, k, max_tokens, tag)
        t0 = time.time()
        try:
          tokens, first = await complete_one(session, req)
          error = None
        except Exception as e:  # pylint: disable=broad-except
          tokens, first, error = 0, None, f"{type(e).__name__}: {e}"[:200]
        records.append({"start": t0, "end": time.time(), "tokens": tokens,
                        "first": first, "error": error,
                        "stream": req["stream"]})
        k += 1

  async def main():
    records = []
    await asyncio.gather(*(run(i, records) for i in ids))
    return records

  return asyncio.run(main())


CLIENTS = {"openai": _clients, "aiohttp": _aiohttp_clients}


def _quiet() -> None:
  """No log line per client request (the HTTP libraries log at INFO)."""
  for name in ("httpx", "httpx2", "openai", "httpcore"):
    logging.getLogger(name).setLevel(logging.WARNING)


def cpu_seconds(pid: int | None) -> float | None:
  """User + system CPU time of a process so far (Linux /proc)."""
  if pid is None:
    return None
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return None


def _percentile(values, q):
  if not values:
    return None
  values = sorted(values)
  return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def phase(url, key, text, clients, seconds, max_tokens, procs,
          pid=None, client="openai", cpus=None, tag: str = "") -> dict:
  """`clients` concurrent clients for `seconds`: the phase's figures
  (`tag`: see request_mix)."""
  cpu = cpu_seconds(pid)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  procs = max(1, min(procs, clients))
  start_at = time.time() + 2.0  # every process ready before the first call
  shares = [list(range(p, clients, procs)) for p in range(procs)]
  ctx = multiprocessing.get_context("fork")
  with concurrent.futures.ProcessPoolExecutor(
      procs, mp_context=ctx, initializer=_pin(cpus)) as pool:
    parts = pool.map(CLIENTS[client], [(url, key, text, ids, start_at,
                                 start_at + seconds, max_tokens, tag)
                                for ids in shares])
    records = [r for part in parts for r in part]
  if cpu is not None:
    cpu = cpu_seconds(pid) - cpu
  after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the pool has ended
  clients_cpu = (after.ru_utime + after.ru_stime
                 - children.ru_utime - children.ru_stime)
  ok = [r for r in records if r["error"] is None]
  wall = (max(r["end"] for r in records) - min(r["start"] for r in records)
          if records else 0.0)
  tokens = sum(r["tokens"] for r in ok)
  latency = [1e3 * (r["end"] - r["start"]) for r in ok]
  first = [1e3 * r["first"] for r in ok if r["first"] is not None]
  errors = sorted({r["error"] for r in records if r["error"]})
  return {"clients": clients, "requests": len(records),
          "errors": len(records) - len(ok), "error_kinds": errors[:5],
          "seconds": round(wall, 2),
          "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
          "p50_ms": _round(_percentile(latency, 50)),
          "p99_ms": _round(_percentile(latency, 99)),
          "first_text_p50_ms": _round(_percentile(first, 50)),
          # of one core, over the phase and its 2 s start (None: --url)
          "server_cpu_pct": (round(100 * cpu / (wall + 2.0))
                             if cpu is not None and wall else None),
          # the server's CPU (all its threads) per answered request
          "server_us_per_request": (round(1e6 * cpu / len(ok))
                                    if cpu is not None and ok else None),
          "clients_cpu_pct": round(100 * clients_cpu / (wall + 2.0))
                             if wall else None}


def _round(x):
  return None if x is None else round(x, 1)


def novelty(url, key, text, max_tokens, count=8) -> dict:
  """The first request at a never-seen prompt length and temperature, then
  the same request again: median latency of each, one client, greedy-free."""
  import openai  # pylint: disable=g-import-not-at-top
  _quiet()
  client = openai.OpenAI(base_url=url + "/v1", api_key=key or "unused",
                         max_retries=0, timeout=300)
  # Lengths and temperatures the traffic phases never use.
  lengths = [61 + 3 * i for i in range(count)]
  first, repeat = [], []
  for i, length in enumerate(lengths):
    req = {"prompt": text[7 * i:7 * i + length], "max_tokens": max_tokens,
           "temperature": 0.05 + 0.11 * i, "seed": i, "stream": False}
    for times in (first, repeat):
      t0 = time.perf_counter()
      complete(client, req)
      times.append(1e3 * (time.perf_counter() - t0))
  client.close()
  f, r = _percentile(first, 50), _percentile(repeat, 50)
  return {"requests": count, "first_p50_ms": _round(f),
          "repeat_p50_ms": _round(r), "ratio": round(f / r, 2)}


def table(phases: list[dict]) -> str:
  head = ("| clients | requests | errors | tokens/s | vs 1 client | p50 ms "
          "| p99 ms | first text p50 ms | server CPU | server CPU per request "
          "| clients CPU |")
  rows = [head, "|" + "---|" * 11]
  base = phases[0]["tokens_per_s"] if phases else 0
  for p in phases:
    rows.append(f"| {p['clients']} | {p['requests']} | {p['errors']} | "
                f"{p['tokens_per_s']:,.0f} | "
                f"{p['tokens_per_s'] / base if base else 0:.1f}x | "
                f"{p['p50_ms']} | {p['p99_ms']} | {p['first_text_p50_ms']} | "
                f"{p['server_cpu_pct']}% | {p['server_us_per_request']} us | "
                f"{p['clients_cpu_pct']}% |")
  return "\n".join(rows)


def soak(url, key, text, clients, seconds, max_tokens, procs, pid,
         client="openai", cpus=None, every=30.0, shared_prefix="") -> dict:
  """Varied traffic for `seconds`, the server's RSS sampled between bursts.

  With a `shared_prefix`, bursts alternate between prompts that all start
  with it (after the first burst, the prefix state cache holds it) and cold
  prompts that share nothing, so the cache's entries both hit and churn."""
  samples, phases, t_end = [], [], time.monotonic() + seconds
  kinds = []
  while time.monotonic() < t_end:
    burst = min(every, t_end - time.monotonic())
    if burst < 1:
      break
    cached = bool(shared_prefix) and len(phases) % 2 == 0
    tag = shared_prefix if cached else (f"c{len(phases)}." if shared_prefix
                                        else "")
    phases.append(phase(url, key, text, clients, burst, max_tokens, procs,
                        pid, client, cpus, tag=tag))
    kinds.append("cached" if cached else "cold")
    samples.append(_get(url, "/health", key)["rss_bytes"])
  first, last = samples[0], samples[-1]
  engine = _get(url, "/health", key).get("engine", {})
  return {"clients": clients, "seconds": seconds,
          "requests": sum(p["requests"] for p in phases),
          "errors": sum(p["errors"] for p in phases),
          "bursts": kinds,
          "tokens_per_s": [round(p["tokens_per_s"]) for p in phases],
          "prefix_cache": {k: engine.get(k) for k in (
              "prefix_cache_queries", "prefix_cache_hits",
              "prefix_cache_bytes", "prefix_cache_entries")},
          "rss_mb": [round(s / 2**20, 1) for s in samples],
          "growth_pct": round(100 * (last - first) / first, 2)}


# --- --scenario=prefix: the prefix state cache on against off ---
#
# One server with the cache and one without (serve.prefix_cache_bytes=0),
# both up at once, in the same run:
#
# lm-eval  lm-evaluation-harness's `local-completions` on the multiple-choice
#          task of docs/examples/lm_eval (4 choices after one passage of 360
#          characters), 0-shot and 2-shot (the same 2 examples before every
#          passage): wall time, accuracy, every choice's log-likelihood
#          (after one untimed document: lm-eval's first run's set-up).
# chat     10 turns of a streamed chat behind a 2,000-character system
#          prompt, and the same turns behind a 20-character one, 3 times
#          each, alternated: the median time to the first text of turns
#          2-10.
# cold     the last --clients clients of the request mix above (prompts
#          cut at random from model text, each after its own number: no
#          two share a prefix), 4 phases on each server, alternated:
#          tokens/s.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "docs", "examples", "lm_eval")
TASK = "zebra_choice"
SHOTS = (0, 2)
CHATS = 3  # each chat's turns 2-10, the medians over all of them
COLD_ROUNDS = 4  # cold phases per server, alternated between them


def _passages() -> list[str]:
  with open(os.path.join(EXAMPLES, "choices.jsonl"), encoding="utf-8") as f:
    return [json.loads(line)["context"] for line in f]


_TASKS = []  # lm-eval's task index, read once (it takes seconds)


def lm_eval_run(url: str, shots: int, limit: int | None = None) -> dict:
  """The multiple-choice task through local-completions, as its users run
  it (the server's own tokenizer through /tokenize): its wall time once
  lm-eval has read its task index; `limit`: its first documents only."""
  import lm_eval  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  if not _TASKS:
    _TASKS.append(TaskManager(include_path=EXAMPLES))
  here = os.getcwd()
  os.chdir(ROOT)  # the task's data path is relative to it
  try:
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"model={MODEL},base_url={url}/v1/completions,"
                    "tokenizer_backend=remote,tokenized_requests=True,"
                    "max_length=4096"),
        tasks=[TASK], num_fewshot=shots, task_manager=_TASKS[0],
        log_samples=True, limit=limit)
    seconds = time.perf_counter() - start
  finally:
    os.chdir(here)
  samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
  return {"seconds": round(seconds, 2),
          "acc": out["results"][TASK]["acc,none"],
          "loglikelihoods": [r[0][0] for s in samples for r in s["resps"]]}


def chat_first_text(url: str, key: str, system: str, turns: int = 10,
                    max_tokens: int = 16) -> list[float]:
  """Seconds to the first streamed text of each turn after the first."""
  import openai  # pylint: disable=g-import-not-at-top
  client = openai.OpenAI(base_url=url + "/v1", api_key=key or "unused")
  users = [p[:40] for p in _passages()[-turns:]]
  messages, waits = [{"role": "system", "content": system}], []
  for user in users:
    messages.append({"role": "user", "content": user})
    start, first, reply = time.perf_counter(), None, ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens,
        temperature=0.0, stream=True):
      delta = chunk.choices[0].delta.content if chunk.choices else None
      if delta:
        first = first or time.perf_counter()
        reply += delta
    waits.append((first or time.perf_counter()) - start)
    messages.append({"role": "assistant", "content": reply})
  return waits[1:]


def _median_ms(seconds: list[float]) -> float:
  return round(1e3 * statistics.median(seconds), 1)


def prefix_measure(url: str, key: str) -> dict:
  """lm-eval and the chats against one server."""
  text = " ".join(_passages())
  long_system, short_system = text[:2000], text[:20]
  figures = {f"lm_eval_{shots}_shot": lm_eval_run(url, shots)
             for shots in SHOTS}
  waits = {"system_2000": [], "system_20": []}
  for _ in range(CHATS):  # alternated, so a burst of load hits both
    waits["system_2000"] += chat_first_text(url, key, long_system)
    waits["system_20"] += chat_first_text(url, key, short_system)
  figures["chat_ms"] = {k: _median_ms(v) for k, v in waits.items()}
  return figures


def prefix_scenario(f, overrides: list[str], server_cpus, client_cpus) -> dict:
  """Both servers' figures, the ratios, the machine's load; prints them.
  Both servers run at once (an idle one waits for work, using no CPU), so
  the cold phases alternate between them: load that comes and goes on a
  shared machine then weighs on both alike."""
  key = os.environ.get("ZEBRA_JAX_API_KEY", "")
  load, report = [os.getloadavg()], {}
  servers = {}
  try:
    for label, extra in (("cache", []), ("no_cache", [
        "--config.serve.prefix_cache_bytes=0"])):
      servers[label] = Server(f.workdir, overrides + extra,
                                          cpus=server_cpus)
    # lm-eval's first run in a process costs ~1.5 s more than the next
    # (what it sets up once): spent here, on one document and the
    # cache-off server, not in the first timed run (the cache's).
    lm_eval_run(servers["no_cache"].url, 0, limit=1)
    for label, server in servers.items():
      report[label] = prefix_measure(server.url, key)
      load.append(os.getloadavg())
    seed = f.seed_prompt or seed_prompt_of(f.workdir)
    mix = source_text(servers["cache"].url, key, seed, 4000)
    rates = {label: [] for label in servers}
    for round_ in range(COLD_ROUNDS):
      for label in sorted(servers, reverse=round_ % 2 == 1):
        server = servers[label]
        rates[label].append(phase(
            server.url, key, mix, int(f.clients[-1]), f.seconds,
            f.max_tokens, f.client_procs, server.proc.pid, f.client,
            client_cpus, tag=f"{round_}.")["tokens_per_s"])
    for label, server in servers.items():
      report[label]["cold_tokens_per_s"] = rates[label]
      report[label]["engine"] = _get(server.url, "/health",
                                                 key)["engine"]
    load.append(os.getloadavg())
  finally:
    for server in servers.values():
      server.close()
  on, off = report["cache"], report["no_cache"]
  summary = report["summary"] = {}
  for shots in SHOTS:
    name = f"lm_eval_{shots}_shot"
    summary[name] = {
        "speedup": round(off[name]["seconds"] / on[name]["seconds"], 2),
        "same_loglikelihoods": (on[name]["loglikelihoods"]
                                == off[name]["loglikelihoods"]),
        "acc": [on[name]["acc"], off[name]["acc"]]}
  summary.update({
      "chat_2000_over_20": round(on["chat_ms"]["system_2000"]
                                 / on["chat_ms"]["system_20"], 2),
      "cold_tokens_per_s_ratio": round(
          statistics.median(on["cold_tokens_per_s"])
          / statistics.median(off["cold_tokens_per_s"]), 3)})
  report["load_average_1_5_15"] = load
  for label in ("cache", "no_cache"):
    r = report[label]
    shots = " ".join(f"{n}-shot {r[f'lm_eval_{n}_shot']['seconds']} s (acc "
                     f"{r[f'lm_eval_{n}_shot']['acc']:.3f})" for n in SHOTS)
    print(f"{label:>8}: lm-eval {shots} | chat first text, turns 2-10, p50: "
          f"{r['chat_ms']['system_2000']} ms behind 2,000 chars of system "
          f"prompt, {r['chat_ms']['system_20']} ms behind 20 | cold "
          f"{r['cold_tokens_per_s']} tokens/s")
  print(f"summary: {json.dumps(report['summary'])}")
  print(f"load average (1, 5, 15 min) at start, after each server's "
        f"lm-eval and chats, after the cold phases: {load}")
  return report


def main(argv) -> None:
  f = flags.FLAGS
  overrides = [f"--config.{name}" + ("" if value is None else f"={value}")
               for name, value in argv[1:]]
  if not (f.url or f.workdir):
    raise UserError("give --workdir=DIR (the bench starts its server) or "
                    "--url=URL of a running --mode=serve")
  if f.url and overrides:
    raise UserError("--config.* overrides shape the server the bench starts: "
                    "drop them with --url, or drop --url")
  key = os.environ.get("ZEBRA_JAX_API_KEY", "")
  server_cpus, client_cpus = cpu_set(f.server_cpus), cpu_set(f.client_cpus)
  if f.url and server_cpus:
    raise UserError("--server_cpus pins the server the bench starts: drop it "
                    "with --url")
  if f.scenario == "prefix":
    if not f.workdir or f.url:
      raise UserError("--scenario=prefix starts its own two servers: give "
                      "--workdir and no --url")
    report = prefix_scenario(f, overrides, server_cpus, client_cpus)
    report["command"] = " ".join(["python -m lab.serve_bench"] + sys.argv[1:])
    _write_json(f, report)
    return
  server = None if f.url else Server(f.workdir, overrides, cpus=server_cpus)
  try:
    url = f.url.rstrip("/") if f.url else server.url
    health = _get(url, "/health", key)
    rss_start = health["rss_bytes"]
    programs_start = health["engine"]["compiled_programs"]
    seed = f.seed_prompt or (seed_prompt_of(f.workdir) if f.workdir else None)
    if not seed:
      raise UserError("with --url and no --workdir, pass --seed_prompt (text "
                      "the model's tokenizer knows)")
    text = source_text(url, key, seed, 4000)
    load = [os.getloadavg()]
    fresh = novelty(url, key, text, f.max_tokens)
    clients = [int(c) for c in f.clients]
    pid = server.proc.pid if server else None
    phases = [phase(url, key, text, c, f.seconds, f.max_tokens,
                    f.client_procs, pid, f.client, client_cpus)
              for c in clients]
    load.append(os.getloadavg())
    rss_warm = _get(url, "/health", key)["rss_bytes"]
    soaked = (soak(url, key, text, f.soak_clients, f.soak_seconds,
                   f.max_tokens, f.client_procs, pid, f.client, client_cpus,
                   shared_prefix=text[:f.soak_shared_prefix])
              if f.soak_seconds > 0 else None)
    health = _get(url, "/health", key)
    load.append(os.getloadavg())
  finally:
    if server is not None:
      server.close()
  report = {
      "command": " ".join(["python -m lab.serve_bench"]
                          + sys.argv[1:]),
      "cpus": os.cpu_count(), "load_average_1_5_15": load,
      "engine": health["engine"], "max_tokens": f.max_tokens,
      "client": f.client, "client_procs": f.client_procs,
      "server_cpus": sorted(server_cpus) if server_cpus else "all",
      "client_cpus": sorted(client_cpus) if client_cpus else "all",
      "novelty": fresh, "phases": phases, "soak": soaked,
      "compiled_programs": {"start": programs_start,
                            "end": health["engine"]["compiled_programs"]},
      "rss_mb": {"start": round(rss_start / 2**20, 1),
                 "after_phases": round(rss_warm / 2**20, 1),
                 "end": round(health["rss_bytes"] / 2**20, 1)}}
  print(f"clients: {f.client}, over {f.client_procs} processes, on CPUs "
        f"{report['client_cpus']}; server on CPUs {report['server_cpus']}")
  print(table(phases))
  print(f"first request at a new prompt length and temperature: "
        f"{fresh['first_p50_ms']} ms p50, repeated {fresh['repeat_p50_ms']} "
        f"ms ({fresh['ratio']}x)")
  print(f"compiled programs: {programs_start} at start, "
        f"{health['engine']['compiled_programs']} at the end | server RSS "
        f"{report['rss_mb']['start']} MB at start, "
        f"{report['rss_mb']['after_phases']} after the phases, "
        f"{report['rss_mb']['end']} at the end")
  if soaked:
    print(f"soak: {soaked['seconds']} s of {soaked['clients']} clients, "
          f"{soaked['requests']} requests, {soaked['errors']} errors, RSS "
          f"{soaked['rss_mb'][0]} -> {soaked['rss_mb'][-1]} MB "
          f"({soaked['growth_pct']:+.2f}%)")
  print(f"load average (1, 5, 15 min) at start/after phases/end: {load}")
  _write_json(f, report)


def _write_json(f, report: dict) -> None:
  path = f.json or (os.path.join(f.workdir, "serve_bench.json")
                    if f.workdir else "serve_bench.json")
  with open(path, "w", encoding="utf-8") as out:
    json.dump(report, out, indent=1)
  print(f"wrote {path}")


def _flags() -> None:
  """The tool's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_string("workdir", None, "A trained run directory: the bench "
                      "starts --mode=serve on it (--config.* overrides go "
                      "to the server).")
  flags.DEFINE_string("url", None, "A running server instead, e.g. "
                      "http://127.0.0.1:8000 (API key: $ZEBRA_JAX_API_KEY).")
  flags.DEFINE_list("clients", ["1", "16", "64"], "Concurrent clients per "
                    "phase.")
  flags.DEFINE_enum("scenario", "throughput", ["throughput", "prefix"],
                    "throughput: the phases above; prefix: the prefix state "
                    "cache on against off (prefix_scenario; its cold "
                    "phase has the last --clients).")
  flags.DEFINE_float("seconds", 15.0, "Length of each phase.")
  flags.DEFINE_integer("max_tokens", 32, "Tokens generated per request.")
  flags.DEFINE_enum("client", "aiohttp", list(CLIENTS), "The clients: "
                    "aiohttp (asyncio tasks, light) or the openai client "
                    "(threads).")
  flags.DEFINE_string("server_cpus", None, "Pin the server the bench starts "
                      "to these CPUs, e.g. 0 or 0-3 (default: all).")
  flags.DEFINE_string("client_cpus", None, "Pin the clients to these CPUs, "
                      "e.g. 1 (default: all): with --server_cpus, the load "
                      "generator no longer takes the server's CPU.")
  flags.DEFINE_integer("client_procs", 4, "Processes the clients are spread "
                       "over (each runs its share as threads).")
  flags.DEFINE_float("soak_seconds", 0.0, "Then this long of varied traffic "
                     "from --soak_clients, the server's RSS sampled every "
                     "30 s.")
  flags.DEFINE_integer("soak_clients", 16, "Concurrent clients of the soak.")
  flags.DEFINE_integer("soak_shared_prefix", 0, "Characters of model text "
                       "that the soak's every other burst starts each prompt "
                       "with (the prefix state cache's hits); 0: one mix.")
  flags.DEFINE_string("seed_prompt", None, "Text the model continues to make "
                      "the prompts (default: from the workdir's tokenizer).")
  flags.DEFINE_string("json", None, "JSON output (default "
                      "WORKDIR/serve_bench.json).")


if __name__ == "__main__":
  _flags()
  entry.run_tool(main, own_overrides=True)
