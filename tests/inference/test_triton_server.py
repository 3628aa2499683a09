"""The exported model in a real Triton server (the `tritonserver` binary of
the nvidia-pytriton wheel, on CPU), asked with tritonclient.http: greedy
answers byte-identical to --mode=sample for char, word and BPE tokenizers,
concurrent requests merged by the dynamic batcher, one prompt giving the
same text through --mode=sample, /generate, /v1/completions and Triton, and
sampled text (min_p and the penalties in play) the same through
--mode=sample, the server's engine, the exported artifact and Triton."""

import dataclasses
import os
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from zebra_jax.configs import demo
from zebra_jax.inference import export, loading, sample, triton_local
from zebra_jax.serving import serve
from zebra_jax.training import loop
from tests.helpers import WORDS, http_post, live_server, load_triton_model

th = pytest.importorskip("tritonclient.http",
                         reason="pip install tritonclient[http] (.[test])")

CHAR_PROMPTS = ["line 7: the quick", "line 3: ", "the lazy", "line 12",
                "brown fox", "line 299: the", "jumps over", "dog."]
WORD_PROMPTS = ["the cat sat", "the dog ran to", "a bird"]
NEW_TOKENS = 12
# An export's sampling defaults with min_p and every penalty in play, and
# each of those knobs' off value.
SAMPLING = dict(temperature=0.9, top_p=0.9, min_p=0.5, repetition_penalty=2.0,
                presence_penalty=1.0, frequency_penalty=1.0, max_new_tokens=48)
OFF = dict(min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
           frequency_penalty=0.0)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _tiny(kind, corpus):
  """A tiny word or BPE model over `corpus`: a few seconds of training."""
  cfg = demo.get_config("tiny")
  cfg.data.update(source="text", path=str(corpus), tokenizer=kind,
                  bpe_vocab_size=300, seq_len=8)
  cfg.model.update(embed_size=16, hidden_size=16, num_layers=1)
  cfg.train.update(num_steps=30, eval_every=1000, eval_max_batches=2,
                   sample_at_eval=False, report_at_end=False)
  cfg.checkpoint.every_steps = 30
  cfg.eval.update(batch_size=8, seq_len=8)
  return cfg


def sample_mode(cfg, workdir, prompts, seed=0):
  """--mode=sample's texts, greedy."""
  cfg = cfg.copy_and_resolve_references()
  cfg.sample.update(temperature=0.0, max_new_tokens=NEW_TOKENS, seed=seed,
                    stop="", stream=False, num_samples=1)
  return sample.run(cfg, workdir, prompts)


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory):
  """Where tritonserver's backend directory goes; skips (before any
  training) where the binary cannot run."""
  folder = str(tmp_path_factory.mktemp("tritonserver"))
  try:
    triton_local.check_runs(folder)
  except triton_local.NotAvailable as e:
    pytest.skip(str(e))
  return folder


@pytest.fixture(scope="module")
def runs(server_dir, char_run, tmp_path_factory):
  """{kind: (cfg, workdir, prompts)}: the session's char run, and tiny word
  and BPE runs trained here."""
  del server_dir  # only its check
  out = {"char": (*char_run, CHAR_PROMPTS)}
  base = tmp_path_factory.mktemp("triton_runs")
  corpus = base / "corpus.txt"
  corpus.write_text("".join(" ".join(WORDS[i % 20:i % 20 + 8]) + "\n"
                            for i in range(240)))
  kinds = ["word"]
  try:
    import tokenizers  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    kinds.append("bpe")
  except ImportError:
    pass
  for kind in kinds:
    cfg, workdir = _tiny(kind, corpus), str(base / kind)
    loop.run(cfg, workdir)
    out[kind] = (cfg, workdir, WORD_PROMPTS)
  return out


def sampling_cfg(cfg):
  """`cfg` with SAMPLING as its sample group's settings."""
  cfg = cfg.copy_and_resolve_references()
  cfg.sample.update(stop="", stream=False, num_samples=1, **SAMPLING)
  return cfg


