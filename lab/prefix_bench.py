"""What the prefix state cache buys: `python -m lab.serve_bench
--scenario=prefix --workdir=DIR`, one server with the cache and one without
(serve.prefix_cache_bytes=0), in the same run:

  lm-eval  lm-evaluation-harness's `local-completions` on the multiple-choice
           task of docs/examples/lm_eval (4 choices after one passage of 360
           characters), 0-shot and 2-shot (the same 2 examples before every
           passage): wall time, accuracy, every choice's log-likelihood.
  chat     10 turns of a streamed chat behind a 2,000-character system
           prompt, and the same turns behind a 20-character one, 3 times
           each, alternated: the median time to the first text of turns
           2-10.
  cold     the last --clients clients of serve_bench's request mix (prompts
           cut at random from model text, each after its own number: no
           two share a prefix), 4 phases on each server, alternated:
           tokens/s.
"""

import json
import os
import statistics
import time

from lab import serve_bench

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


def lm_eval_run(url: str, shots: int) -> dict:
  """The multiple-choice task through local-completions, as its users run
  it (the server's own tokenizer through /tokenize): its wall time once
  lm-eval has read its task index."""
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
        model_args=(f"model={serve_bench.MODEL},base_url={url}/v1/completions,"
                    "tokenizer_backend=remote,tokenized_requests=True,"
                    "max_length=4096"),
        tasks=[TASK], num_fewshot=shots, task_manager=_TASKS[0],
        log_samples=True)
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
        model=serve_bench.MODEL, messages=messages, max_tokens=max_tokens,
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


def measure(url: str, key: str) -> dict:
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


def run(f, overrides: list[str], server_cpus, client_cpus) -> dict:
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
      servers[label] = serve_bench.Server(f.workdir, overrides + extra,
                                          cpus=server_cpus)
    for label, server in servers.items():
      report[label] = measure(server.url, key)
      load.append(os.getloadavg())
    seed = f.seed_prompt or serve_bench.seed_prompt_of(f.workdir)
    mix = serve_bench.source_text(servers["cache"].url, key, seed, 4000)
    rates = {label: [] for label in servers}
    for round_ in range(COLD_ROUNDS):
      for label in sorted(servers, reverse=round_ % 2 == 1):
        server = servers[label]
        rates[label].append(serve_bench.phase(
            server.url, key, mix, int(f.clients[-1]), f.seconds,
            f.max_tokens, f.client_procs, server.proc.pid, f.client,
            client_cpus, tag=f"{round_}.")["tokens_per_s"])
    for label, server in servers.items():
      report[label]["cold_tokens_per_s"] = rates[label]
      report[label]["engine"] = serve_bench._get(server.url, "/health",
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
