"""The answers of the OpenAI routes: completion and chat objects, whole or as
server-sent events, with OpenAI's log-probability objects and vLLM's
additions (token ids, usage on every event).

Log-probabilities are the model's own (temperature 1, before penalties and
filters), the numbers --mode=score computes. A stream's events share one
prebuilt head: only the choice (and usage) is encoded per event.
"""

import itertools
import json
import re
import time
import uuid

from zebra_jax.serving.openai_api import Request

_WORD_OR_LINE_END = re.compile(r"\n|[^\s]+")


def prompt_starts(tokenizer, ids, text: str) -> list[int]:
  """Where each prompt token starts in the echoed prompt `text`.

  Word tokens are the text's words and line breaks, in order, whatever
  the spacing and whether a word is in the vocabulary. Other tokens are
  the text as they decode (`<unk>` as one U+FFFD): each token's own text
  and what decoding puts between two, in two decodes a token rather than
  one of every prefix.
  """
  if not tokenizer.spaces_in_tokens:
    starts = [m.start() for m in _WORD_OR_LINE_END.finditer(text)]
    if len(starts) == len(ids):
      return starts
  else:
    # Tokens whose own texts join into the text (characters; most BPE
    # prompts): each starts where the ones before it end. One decode per
    # distinct id, not two per token.
    ids = [int(t) for t in ids]
    own = {i: tokenizer.decode([i]) for i in set(ids)}
    pieces = [own[i] for i in ids]
    if "".join(pieces) == text:
      starts, at = [], 0
      for piece in pieces:
        starts.append(at)
        at += len(piece)
      return starts
  starts, at, before = [], 0, None
  for i in (int(t) for t in ids):
    size = len(tokenizer.decode([i]))
    if before is not None:
      prev, prev_size = before
      at += len(tokenizer.decode([prev, i])) - prev_size - size
    starts.append(at)
    at += size
    before = (i, size)
  return starts


