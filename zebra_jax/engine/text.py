"""Text on the host: a row's tokens as the text that follows its prompt, stop
strings, what a stream may send yet, and which tokens that text covers."""

import bisect


def continuation(tokenizer, prompt: str, ids) -> str:
  """Decoded new tokens as they follow the prompt. Word tokens need a space
  after the prompt; char and byte-level BPE tokens carry their own spaces
  (" world" is one BPE token), so they are joined as they are."""
  text = tokenizer.decode(ids)
  if tokenizer.spaces_in_tokens or not text or prompt[-1:].isspace():
    return text
  return " " + text


def cut_at_stop(text: str, stops, start: int = 0) -> tuple[str, bool]:
  """(text before the earliest stop string that begins at `start` or
  later, whether one was found)."""
  cuts = [i for i in (text.find(s, start) for s in stops) if i >= 0]
  return (text[:min(cuts)], True) if cuts else (text, False)


def stream_safe(text: str, stops, final: bool, start: int = 0) -> str:
  """The part of `text` that can be sent now: before a stop string found,
  holding back a tail that might be the start of one still to come, and a
  trailing U+FFFD (a UTF-8 character whose other BPE bytes are still to
  come: the next tokens decode it whole). Stop strings count from
  `start`."""
  if not final:
    text = text.rstrip("\ufffd")
  text, found = cut_at_stop(text, stops, start)
  if found or final or not stops:
    return text
  hold = max(len(s) for s in stops) - 1
  return text[:max(0, len(text) - hold)]


class Offsets:
  """Where each generated token's text ends in the continuation, grown one
  token at a time: which tokens a piece of text covers, and where each
  starts (OpenAI's text_offset). Only rows that return log-probabilities
  or stop at a string pay for it (one decode per token)."""

  def __init__(self, tokenizer, prompt: str):
    self._tokenizer, self._prompt = tokenizer, prompt
    self.ends: list[int] = []

  def extend(self, ids) -> None:
    """Catches up with the row's tokens `ids` (all of them so far)."""
    for k in range(len(self.ends), len(ids)):
      text = continuation(self._tokenizer, self._prompt, ids[:k + 1])
      self.ends.append(len(text.rstrip("\ufffd")))

  def start(self, k: int) -> int:
    return self.ends[k - 1] if k else 0

  def covered(self, length: int) -> int:
    """Tokens whose text lies wholly within the first `length` chars."""
    return bisect.bisect_right(self.ends, length)

  def touching(self, length: int) -> int:
    """Tokens with at least one char within the first `length` chars (a
    stop string cut inside a token keeps that token)."""
    return bisect.bisect_left([self.start(k) for k in range(len(self.ends))],
                              length)
