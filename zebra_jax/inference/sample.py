"""--mode=sample: generate text from one or several prompts with a trained workdir.

Each prompt is consumed once as a window; then each new token is one step of
the recurrence with the (h, c) carry, inside jitted loops (zebra_jax.inference.sampling),
so the cost per token does not grow with the length of the text.

Several prompts run as one batch. Prompts of different lengths are never
padded: rows are grouped by prompt length and each group's prompts are
consumed together, so every row starts generating from exactly the carry it
would have alone. Generation then runs in chunks of `chunk` tokens, which
lets the host print tokens as they come (`stream`) and stop every row once it
has produced the `stop` string.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.inference import loading, sampling
from zebra_jax.model import lm

@dataclasses.dataclass(frozen=True)
class Options:
  """Everything that shapes one generation request."""
  max_new_tokens: int = 100
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  repetition_penalty: float = 1.0
  stop: str = ""          # cut each row before this text; "" = off
  num_samples: int = 1    # rows per prompt
  seed: int = 0
  chunk: int = 32         # tokens per jitted call: stream / stop granularity

  @classmethod
  def from_config(cls, sample_cfg) -> "Options":
    """config.sample's values (configs/base.py defines every field)."""
    return cls(**{f.name: sample_cfg[f.name] for f in dataclasses.fields(cls)})

  def check(self) -> None:
    """UserError for a value no request can honour (host side, cheap)."""
    sampling.check_options(
        temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
        num_new_tokens=self.max_new_tokens,
        repetition_penalty=self.repetition_penalty)
    for name in ("num_samples", "chunk"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise UserError(f"{name}={value} is not a whole number >= 1: use e.g. 1")


def _consume_prompt(params, tokens, carry, *, graphdef):
  """Runs prompts [B, T] through the model: (last logits [B, V], carry)."""
  return lm.last_logits(graphdef, params, tokens, carry)


class Generator:
  """A loaded model with its jitted prompt and step functions, built once.

  Reusing one Generator (as the HTTP server does) reuses the compiled code:
  sampling caches its loop per step_fn object.
  """

  def __init__(self, loaded: loading.Loaded):
    self.loaded, self.tokenizer = loaded, loaded.tokenizer
    # One device, or the run's stripe devices (loading.placement).
    place = loading.placement(loaded)
    self.params = place.params
    self._consume = jax.jit(place.wrap(functools.partial(
        _consume_prompt, graphdef=loaded.graphdef)))
    self.step_fn = place.wrap(functools.partial(lm.decode_step,
                                                graphdef=loaded.graphdef))

  def encode(self, prompt: str) -> np.ndarray:
    if not prompt:
      raise UserError("a prompt is empty: pass some text, e.g. --prompt='The '")
    return np.asarray(self.tokenizer.encode_prompt(prompt), np.int32)

  def prime(self, rows: list[np.ndarray],
            track_seen: bool = True) -> sampling.DecodeState:
    """Consumes every row's prompt: the DecodeState to generate from.

    Rows of equal length are consumed as one batch [n, T]; the results are
    put back in row order. One compile per distinct (n, T).
    """
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(rows):
      by_length.setdefault(len(ids), []).append(i)
    order, parts = [], []
    for length, members in by_length.items():
      tokens = np.stack([rows[i] for i in members])            # [n, T]
      carry = lm.init_carry(self.loaded.cfg.model, len(members))
      parts.append(self._consume(self.params, tokens, carry))
      order.extend(members)
    inverse = np.argsort(np.asarray(order))                    # row -> place
    join = lambda *xs: jnp.concatenate(xs, axis=0)[inverse]
    last_logits, carry = jax.tree.map(join, *parts)
    # The [rows, vocab] mask only matters to the repetition penalty.
    seen = (sampling.seen_tokens(rows, self.tokenizer.vocab_size)
            if track_seen else None)
    return sampling.start_state(carry, last_logits, seen)

  def generate(self, prompts: list[str], options: Options,
               on_text=None) -> list[str]:
    """Continuations (prompt included) for every prompt x num_samples.

    Args:
      prompts: texts; rows are prompt-major (p0 s0, p0 s1, ..., p1 s0, ...).
      options: sampling settings; checked here.
      on_text: optional callback(row, new_text) called after every chunk with
        the text row 0 added (for streaming); a single-row request only.

    Returns:
      one string per row: prompt + generated text, cut before `stop`.
    """
    options.check()
    if not prompts:
      raise UserError("no prompts given: pass --prompt or --prompt_file")
    ids = [self.encode(p) for p in prompts]
    rows = [r for r in ids for _ in range(options.num_samples)]
    texts = [p for p in prompts for _ in range(options.num_samples)]
    state = self.prime(rows, track_seen=options.repetition_penalty != 1)
    key = jax.random.PRNGKey(options.seed)
    chunk = min(options.chunk, options.max_new_tokens)
    settings = dict(temperature=options.temperature, top_k=options.top_k,
                    top_p=options.top_p,
                    repetition_penalty=options.repetition_penalty)
    new = np.zeros((len(rows), 0), np.int32)
    done = np.zeros(len(rows), bool)
    streamed = 0
    while new.shape[1] < options.max_new_tokens and not done.all():
      tokens, state = sampling.generate_chunk(
          self.step_fn, self.params, state, key, new.shape[1],
          num_new_tokens=chunk, **settings)
      new = np.concatenate([new, np.asarray(jax.device_get(tokens))], 1)
      new = new[:, :options.max_new_tokens]  # the last chunk may overshoot
      if not (options.stop or on_text):
        continue  # nothing to look at before the end
      outs = [self._continuation(t, row) for t, row in zip(texts, new)]
      if options.stop:
        done |= np.array([options.stop in o for o in outs])
      if on_text is not None:
        safe = _stream_safe(outs[0], options.stop, final=bool(done[0]))
        if len(safe) > streamed:
          on_text(0, safe[streamed:])
          streamed = len(safe)
    outs = [_cut(self._continuation(t, row), options.stop)
            for t, row in zip(texts, new)]
    if on_text is not None and len(outs[0]) > streamed:
      on_text(0, outs[0][streamed:])
    return [t + o for t, o in zip(texts, outs)]

  def _continuation(self, prompt: str, ids) -> str:
    """Decoded new tokens. Word tokens need a space after the prompt; char
    and byte-level BPE tokens carry their own spaces (" world" is one BPE
    token), so they are joined as they are."""
    text = self.tokenizer.decode(ids)
    if (self.tokenizer.spaces_in_tokens or not text
        or prompt[-1:].isspace()):
      return text
    return " " + text


def _cut(text: str, stop: str) -> str:
  return text.split(stop, 1)[0] if stop else text


def _stream_safe(text: str, stop: str, final: bool) -> str:
  """The part of `text` that can be printed now: before a stop string found,
  holding back a tail that might be the start of one still to come, and a
  trailing U+FFFD (a UTF-8 character whose other BPE bytes are still to come:
  the next chunk decodes it whole)."""
  if not final:
    text = text.rstrip("\ufffd")
  if not stop:
    return text
  if stop in text or final:
    return _cut(text, stop)
  return text[:max(0, len(text) - len(stop) + 1)]


def read_prompt_file(path: str) -> list[str]:
  """One prompt per non-empty line; `\\n` inside a line stands for a newline."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise UserError(f"cannot read --prompt_file {path}: {e.strerror}: pass a "
                    "text file with one prompt per line") from None
  prompts = [l.replace("\\n", "\n") for l in lines if l.strip()]
  if not prompts:
    raise UserError(f"--prompt_file {path} holds no prompts: write one prompt "
                    "per line")
  return prompts


def generate_text(loaded: loading.Loaded, prompt: str, *, max_new_tokens: int,
                  temperature: float, top_k: int, top_p: float,
                  num_samples: int, seed: int) -> list[str]:
  """Returns num_samples continuations (prompt included) of `prompt`."""
  return Generator(loaded).generate([prompt], Options(
      max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
      top_p=top_p, num_samples=num_samples, seed=seed))


def run(cfg, workdir: str, prompts: list[str] | None = None) -> list[str]:
  """--mode=sample: cfg.sample's prompt, or `prompts` (from --prompt_file)."""
  options = Options.from_config(cfg.sample)
  options.check()  # before loading a checkpoint
  prompts = prompts or [cfg.sample.prompt]
  stream = bool(cfg.sample.stream)
  if stream and len(prompts) * options.num_samples > 1:
    raise UserError("--config.sample.stream prints one text as it grows: use "
                    "one prompt and --config.sample.num_samples=1, or drop "
                    "--config.sample.stream")
  loaded = loading.load_for_inference(cfg, workdir)
  generator = Generator(loaded)
  show = jax.process_index() == 0
  header = lambda i, n: (f"----- sample {i + 1}/{n} (step {loaded.step}, "
                         f"temperature {options.temperature}) -----")
  on_text = None
  if stream and show:
    print(header(0, 1) + "\n" + prompts[0], end="", flush=True)
    on_text = lambda row, text: print(text, end="", flush=True)
  texts = generator.generate(prompts, options, on_text=on_text)
  if show and stream:
    print("\n", flush=True)
  elif show:
    for i, text in enumerate(texts):
      print(f"{header(i, len(texts))}\n{text}\n", flush=True)
  return texts
