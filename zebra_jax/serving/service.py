"""The model behind --mode=serve's endpoints, usable without HTTP (tests, an
embedding application): the engine and the scorer over a loaded workdir,
what one request may ask for (Limits), /generate's and /score's requests,
vLLM's tokenizer endpoints, and /health's figures. Bad requests raise
BadRequest with the HTTP status they deserve; app.py turns them into
answers.
"""

import dataclasses
import json
import os
import threading

import numpy as np

from zebra_jax.errors import UserError
from zebra_jax import engine as engines
from zebra_jax.inference import loading, sample, score
from zebra_jax.serving import metrics, openai_api


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask for; beyond it the answer is a 4xx."""
  max_body_bytes: int = 1 << 20
  max_new_tokens: int = 1024
  max_prompt_tokens: int = 4096
  max_rows: int = 64              # prompts x num_samples (or n) per request
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


class Unavailable(Exception):
  """The server cannot take requests now (draining, or its engine failed)."""


_SCORE_FIELDS = {"text": str, "texts": list, "verbose": bool}
# /generate's own fields; every sampling parameter is taken by its name.
_GENERATE_FIELDS = {"prompt": str, "prompts": list, "num_samples": int,
                    "stop": (str, list), "logit_bias": dict,
                    "stop_token_ids": list, "allowed_token_ids": list}
_PARAM_FIELDS = {f.name for f in dataclasses.fields(engines.SamplingParams)
                 } - set(_GENERATE_FIELDS) - {"logprobs", "prompt_logprobs"}
_GENERATE_TYPES = {**_GENERATE_FIELDS, **{
    k: int if k in ("max_new_tokens", "top_k", "seed", "min_tokens")
    else (int, float) for k in _PARAM_FIELDS}}


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


def eos_token(tokenizer) -> str | None:
  """The text that ends a document for this tokenizer (vLLM's eos_token):
  word-level `<eos>`, else a line break where the vocabulary has one."""
  for candidate in ("<eos>", "\n"):
    try:
      ids = tokenizer.encode_prompt(candidate)
    except (UserError, ValueError):
      continue
    if len(ids) == 1 and tokenizer.token_text(int(ids[0])) in (candidate,
                                                               "\n"):
      return candidate
  return None


class Service:
  """The model behind the endpoints; usable without HTTP (tests, embedding)."""

  def __init__(self, loaded: loading.Loaded, limits: Limits = Limits(),
               slots: int | None = None, queue: int | None = None,
               chat_template: str | None = None):
    self.loaded, self.limits = loaded, limits
    self.tokenizer = loaded.tokenizer
    self.vocab_size = int(loaded.cfg.model.vocab_size)
    sizes = {k: v for k, v in (("slots", slots), ("queue", queue))
             if v is not None}  # else cfg.serve's
    self._fatal_listeners = []
    self.metrics = metrics.Metrics(lambda: self.engine.stats(),
                                   limits.max_prompt_tokens,
                                   limits.max_new_tokens)
    self.generator = sample.Generator(
        loaded, max_prompt_tokens=limits.max_prompt_tokens,
        on_fatal=self._engine_failed, on_step=self.metrics.step.observe,
        **sizes)
    self.scorer = score.Scorer(loaded, loaded.cfg.eval.seq_len)
    self.defaults = sample.serving_defaults(loaded.cfg)
    self.engine = self.generator.engine  # compiles its programs now
    template = (loaded.cfg.serve.get("chat_template", "")
                if chat_template is None else chat_template)
    self.api = openai_api.Api(self, template)
    self.eos_token = eos_token(self.tokenizer)
    self._score_lock = threading.Lock()  # one scoring call at a time

  def close(self) -> None:
    self.generator.close()

  def on_fatal(self, listener) -> None:
    """listener(error) runs once if the engine fails for good."""
    self._fatal_listeners.append(listener)

  def _engine_failed(self, error) -> None:
    for listener in self._fatal_listeners:
      listener(error)

  def stats(self) -> dict:
    return self.engine.stats()

  def health(self) -> dict:
    m = self.loaded.cfg.model
    stats = self.stats()
    status = "ok" if stats["healthy"] else "failed"
    return {"status": status, "step": int(self.loaded.step),
            "tokenizer": self.tokenizer.kind,
            "vocab_size": m.vocab_size, "num_layers": m.num_layers,
            "hidden_size": m.hidden_size, "num_stripes": m.num_stripes,
            "head": m.head, "limits": dataclasses.asdict(self.limits),
            "engine": stats, "rss_bytes": _rss_bytes()}

  def encode(self, prompt: str) -> np.ndarray:
    """A prompt's tokens; UserError for text the model cannot read."""
    return self.generator.encode(prompt)

  def prompt_ids(self, prompt: str) -> np.ndarray:
    """A prompt's tokens, encoded once: checked here, then handed to the
    engine. BadRequest (413) beyond the limit."""
    ids = self.encode(prompt)
    if len(ids) > self.limits.max_prompt_tokens:
      raise BadRequest(f"a prompt of {len(ids)} tokens is too many tokens: "
                       f"at most {self.limits.max_prompt_tokens}", 413)
    return ids

  # --- /generate ---

  def generate_rows(self, body) -> list[engines.Row]:
    """/generate's rows: prompt-major (p0 s0, p0 s1, ...), row i drawing
    from stream i of the request's seed."""
    body = _check_fields(body, _GENERATE_TYPES)
    prompts = _texts(body, "prompt", "prompts")
    values = {k: v for k, v in body.items() if k in _PARAM_FIELDS}
    if "stop" in body:
      values["stop"] = openai_api.parse_stops(body["stop"])
    try:
      if "logit_bias" in body:
        values["logit_bias"] = openai_api.parse_logit_bias(body["logit_bias"])
      for name in ("stop_token_ids", "allowed_token_ids"):
        if name in body:
          values[name] = openai_api.parse_token_ids(body[name], name)
    except openai_api.ApiError as e:
      raise BadRequest(str(e)) from None
    params = dataclasses.replace(self.defaults, **values)
    try:
      params.check(self.vocab_size)
    except engines.ParamError as e:
      raise BadRequest(f"{e.field}={json.dumps(body.get(e.field))}: "
                       f"{e.reason}") from None
    num_samples = body.get("num_samples", 1)
    if num_samples < 1:
      raise BadRequest(f"num_samples={num_samples} must be at least 1")
    lim = self.limits
    if params.max_new_tokens > lim.max_new_tokens:
      raise BadRequest(f"max_new_tokens={params.max_new_tokens} is too many "
                       f"tokens: at most {lim.max_new_tokens}", 413)
    if len(prompts) * num_samples > lim.max_rows:
      raise BadRequest(f"{len(prompts)} prompts x num_samples={num_samples} "
                       f"is more than {lim.max_rows} rows", 413)
    ids = [self.prompt_ids(p) for p in prompts]
    order = [(p, t) for p, t in zip(prompts, ids) for _ in range(num_samples)]
    return [engines.Row(p, params, t, i) for i, (p, t) in enumerate(order)]

  def generate(self, body) -> dict:
    """/generate without HTTP: blocks until every row is done."""
    done = self.engine.submit_many(self.generate_rows(body))
    texts = [r.prompt + r.result() for r in done]
    return {"texts": texts, "step": int(self.loaded.step)}

  # --- /score ---

  def score(self, body) -> dict:
    body = _check_fields(body, _SCORE_FIELDS)
    texts = _texts(body, "text", "texts")
    results = []
    with self._score_lock:
      ids = [self.tokenizer.encode(t) for t in texts]
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

  # --- vLLM's tokenizer endpoints ---

  def tokenize(self, body) -> dict:
    """{"prompt": text} or {"messages": [...]} (with chat's
    add_generation_prompt and continue_final_message) -> its tokens."""
    if not isinstance(body, dict):
      raise BadRequest("the body must be a JSON object, e.g. "
                       "{\"prompt\": \"The \"}")
    if "messages" in body:
      text = self.api.transcript(body["messages"],
                                 **self.api.chat_form(body))
    else:
      text = body.get("prompt")
      if not isinstance(text, str):
        raise BadRequest("prompt must be a string (or send messages)")
    ids = [int(i) for i in self.encode(text)] if text else []
    out = {"count": len(ids), "max_model_len": self.limits.max_prompt_tokens,
           "tokens": ids, "token_strs": None}
    if body.get("return_token_strs"):
      out["token_strs"] = [self.tokenizer.token_text(i) for i in ids]
    return out

  def detokenize(self, body) -> dict:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and
        0 <= t < self.vocab_size for t in tokens):
      raise BadRequest(f"tokens must be a list of token ids in [0, "
                       f"{self.vocab_size})")
    return {"prompt": self.tokenizer.decode(tokens)}

  def tokenizer_info(self) -> dict:
    return {"tokenizer_class": f"zebra_jax.{self.tokenizer.kind}",
            "eos_token": self.eos_token, "bos_token": None,
            "pad_token": None, "unk_token": None,
            "model_max_length": self.limits.max_prompt_tokens,
            "vocab_size": self.vocab_size}
