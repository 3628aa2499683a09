"""The answers of the OpenAI routes: completion and chat objects, whole or as
server-sent events, with OpenAI's log-probability objects.

Log-probabilities are the model's own (temperature 1, before penalties and
filters), the numbers --mode=score computes. A stream's events share one
prebuilt head: only the choice is encoded per event.
"""

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

  def _echo_text(self, row) -> str:
    return row.prompt if self.req.echo else ""

  def _logprobs(self, row, tokens: range, echo: bool) -> dict:
    """The logprobs object for generated `tokens` (and the prompt's first
    when echo)."""
    n, ids, lps, tops, offsets = self.req.logprobs, [], [], [], []
    if echo:
      ids += list(row.ids)
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
    text = self.tokenizer.token_text
    words = [text(t) for t in tokens]
    top_dicts = []
    for word, lp, top in zip(words, logprobs, tops):
      if top is None:
        top_dicts.append(None)
        continue
      entry = {text(i): v for i, v in top[:n]}
      entry.setdefault(word, lp)
      top_dicts.append(entry)
    return {"tokens": words, "token_logprobs": list(logprobs),
            "top_logprobs": top_dicts, "text_offset": list(offsets)}

  def _chat_logprobs(self, tokens, logprobs, tops, n) -> dict:
    """Chat's `logprobs` object: {"content": [{token, logprob, bytes,
    top_logprobs}]}."""
    text = self.tokenizer.token_text
    entry = lambda t, v: {"token": text(t), "logprob": v,
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
    prompt = sum(prompts.values())
    completion = sum(r.completion_tokens for r in rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

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
            "role": "assistant", "content": row.text}, "logprobs": lp,
                        "finish_reason": row.finish_reason})
      else:
        choices.append({"text": self._echo_text(row) + row.text, "index": i,
                        "logprobs": lp, "finish_reason": row.finish_reason})
        if self.req.prompt_logprobs is not None:
          choices[-1]["prompt_logprobs"] = self._prompt_logprobs(row)
    answer = {"id": self.id,
              "object": "chat.completion" if self.req.chat else
                        "text_completion",
              "created": self.created, "model": self.req.model,
              "choices": choices, "usage": self.usage(rows)}
    if self.req.chat and self.req.prompt_logprobs is not None:
      # One prompt for every choice: vLLM sends it beside them.
      answer["prompt_logprobs"] = self._prompt_logprobs(rows[0])
    return answer

  # --- server-sent events ---

  def _event(self, choice: str) -> bytes:
    return (self._head + choice + "]}\n\n").encode("utf-8")

  def _choice(self, index: int, text: str, logprobs=None, reason=None
              ) -> str:
    lp = "null" if logprobs is None else json.dumps(logprobs)
    end = "null" if reason is None else f'"{reason}"'
    if self.req.chat:
      delta = ("{}" if reason is not None and not text
               else '{"content":' + json.dumps(text) + "}")
      return (f'{{"index":{index},"delta":{delta},"logprobs":{lp},'
              f'"finish_reason":{end}}}')
    return (f'{{"text":{json.dumps(text)},"index":{index},"logprobs":{lp},'
            f'"finish_reason":{end}}}')

  def start(self, rows) -> bytes:
    """The first events: chat's assistant role, or completions' echoed
    prompts (with their log-probabilities when asked)."""
    out = []
    for (_, i), row in zip(self.req.rows(), rows):
      if self.req.chat:
        out.append(self._event(
            f'{{"index":{i},"delta":{{"role":"assistant","content":""}},'
            '"logprobs":null,"finish_reason":null}'))
      elif self.req.echo:
        lp = (self._logprobs(row, range(0), True)
              if self.req.logprobs is not None else None)
        out.append(self._event(self._choice(i, row.prompt, lp)))
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
    index = [i for _, i in self.req.rows()]
    out = []
    for r, (text, first, last) in texts.items():
      lp = None
      if self.req.logprobs is not None and first is not None:
        lp = self._logprobs(rows[r], range(first, last), False)
      if text or lp is not None:
        out.append(self._event(self._choice(index[r], text, lp)))
    for r, reason in ends:
      out.append(self._event(self._choice(index[r], "", None, reason)))
    return b"".join(out)

  def end(self, rows) -> bytes:
    """The usage event (stream_options.include_usage), then [DONE]."""
    tail = b"data: [DONE]\n\n"
    if not self.req.include_usage:
      return tail
    usage = json.dumps(self.usage(rows))
    return (self._head + '],"usage":' + usage + "}\n\n").encode() + tail
