"""OpenAI's completions and chat completions, as vLLM serves a base model.

Clients built for an OpenAI-compatible server (the `openai` package,
LangChain's `OpenAI` and `ChatOpenAI`, lm-evaluation-harness's
`local-completions`, curl scripts) talk to a zebra_jax model unchanged:

  GET  /v1/models, /v1/models/{id}
  POST /v1/completions       prompt: a string, a list of strings, a list of
                             token ids or a list of lists; n; echo with the
                             prompt's log-probabilities; max_tokens 0 scores
  POST /v1/chat/completions  messages through a chat template (a base model
                             continues a role-prefixed transcript)

Sampling fields map to the engine's SamplingParams by name (`max_tokens`
and chat's `max_completion_tokens` are its `max_new_tokens`): temperature,
top_p, top_k, min_p, presence_penalty, frequency_penalty,
repetition_penalty, logit_bias, seed, stop, stop_token_ids, min_tokens,
allowed_token_ids, prompt_logprobs; so a knob added there is taken here
without an edit. vLLM's return_token_ids, return_tokens_as_token_ids,
truncate_prompt_tokens (and truncation_side), chat's echo,
add_generation_prompt and continue_final_message, and
stream_options.continuous_usage_stats are honoured. Defaults are OpenAI's
(temperature 1, top_p 1; max_tokens 16 for completions, until a stop for
chat), not the config's. A field of
OpenAI's or vLLM's schema is honoured, or taken only with a value that
asks nothing of this server (INERT); any other value is a 400 in OpenAI's
error shape whose `param` names the field, never dropped silently. A field
in neither schema is ignored with one warning naming it, as vLLM does.
This module reads requests; openai_answers.py writes the answers.
"""

import dataclasses
import json
import logging
import time

from zebra_jax.errors import UserError
from zebra_jax.engine import MAX_LOGPROBS, ParamError
from zebra_jax.engine import SamplingParams

MODEL_ID = "zebra_lstm"
DEFAULT_CHAT_TEMPLATE = "{role}: {content}\n"

log = logging.getLogger("zebra_jax.serve")

_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}
# Request fields that are not sampling parameters by the same name.
_COMMON = {"model", "n", "best_of", "stream", "stream_options",
           "max_tokens", "logit_bias", "stop", "logprobs", "seed",
           "truncate_prompt_tokens", "truncation_side", "return_token_ids",
           "return_tokens_as_token_ids"}
# Fields of OpenAI's and vLLM's requests that this server takes without
# acting on them. ANY: no value changes the answer. Otherwise the values
# that ask nothing of it (null always does): any other is a 400 naming the
# field, never silently dropped.
ANY = None
INERT = {
    "user": ANY, "metadata": ANY, "store": ANY, "service_tier": ANY,
    "request_id": ANY, "session_id": ANY, "priority": (0,),
    "cache_salt": ANY, "prompt_cache_key": ANY, "safety_identifier": ANY,
    "stream_interval": ANY, "prediction": ANY, "kv_transfer_params": ANY,
    "ec_transfer_params": ANY, "vllm_xargs": ANY, "include_reasoning": ANY,
    "parallel_tool_calls": ANY, "mm_processor_kwargs": ANY,
    "media_io_kwargs": ANY, "return_token_offsets": ANY,
    "add_special_tokens": ANY,  # these tokenizers add no BOS or EOS
    # No token ends a text by itself: only stop, stop_token_ids, max_tokens.
    "ignore_eos": (True,),
    "skip_special_tokens": (False,),  # special tokens stay in the text
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "use_beam_search": (False,), "length_penalty": (1,),
    "bad_words": ([],),
    "logprob_token_ids": (), "prompt_embeds": (), "watermarking": (False,),
    "repetition_detection": (), "thinking_token_budget": (-1,),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (),
    "response_format": ({"type": "text"},), "structured_outputs": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (), "modalities": (["text"],),
    "audio": (), "tools": ([],), "tool_choice": ("none", "auto"),
    "functions": ([],), "function_call": ("none", "auto"),
    "chat_template": (), "chat_template_kwargs": ({},),
    "documents": ([],),
}
COMPLETION_FIELDS = (_PARAM_NAMES | _COMMON | set(INERT) | {
    "prompt", "echo", "suffix"}) - {"max_new_tokens"}