class Answers:
  """Completion and chat objects, whole or as server-sent events, for one
  request's rows (engine Requests, in choice order)."""

  def __init__(self, tokenizer, req: Request):
    self.req, self.tokenizer = req, tokenizer
    kind = "chatcmpl" if req.chat else "cmpl"
    self.id, self.created = f"{kind}-{uuid.uuid4().hex}", int(time.time())
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    # Every event of a stream shares this head: only the choice is encoded
    # per event.
    self._head = (f'data: {{"id":"{self.id}","object":"{kind}",'
                  f'"created":{self.created},"model":{json.dumps(req.model)},'
                  '"choices":[')
    # Per row of a stream: generated tokens sent so far, and whether its
    # prompt's token ids went out (return_token_ids: in its first event).
    self._prompt_of = [p for p, _ in req.rows()]
    self._index = [i for _, i in req.rows()]
    self._sent = [0] * len(self._index)
    self._prompt_sent = [False] * len(self._index)

  def _token(self, token_id: int) -> str:
    """A token as logprobs name it: its text, or vLLM's "token_id:N"."""
    if self.req.tokens_as_ids:
      return f"token_id:{token_id}"
    return self.tokenizer.token_text(token_id)

  def _token_names(self, ids) -> dict:
    """{id: _token(id)} for the distinct `ids`: an echoed prompt of
    hundreds of tokens names each distinct token once."""
    return {i: self._token(i) for i in set(ids)}

  def _echo_text(self, row) -> str:
    return row.prompt if self.req.echo else ""

  def _logprobs(self, row, tokens: range, echo: bool) -> dict:
    """The logprobs object for generated `tokens` (and the prompt's first
    when echo)."""
    n, ids, lps, tops, offsets = self.req.logprobs, [], [], [], []
    if echo:
      ids += row.ids.tolist()
      lps += row.prompt_logprobs
      tops += row.prompt_top
      offsets += prompt_starts(self.tokenizer, row.ids, row.prompt)
    if len(tokens):
      base = len(self._echo_text(row))
      ends = row.offsets(self.tokenizer)
      ids += row.tokens[tokens.start:tokens.stop]
      lps += row.token_logprobs[tokens.start:tokens.stop]
      tops += row.top_logprobs[tokens.start:tokens.stop]
      offsets += [base + ends.start(k) for k in tokens]
    if self.req.chat:
      return self._chat_logprobs(ids, lps, tops, n)
    return self._completion_logprobs(ids, lps, tops, n, offsets)


  def _completion_logprobs(self, tokens, logprobs, tops, n, offsets) -> dict:
    """OpenAI's completions `logprobs` object; tops[i]: [(id, logprob)]
    (None for a prompt's first token), the chosen token added to them."""
    alternatives = [top[:n] for top in tops if top is not None]
    names = self._token_names(itertools.chain(
        tokens, (i for top in alternatives for i, _ in top)))
    words = [names[t] for t in tokens]
    top_dicts = []
    for word, lp, top in zip(words, logprobs, tops):
      if top is None:
        top_dicts.append(None)
        continue
      entry = {names[i]: v for i, v in top[:n]}
      entry.setdefault(word, lp)
      top_dicts.append(entry)
    return {"tokens": words, "token_logprobs": list(logprobs),
            "top_logprobs": top_dicts, "text_offset": list(offsets)}

  def _chat_logprobs(self, tokens, logprobs, tops, n) -> dict:
    """Chat's `logprobs` object: {"content": [{token, logprob, bytes,
    top_logprobs}]}."""
    text = self.tokenizer.token_text  # bytes: the token's own text's
    entry = lambda t, v: {"token": self._token(t), "logprob": v,
                          "bytes": list(text(t).encode("utf-8"))}
    return {"content": [
        {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top[:n]]}
        for t, lp, top in zip(tokens, logprobs, tops)]}

  def _prompt_logprobs(self, row) -> list:
    """vLLM's prompt_logprobs: per prompt token null (the first), else
    {token id: {logprob, rank, decoded_token}} for the token itself and
    the N most likely."""
    n, text = self.req.prompt_logprobs, self.tokenizer.token_text
    entry = lambda i, lp, rank: {"logprob": lp, "rank": rank,
                                 "decoded_token": text(i)}
    out = []
    for t, lp, top, rank in zip(row.ids, row.prompt_logprobs, row.prompt_top,
                                row.prompt_ranks):
      if lp is None:
        out.append(None)
        continue
      tokens = {str(int(t)): entry(int(t), lp, rank)}
      for k, (i, v) in enumerate(top[:n]):
        tokens.setdefault(str(i), entry(i, v, k + 1))
      out.append(tokens)
    return out

  def usage(self, rows) -> dict:
    prompts = {}
    for (p, _), row in zip(self.req.rows(), rows):
      prompts[p] = row.prompt_tokens  # a prompt counts once, whatever n
    return _usage(sum(prompts.values()),
                  sum(r.completion_tokens for r in rows))

  def whole(self, rows) -> dict:
    """The response object once every row is done."""
    choices = []
    for (_, i), row in zip(self.req.rows(), rows):
      lp = None
      if self.req.logprobs is not None:
        lp = self._logprobs(row, range(row.completion_tokens),
                            self.req.echo and not self.req.chat)
      if self.req.chat:
        choices.append({"index": i, "message": {
            "role": self.req.role,
            "content": self.req.reply_prefix + row.text}, "logprobs": lp,
                        "finish_reason": row.finish_reason})
      else:
        choices.append({"text": self._echo_text(row) + row.text, "index": i,
                        "logprobs": lp, "finish_reason": row.finish_reason})
        if self.req.prompt_logprobs is not None:
          choices[-1]["prompt_logprobs"] = self._prompt_logprobs(row)
        if self.req.token_ids:  # vLLM puts a completion's on its choice
          choices[-1]["prompt_token_ids"] = [int(t) for t in row.ids]
      if self.req.token_ids:
        choices[-1]["token_ids"] = row.tokens[:row.completion_tokens]
    answer = {"id": self.id,
              "object": "chat.completion" if self.req.chat else
                        "text_completion",
              "created": self.created, "model": self.req.model,
              "choices": choices, "usage": self.usage(rows)}
    # One prompt for every choice of a chat: vLLM sends these beside them.
    if self.req.chat and self.req.prompt_logprobs is not None:
      answer["prompt_logprobs"] = self._prompt_logprobs(rows[0])
    if self.req.chat and self.req.token_ids:
      answer["prompt_token_ids"] = [int(t) for t in rows[0].ids]
    return answer

  # --- server-sent events ---

  def _event(self, r: int, choice: str, top: str = "") -> bytes:
    """One event for row r's `choice`, with chat's top-level fields `top`
    and, with continuous_usage_stats, its row's usage so far."""
    if self.req.continuous_usage:
      prompt = self.req.prompts[self._prompt_of[r]]
      top += ',"usage":' + json.dumps(_usage(len(prompt.ids), self._sent[r]))
    return (self._head + choice + "]" + top + "}\n\n").encode("utf-8")

  def _prompt_ids(self, r: int, rows) -> str:
    """return_token_ids: the prompt's token ids, a member of row r's first
    event (a completion's choice; a chat's event)."""
    if not self.req.token_ids or self._prompt_sent[r]:
      return ""
    self._prompt_sent[r] = True
    return ',"prompt_token_ids":' + json.dumps([int(t) for t in rows[r].ids])

  def _choice(self, r: int, text: str, logprobs=None, reason=None,
              tokens: list | None = None, extra: str = "") -> str:
    lp = "null" if logprobs is None else json.dumps(logprobs)
    end = "null" if reason is None else f'"{reason}"'
    ids = ("" if tokens is None or not self.req.token_ids
           else f',"token_ids":{json.dumps(tokens)}')
    index = self._index[r]
    if self.req.chat:
      delta = ("{}" if reason is not None and not text
               else '{"content":' + json.dumps(text) + "}")
      return (f'{{"index":{index},"delta":{delta},"logprobs":{lp},'
              f'"finish_reason":{end}{ids}}}')
    return (f'{{"text":{json.dumps(text)},"index":{index},'
            f'"logprobs":{lp},"finish_reason":{end}{ids}{extra}}}')

  def start(self, rows) -> bytes:
    """The first events: chat's role (and echo's text), or completions'
    echoed prompts (with their log-probabilities when asked)."""
    out = []
    for r, row in enumerate(rows):
      if self.req.chat:
        role = json.dumps(self.req.role)
        out.append(self._event(r, (
            f'{{"index":{self._index[r]},"delta":{{"role":{role},'
            '"content":""},"logprobs":null,"finish_reason":null}'),
                               self._prompt_ids(r, rows)))
        if self.req.reply_prefix:
          out.append(self._event(r, self._choice(r, self.req.reply_prefix)))
      elif self.req.echo:
        lp = (self._logprobs(row, range(0), True)
              if self.req.logprobs is not None else None)
        out.append(self._event(r, self._choice(
            r, row.prompt, lp, tokens=[],
            extra=self._prompt_ids(r, rows))))
    return b"".join(out)

  def chunk(self, rows, updates) -> bytes:
    """Events for [(row, new text, generated tokens it completes,
    finish_reason or None)]: one event per row's new text (a burst of
    tokens travels together), then its end."""
    texts, ends = {}, []
    for r, text, tokens, reason in updates:
      t, first, last = texts.get(r, ("", None, None))
      if len(tokens):
        first = tokens.start if first is None else first
        last = tokens.stop
      texts[r] = (t + text, first, last)
      if reason is not None:
        ends.append((r, reason))
    out = []
    for r, (text, first, last) in texts.items():
      lp = None
      sent = range(0) if first is None else range(first, last)
      if self.req.logprobs is not None and len(sent):
        lp = self._logprobs(rows[r], sent, False)
      self._sent[r] += len(sent)
      if text or lp is not None or (self.req.token_ids and len(sent)):
        out.append(self._event(r, self._choice(
            r, text, lp, tokens=rows[r].tokens[sent.start:sent.stop],
            extra="" if self.req.chat else self._prompt_ids(r, rows))))
    for r, reason in ends:
      out.append(self._event(r, self._choice(
          r, "", None, reason, tokens=[],
          extra="" if self.req.chat else self._prompt_ids(r, rows))))
    return b"".join(out)

  def end(self, rows) -> bytes:
    """The usage event (stream_options.include_usage), then [DONE]."""
    tail = b"data: [DONE]\n\n"
    if not self.req.include_usage:
      return tail
    usage = json.dumps(self.usage(rows))
    return (self._head + '],"usage":' + usage + "}\n\n").encode() + tail


def _usage(prompt: int, completion: int) -> dict:
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}