@pytest.fixture(scope="module")
def triton(runs, server_dir, tmp_path_factory):
  """(client, {kind: model name}, server log path, {kind: export dir}): one
  tritonserver serving every run's export on CPU, and the char run's
  exported with SAMPLING ("sampling"), stopped by its PID."""
  base = tmp_path_factory.mktemp("triton")
  repository, names, exports = str(base / "repository"), {}, {}
  char_cfg, char_workdir, _ = runs["char"]
  exported = [(kind, cfg, workdir) for kind, (cfg, workdir, _)
              in runs.items()]
  exported.append(("sampling", sampling_cfg(char_cfg), char_workdir))
  for kind, cfg, workdir in exported:
    export_dir = export.run(cfg, workdir, str(base / f"export_{kind}"))
    names[kind], exports[kind] = f"zebra_{kind}", export_dir
    export.write_triton_repository(
        os.path.join(export_dir, "artifact"), repository, instance="cpu",
        queue_delay_us=20_000, model_name=names[kind])
  port = _free_port()
  argv, env = triton_local.command(repository, server_dir,
                                   http_port=port, grpc_port=_free_port())
  log = open(base / "tritonserver.log", "wb")
  proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
  try:
    client = th.InferenceServerClient(f"127.0.0.1:{port}", concurrency=8,
                                      network_timeout=120)
    deadline = time.monotonic() + 120
    while True:
      if proc.poll() is not None:
        pytest.fail(f"tritonserver exited ({proc.returncode}): "
                    + (base / "tritonserver.log").read_text()[-3000:])
      try:
        if all(client.is_model_ready(n) for n in names.values()):
          break
      except Exception:  # pylint: disable=broad-except  (not listening yet)
        pass
      assert time.monotonic() < deadline, "tritonserver not ready in 120 s"
      time.sleep(0.5)
    yield client, names, base / "tritonserver.log", exports
  finally:
    os.kill(proc.pid, 15)  # SIGTERM: Triton unloads the models and exits
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      os.kill(proc.pid, 9)
      proc.wait(timeout=10)
    log.close()


def ask(client, model, prompts, **scalars):
  inputs, outputs = triton_local.request(
      prompts, MAX_NEW_TOKENS=NEW_TOKENS, TEMPERATURE=0.0, **scalars)
  return client.infer(model, inputs, outputs=outputs)


@pytest.mark.timeout(180)  # the fixtures train two tiny models, export three
@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_greedy_answers_equal_sample_mode(runs, triton, kind):
  if kind not in runs:
    pytest.skip("BPE needs the tokenizers package")
  client, names = triton[:2]
  cfg, workdir, prompts = runs[kind]
  expected = sample_mode(cfg, workdir, prompts, seed=3)
  result = ask(client, names[kind], prompts, SEED=3)
  assert triton_local.texts(result) == expected
  assert all(e.startswith(p) and len(e) > len(p)
             for p, e in zip(prompts, expected))


@pytest.mark.timeout(120)
def test_concurrent_requests_are_batched_and_answered(runs, triton):
  client, names = triton[:2]
  cfg, workdir, prompts = runs["char"]
  expected = sample_mode(cfg, workdir, prompts)
  pending = []
  for p in prompts:  # one request per prompt, all in flight at once
    inputs, outputs = triton_local.request(
        [p], MAX_NEW_TOKENS=NEW_TOKENS, TEMPERATURE=0.0)
    pending.append(client.async_infer(names["char"], inputs, outputs=outputs))
  results = [r.get_result(timeout=120) for r in pending]
  assert [triton_local.texts(r)[0] for r in results] == expected
  rows = [int(r.as_numpy("BATCH_ROWS")[0, 0]) for r in results]
  assert max(rows) > 1, rows  # the dynamic batcher merged requests
  stats = client.get_inference_statistics(names["char"])["model_stats"][0]
  assert stats["execution_count"] < stats["inference_count"], stats