CHAT_FIELDS = (_PARAM_NAMES | _COMMON | set(INERT) | {
    "messages", "max_completion_tokens", "top_logprobs", "echo",
    "add_generation_prompt", "continue_final_message"}) - {"max_new_tokens"}


class ApiError(Exception):
  """An error answer in OpenAI's shape (4xx, or 5xx with kind
  "server_error")."""

  def __init__(self, message: str, param: str | None = None,
               status: int = 400, code: str | None = None,
               kind: str = "invalid_request_error", headers=None):
    super().__init__(message)
    self.status, self.param, self.code, self.kind = status, param, code, kind
    self.headers = headers  # extra HTTP headers, e.g. WWW-Authenticate

  def payload(self) -> dict:
    return {"error": {"message": str(self), "type": self.kind,
                      "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Prompt:
  """One prompt: its text and its tokens."""
  text: str
  ids: list


@dataclasses.dataclass
class Request:
  """A checked completions or chat request."""
  model: str
  prompts: list          # Prompt per prompt
  params: SamplingParams
  n: int
  stream: bool
  include_usage: bool
  echo: bool = False
  chat: bool = False
  logprobs: int | None = None   # alternatives per token; None = off
  prompt_logprobs: int | None = None  # returned as vLLM's prompt_logprobs
  continuous_usage: bool = False  # usage on every event of a stream
  token_ids: bool = False       # vLLM's return_token_ids
  tokens_as_ids: bool = False   # logprobs name tokens "token_id:N"
  role: str = "assistant"       # chat: the role the reply speaks in
  reply_prefix: str = ""        # chat: echo's text before each reply

  def rows(self):
    """(prompt index, choice index) per generated row: prompt-major, so
    choice i of a request draws from stream i of its seed."""
    return [(p, p * self.n + j) for p in range(len(self.prompts))
            for j in range(self.n)]


def _check_known(body: dict, known: set, path: str) -> None:
  """One warning for fields in neither schema; a 400 for an INERT field
  that asks for something this server does not do."""
  unknown = sorted(set(body) - known)
  if unknown:
    log.warning("%s: ignored unknown field(s) %s", path, ", ".join(unknown))
  for name in sorted(set(body) & set(INERT)):
    allowed, value = INERT[name], body[name]
    if allowed is ANY or value is None or any(_same(value, a)
                                              for a in allowed):
      continue
    what = (" or ".join(json.dumps(a) for a in allowed) if allowed
            else "null")
    raise ApiError(f"{name}={json.dumps(value)[:80]}: this server does not "
                   f"do that; send {what}, or leave {name} out", name)


def _same(value, allowed) -> bool:
  """value == allowed, but true and 1 differ (1 and 1.0 do not)."""
  if isinstance(value, bool) or isinstance(allowed, bool):
    return value is allowed
  return value == allowed


def _int(body, name, default, low, high):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int):
    raise ApiError(f"{name} must be an integer, got {json.dumps(value)}",
                   name)
  if not low <= value <= high:
    raise ApiError(f"{name}={value} is outside [{low}, {high}]", name)
  return value


def _flag(body, name) -> bool:
  value = body.get(name)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise ApiError(f"{name} must be true or false", name)
  return value


def parse_stops(value) -> tuple:
  if value is None:
    return ()
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or not all(
      isinstance(s, str) for s in stops):
    raise ApiError("stop must be a string or a list of strings", "stop")
  return tuple(s for s in stops if s)


def parse_token_ids(value, name: str) -> tuple:
  """A list of token ids (null: none) as a tuple; the engine bounds it."""
  if value is None:
    return ()
  if not isinstance(value, list) or not all(_is_id(t) for t in value):
    raise ApiError(f"{name} must be a list of token ids, e.g. [198]", name)
  return tuple(value)


def parse_logit_bias(value) -> tuple:
  if value is None:
    return ()
  if not isinstance(value, dict):
    raise ApiError("logit_bias must map token ids to numbers, e.g. "
                   "{\"50\": -100}", "logit_bias")
  pairs = []
  for token, bias in value.items():
    try:
      token = int(token)
    except ValueError:
      raise ApiError(f"logit_bias key {token!r} is not a token id",
                     "logit_bias") from None
    pairs.append((token, bias))
  return tuple(sorted(pairs))


class Api:
  """What the OpenAI routes accept and answer, over a serve.Service (its
  tokenizer, limits and chat template); serve.App runs the requests."""

  def __init__(self, service, chat_template: str = ""):
    self.service = service
    self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
    check_chat_template(self.chat_template)
    self.created = int(time.time())

  # --- models ---

  def models(self) -> dict:
    return {"object": "list", "data": [self._model()]}

  def _model(self) -> dict:
    return {"id": MODEL_ID, "object": "model", "created": self.created,
            "owned_by": "zebra_jax",
            "max_model_len": self.service.limits.max_prompt_tokens}

  def model(self, name: str) -> dict:
    if name != MODEL_ID:
      raise ApiError(f"the model {name!r} does not exist: this server serves "
                     f"{MODEL_ID!r}", "model", 404, "model_not_found")
    return self._model()

  # --- requests ---

  def _common(self, body, path, known) -> tuple[str, dict]:
    if not isinstance(body, dict):
      raise ApiError("the body must be a JSON object, e.g. {\"model\": "
                     f"\"{MODEL_ID}\", \"prompt\": \"The \"}}")
    _check_known(body, known, path)
    model = body.get("model")
    if not isinstance(model, str):
      raise ApiError("model is required: a string, e.g. "
                     f"\"{MODEL_ID}\" (GET /v1/models lists it)", "model")
    self.model(model)
    return model, body

  def _params(self, body, max_tokens_name, logprobs) -> SamplingParams:
    """The sampling parameters a request names; ApiError naming the field
    for a value out of bounds."""
    lim = self.service.limits
    values = {k: body[k] for k in _PARAM_NAMES & set(body)
              if body[k] is not None and k not in (
                  "stop", "logit_bias", "logprobs", "max_new_tokens",
                  "stop_token_ids", "allowed_token_ids")}
    max_tokens = body.get(max_tokens_name)
    if max_tokens is None and max_tokens_name != "max_tokens":
      max_tokens = body.get("max_tokens")  # chat's older name
    if max_tokens is None:  # completions: OpenAI's 16; chat: to a stop
      max_tokens = 16 if max_tokens_name == "max_tokens" else (
          lim.max_new_tokens)
    values["max_new_tokens"] = max_tokens
    values["stop"] = parse_stops(body.get("stop"))
    values["logit_bias"] = parse_logit_bias(body.get("logit_bias"))
    values["logprobs"] = logprobs
    values["stop_token_ids"] = parse_token_ids(body.get("stop_token_ids"),
                                               "stop_token_ids")
    allowed = body.get("allowed_token_ids")
    if allowed == []:
      raise ApiError("allowed_token_ids must name at least one token id "
                     "(or be left out)", "allowed_token_ids")
    values["allowed_token_ids"] = parse_token_ids(allowed,
                                                  "allowed_token_ids")
    names = {"max_new_tokens": max_tokens_name}
    try:
      params = SamplingParams(**values)
      params.check(self.service.vocab_size)
    except ParamError as e:
      raise ApiError(f"{names.get(e.field, e.field)}: {e.reason}",
                     names.get(e.field, e.field)) from None
    except TypeError as e:  # e.g. a list where a number belongs
      raise ApiError(str(e)) from None
    if params.max_new_tokens > lim.max_new_tokens:
      raise ApiError(f"{max_tokens_name}={params.max_new_tokens} is too many "
                     f"tokens: this server generates at most "
                     f"{lim.max_new_tokens}", max_tokens_name)
    return params

  def _n(self, body, rows_per_choice: int) -> int:
    lim, slots = self.service.limits, self.service.engine.slots
    n = _int(body, "n", 1, 1, slots)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
      raise ApiError(f"best_of={json.dumps(best_of)}: this server returns "
                     "every completion it draws, so best_of must equal n",
                     "best_of")
    if rows_per_choice * n > lim.max_rows:
      raise ApiError(f"{rows_per_choice} prompt(s) x n={n} is more than "
                     f"{lim.max_rows} rows", "n" if n > 1 else "prompt")
    return n

  def _stream(self, body) -> dict:
    """Request's stream, include_usage and continuous_usage."""
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
      raise ApiError("stream_options must be an object", "stream_options")
    if options and not stream:
      raise ApiError("stream_options is only for a stream: send "
                     "\"stream\": true, or leave stream_options out",
                     "stream_options")
    options = options or {}
    usage, every = (_flag(options, "include_usage"),
                    _flag(options, "continuous_usage_stats"))
    if every and not usage:  # vLLM would send no usage at all
      raise ApiError("stream_options: continuous_usage_stats needs "
                     "\"include_usage\": true as well", "stream_options")
    if stream and body.get("prompt_logprobs") is not None:
      raise ApiError("prompt_logprobs are not sent in a stream: leave out "
                     "\"stream\" or prompt_logprobs", "prompt_logprobs")
    return {"stream": stream, "include_usage": usage,
            "continuous_usage": every}

  @staticmethod
  def _token_fields(body) -> dict:
    """return_token_ids and return_tokens_as_token_ids."""
    return {"token_ids": _flag(body, "return_token_ids"),
            "tokens_as_ids": _flag(body, "return_tokens_as_token_ids")}

  def _truncation(self, body) -> tuple[int, str] | None:
    """vLLM's truncate_prompt_tokens (-1: the longest prompt this server
    takes) and truncation_side ("left", the default, keeps the last
    tokens; "right" the first) as (tokens kept, side); None: no cut."""
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
      raise ApiError("truncation_side must be \"left\" (keep the last "
                     "tokens) or \"right\" (keep the first)",
                     "truncation_side")
    keep, limit = (body.get("truncate_prompt_tokens"),
                   self.service.limits.max_prompt_tokens)
    if keep is None:
      return None
    if not _is_id(keep) or not (keep == -1 or 1 <= keep <= limit):
      raise ApiError(f"truncate_prompt_tokens={json.dumps(keep)[:40]} must "
                     f"be -1 (keep at most {limit}, the longest prompt this "
                     f"server takes) or a whole number in [1, {limit}]",
                     "truncate_prompt_tokens")
    return (limit if keep == -1 else keep), side or "left"

  def completions(self, body) -> Request:
    """A /v1/completions request, or ApiError naming the field at fault."""
    model, body = self._common(body, "/v1/completions", COMPLETION_FIELDS)
    if body.get("suffix"):
      raise ApiError("suffix: this server completes text at its end only",
                     "suffix")
    if "prompt" not in body:
      raise ApiError("prompt is required: a string, a list of strings, a "
                     "list of token ids or a list of lists", "prompt")
    prompts = self._prompts(body["prompt"], self._truncation(body))
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _flag(body, "echo")
    params = self._params(body, "max_tokens", logprobs)
    asked = params.prompt_logprobs
    if echo and logprobs is not None and asked is None:
      params = dataclasses.replace(params, prompt_logprobs=logprobs)
    n = self._n(body, len(prompts))
    return Request(model, prompts, params, n, echo=echo, logprobs=logprobs,
                   prompt_logprobs=asked, **self._stream(body),
                   **self._token_fields(body))

  def chat(self, body) -> Request:
    """A /v1/chat/completions request."""
    model, body = self._common(body, "/v1/chat/completions", CHAT_FIELDS)
    form, messages = self.chat_form(body), body.get("messages")
    prompt = self._prompt_text(self.transcript(messages, **form),
                               "messages", self._truncation(body))
    # As vLLM: a reply that opens no turn speaks as the last message, and
    # echo repeats the last message before the reply when it is that role's.
    role = ("assistant" if form["add_generation_prompt"]
            else messages[-1]["role"])
    prefix = (_content(messages[-1]) if _flag(body, "echo")
              and messages[-1]["role"] == role else "")
    want = _flag(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top and not want:
      raise ApiError("top_logprobs needs \"logprobs\": true",
                     "top_logprobs")
    params = self._params(body, "max_completion_tokens", top if want else None)
    params = dataclasses.replace(
        params, stop=params.stop + self.chat_stops())
    n = self._n(body, 1)
    return Request(model, [prompt], params, n, chat=True,
                   logprobs=top if want else None,
                   prompt_logprobs=params.prompt_logprobs, role=role,
                   reply_prefix=prefix, **self._stream(body),
                   **self._token_fields(body))

  def _prompt_text(self, text: str, field: str, truncation=None) -> Prompt:
    if not text:
      raise ApiError(f"{field}: a prompt is empty: send some text", field)
    try:
      ids = self.service.encode(text)
    except (UserError, ValueError) as e:  # characters the model never saw
      raise ApiError(f"{field}: {e}", field) from None
    return self._check_length(Prompt(text, ids), field, truncation)

  def _check_length(self, prompt: Prompt, field: str,
                    truncation=None) -> Prompt:
    """The prompt cut to truncate_prompt_tokens (its text then the kept
    tokens' decoding, as a token-id prompt's is); ApiError if too long."""
    if truncation is not None and len(prompt.ids) > truncation[0]:
      keep, side = truncation
      ids = prompt.ids[-keep:] if side == "left" else prompt.ids[:keep]
      prompt = Prompt(self.service.tokenizer.decode(
          [int(i) for i in ids]), ids)
    limit = self.service.limits.max_prompt_tokens
    if len(prompt.ids) > limit:
      raise ApiError(f"a prompt of {len(prompt.ids)} tokens is too many "
                     f"tokens: at most {limit}", field)
    return prompt

  def _prompts(self, value, truncation=None) -> list[Prompt]:
    """Prompts from a string, strings, token ids or lists of token ids."""
    what = ("prompt must be a string, a list of strings, a list of token "
            "ids or a list of lists of token ids")
    if isinstance(value, str):
      return [self._prompt_text(value, "prompt", truncation)]
    if not isinstance(value, list) or not value:
      raise ApiError(what, "prompt")
    if all(_is_id(v) for v in value):
      return [self._token_prompt(value, truncation)]
    if all(isinstance(v, str) for v in value):
      return [self._prompt_text(v, "prompt", truncation) for v in value]
    if all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
      return [self._token_prompt(v, truncation) for v in value]
    raise ApiError(what, "prompt")

  def _token_prompt(self, ids: list, truncation=None) -> Prompt:
    vocab = self.service.vocab_size
    if not ids:
      raise ApiError("prompt: a prompt of token ids is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ApiError(f"prompt: token id {bad[0]} is outside the vocabulary "
                     f"[0, {vocab})", "prompt")
    return self._check_length(
        Prompt(self.service.tokenizer.decode(ids), list(ids)), "prompt",
        truncation)

  # --- chat ---

  @staticmethod
  def chat_form(body) -> dict:
    """transcript()'s options from a request: add_generation_prompt (by
    default unless continue_final_message) and continue_final_message."""
    final = _flag(body, "continue_final_message")
    add = body.get("add_generation_prompt")
    if add is None:
      add = not final
    elif not isinstance(add, bool):
      raise ApiError("add_generation_prompt must be true or false",
                     "add_generation_prompt")
    if add and final:
      raise ApiError("continue_final_message and add_generation_prompt "
                     "cannot both be true: the reply either continues the "
                     "last message or opens a new one",
                     "continue_final_message")
    return {"add_generation_prompt": add, "continue_final_message": final}

  def transcript(self, messages, add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> str:
    """The prompt a chat becomes: each message through the template, then
    the template's opening for the assistant's turn; or the last message
    left open, for the reply to continue it."""
    if not isinstance(messages, list) or not messages:
      raise ApiError("messages must be a non-empty list of {role, content}",
                     "messages")
    parts = []
    for m in messages:
      if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        raise ApiError("every message needs a role and a content",
                       "messages")
      parts.append(self.chat_template.format(role=m["role"],
                                             content=_content(m)))
    if continue_final_message:
      parts[-1] = self.opening(messages[-1]["role"]) + _content(messages[-1])
    return "".join(parts) + (self.opening("assistant")
                             if add_generation_prompt else "")

  def opening(self, role: str) -> str:
    """The template's text before a message of `role`."""
    return self.chat_template.split("{content}")[0].format(role=role)

  def chat_stops(self) -> tuple:
    """Stop strings that end the assistant's turn: the next user turn."""
    after = self.chat_template.split("{content}")[1]
    return (after + self.opening("user").rstrip(),) if after else ()


def _is_id(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _content(message) -> str:
  content = message.get("content")
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(
      isinstance(p, dict) and p.get("type") == "text"
      and isinstance(p.get("text"), str) for p in content):
    return "".join(p["text"] for p in content)
  raise ApiError("a message's content must be a string or a list of text "
                 "parts: this model reads text only", "messages")


def check_chat_template(template: str) -> None:
  """ValueError unless the template formats {role} and {content} once."""
  if template.count("{content}") != 1:
    raise ValueError("serve.chat_template must hold {content} once, e.g. "
                     f"{DEFAULT_CHAT_TEMPLATE!r}")
  try:
    template.format(role="user", content="x")
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(f"serve.chat_template does not format ({e}): use "
                     "{role} and {content} only, braces doubled elsewhere"
                     ) from None


