"""The clients people point at an OpenAI-compatible server, against a live
zebra_jax server: LangChain's `OpenAI` and `ChatOpenAI` (invoke, batch,
stream) and lm-evaluation-harness's `local-completions` with the remote
tokenizer, whose rolling log-likelihood must be --mode=score's. Each skips
where its package is not installed; CI installs them and reruns these."""

import json
import math

import numpy as np
import pytest

from zebra_jax.inference import loading
from zebra_jax.serving import openai_api, serve
from tests.helpers import live_server

pytestmark = pytest.mark.timeout(300)
M = openai_api.MODEL_ID
DOCS = ["line 4: the quick brown fox jumps over the lazy dog.\nline 5: the",
        "the lazy dog jumps over the quick brown fox"]


@pytest.fixture(scope="module")
def server(char_run):
  cfg, workdir = char_run
  service = serve.Service(loading.load_for_inference(cfg, workdir),
                          serve.Limits(max_new_tokens=64), slots=8)
  with live_server(service) as httpd:
    yield f"http://127.0.0.1:{httpd.server_port}/v1", service
  service.close()


def _openai_client(url):
  openai = pytest.importorskip("openai")
  return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_langchain_openai_invoke_batch_and_stream(server):
  langchain_openai = pytest.importorskip(
      "langchain_openai", reason="pip install langchain-openai")
  url, _ = server
  llm = langchain_openai.OpenAI(model=M, base_url=url, api_key="unused",
                                temperature=0, max_tokens=16, max_retries=0)
  direct = [c.text for c in _openai_client(url).completions.create(
      model=M, prompt=["line 7: the", "the "], max_tokens=16,
      temperature=0).choices]
  assert llm.invoke("line 7: the") == direct[0]
  assert llm.batch(["line 7: the", "the "]) == direct
  assert "".join(llm.stream("the ")) == direct[1]


def test_langchain_chat_openai_invoke_batch_and_stream(server):
  langchain_openai = pytest.importorskip(
      "langchain_openai", reason="pip install langchain-openai")
  url, service = server
  chat = langchain_openai.ChatOpenAI(model=M, base_url=url, api_key="unused",
                                     temperature=0, max_tokens=24,
                                     max_retries=0)
  messages = [("system", "the quick"), ("human", "line 9: the")]
  transcript = "system: the quick\nuser: line 9: the\nassistant: "
  [direct] = _openai_client(url).completions.create(
      model=M, prompt=transcript, max_tokens=24, temperature=0,
      stop=["\nuser:"]).choices
  reply = chat.invoke(messages)
  assert reply.content == direct.text
  assert reply.response_metadata["finish_reason"] == direct.finish_reason
  assert [m.content for m in chat.batch([messages, messages])] == [
      direct.text] * 2
  assert "".join(c.content for c in chat.stream(messages)) == direct.text
  assert service.api.transcript([{"role": "system", "content": "the quick"},
                                 {"role": "user", "content": "line 9: the"}
                                 ]) == transcript


def test_lm_eval_local_completions_with_the_remote_tokenizer(server,
                                                             tmp_path):
  """A perplexity task on a local file: lm-evaluation-harness tokenizes
  through /tokenize, scores through echo + logprobs with token-id prompts;
  its log-likelihood is the scorer's on the text after the end-of-text
  token (its first token's context)."""
  pytest.importorskip("lm_eval", reason="pip install 'lm-eval[api]'")
  for name in ("tenacity", "requests"):
    pytest.importorskip(name, reason="pip install 'lm-eval[api]'")
  import lm_eval  # pylint: disable=import-outside-toplevel
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  url, service = server
  data = tmp_path / "docs.jsonl"
  data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
  (tmp_path / "zebra_story.yaml").write_text(f"""
task: zebra_story
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
  out = lm_eval.simple_evaluate(
      model="local-completions",
      model_args=(f"model={M},base_url={url}/completions,"
                  "tokenizer_backend=remote,tokenized_requests=True,"
                  "max_length=1024"),
      tasks=["zebra_story"], task_manager=TaskManager(
          include_path=str(tmp_path)), log_samples=False)
  bits_per_byte = out["results"]["zebra_story"]["bits_per_byte,none"]
  total_bytes = sum(len(d.encode("utf-8")) for d in DOCS)
  got = -bits_per_byte * total_bytes * math.log(2)
  eos = service.eos_token
  assert eos == "\n"
  want = sum(service.scorer.score_ids(service.encode(eos + d)).sum()
             for d in DOCS)
  assert got == pytest.approx(want, rel=1e-5, abs=1e-3)
  assert np.isfinite(got) and got < 0