@pytest.mark.timeout(120)
def test_one_prompt_same_text_on_all_four_paths(runs, triton):
  client, names = triton[:2]
  cfg, workdir, prompts = runs["char"]
  prompt = prompts[0]
  [from_sample] = sample_mode(cfg, workdir, [prompt], seed=11)
  service = serve.Service(loading.load_for_inference(cfg, workdir))
  httpd = serve.make_server(service, "127.0.0.1", 0)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  try:
    status, out = http_post(httpd.server_port, "/generate", {
        "prompt": prompt, "max_new_tokens": NEW_TOKENS, "temperature": 0,
        "seed": 11})
    assert status == 200, out
    [from_generate] = out["texts"]
    status, out = http_post(httpd.server_port, "/v1/completions", {
        "model": "zebra_lstm", "prompt": prompt, "max_tokens": NEW_TOKENS,
        "temperature": 0, "seed": 11})
    assert status == 200, out
    from_openai = prompt + out["choices"][0]["text"]
  finally:
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)
  [from_triton] = triton_local.texts(ask(client, names["char"], [prompt],
                                         SEED=11))
  assert (from_sample.encode() == from_generate.encode()
          == from_openai.encode() == from_triton.encode())


@pytest.mark.timeout(300)
def test_sampled_tokens_equal_on_all_four_paths(runs, triton, monkeypatch):
  """One seed, the export's min_p and penalties: --mode=sample, the
  server's engine (/generate), the artifact and Triton draw the same."""
  client, names, _, exports = triton
  cfg, workdir, prompts = runs["char"]
  cfg, prompts, seed = sampling_cfg(cfg), prompts[:3], 5
  cfg.sample.seed = seed
  from_sample = sample.run(cfg, workdir, prompts)
  loaded = loading.load_for_inference(cfg, workdir)
  service = serve.Service(loaded)
  try:
    with live_server(service) as httpd:
      status, out = http_post(httpd.server_port, "/generate",
                              {"prompts": prompts, "seed": seed})
  finally:
    service.close()
  assert status == 200, out
  triton_model = load_triton_model(
      os.path.join(exports["sampling"], "triton", export.MODEL_NAME),
      monkeypatch)
  try:
    from_artifact = triton_model.artifact.generate(prompts, seed=seed)
  finally:
    triton_model.finalize()
  inputs, outputs = triton_local.request(prompts, SEED=seed)
  from_triton = triton_local.texts(
      client.infer(names["sampling"], inputs, outputs=outputs))
  assert from_sample == out["texts"] == from_artifact == from_triton
  assert all(len(t) == len(p) + SAMPLING["max_new_tokens"]
             for p, t in zip(prompts, from_sample))  # char: a token a byte
  # Each knob is in play (off, it changes the text), and a request's inputs
  # override the export's defaults.
  generator = sample.Generator(loaded)
  try:
    params = sample.sampling_params(cfg.sample)
    for knob, off in OFF.items():
      assert generator.generate(prompts, dataclasses.replace(
          params, **{knob: off})) != from_sample, knob
    plain = generator.generate(prompts, dataclasses.replace(params, **OFF))
    # logit_bias and stop, the inputs that are not one number, arrive too.
    space = int(loaded.tokenizer.encode_prompt(" ")[0])
    extra = dict(logit_bias=((space, 5.0),), stop=(plain[0][-6:-3],))
    biased = generator.generate(prompts, dataclasses.replace(
        params, **OFF, **extra))
  finally:
    generator.close()
  overrides = {k.upper(): v for k, v in OFF.items()}
  for expected, more in ((plain, {}), (biased, extra)):
    inputs, outputs = triton_local.request(
        prompts, SEED=seed, **overrides, **{k.upper(): v
                                            for k, v in more.items()})
    assert triton_local.texts(client.infer(names["sampling"], inputs,
                                           outputs=outputs)) == expected
  assert biased != plain and biased[0].count(" ") > plain[0].count(" ")
  # An input of another type than its field's is Triton's to refuse.
  inputs, outputs = triton_local.request(prompts[:1])
  wrong = th.InferInput("TEMPERATURE", [1, 1], "FP32")
  wrong.set_data_from_numpy(np.full((1, 1), 0.5, np.float32))
  with pytest.raises(th.InferenceServerException, match="TEMPERATURE"):
    client.infer(names["sampling"], inputs + [wrong], outputs=outputs)
