"""--mode=sample: generate text from one or several prompts with a trained workdir.

Every row (prompt x num_samples) is one request to the serving engine
(zebra_jax.inference.engine), the same one `--mode=serve` and the Triton
model run: prompts enter in fixed-size chunks, then every decode call
advances every row, each with its own settings and random stream (row j of
a prompt draws from its own stream of the seed). So a prompt's text is the
same here, through the server and alone, whatever ran beside it. The cost
per token does not grow with the length of the text: each new token is one
step of the recurrence with the (h, c) carry.
"""

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.inference import engine as engines
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
  chunk: int = 32         # --mode=sample's tokens per decode call

  @classmethod
  def from_config(cls, sample_cfg) -> "Options":
    """config.sample's values (config/base.py defines every field)."""
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


def _consume_prompt(params, tokens, carry, *, graphdef, mesh=None):
  """Runs prompts [B, T] through the model: (last logits [B, V], carry)."""
  return lm.last_logits(graphdef, params, tokens, carry, mesh=mesh)


ENGINE_FIELDS = ("slots", "queue", "prefill_chunk", "prefill_rows",
                 "decode_block")


def engine_options(cfg, **overrides) -> dict:
  """The engine's sizes from cfg.serve (slots, queue, chunks), overridden."""
  serve = cfg.get("serve", {})
  defaults = {"slots": 64, "queue": 256, "prefill_chunk": 16,
              "prefill_rows": 16, "decode_block": 4}
  out = {k: int(serve.get(k, v)) for k, v in defaults.items()}
  out.update(overrides)
  return out


class Generator:
  """A loaded model placed for inference, and the engine it generates with.

  Needs (config, tokenizer, params) only: `from_parts` builds one without a
  workdir (training's periodic samples). The engine compiles its programs
  when first used, once per Generator.
  """

  def __init__(self, loaded: loading.Loaded, **engine_overrides):
    self.loaded, self.tokenizer = loaded, loaded.tokenizer
    # One device, or the run's stripe devices (loading.placement).
    place = loading.placement(loaded)
    self.params = place.params
    self._consume = jax.jit(functools.partial(
        _consume_prompt, graphdef=loaded.graphdef, mesh=place.mesh))
    self.step_fn = functools.partial(lm.decode_step, graphdef=loaded.graphdef,
                                     mesh=place.mesh)
    self._engine_options = engine_options(loaded.cfg, **engine_overrides)
    self._engine = None
    self._engine_lock = threading.Lock()

  @classmethod
  def from_parts(cls, cfg, tokenizer, graphdef, params,
                 **engine_overrides) -> "Generator":
    """A generator from a config, its tokenizer and parameters alone."""
    return cls(loading.Loaded(cfg, tokenizer, graphdef, params, 0),
               **engine_overrides)

  def engine_model(self) -> engines.Model:
    """What the engine needs of this model."""
    return engines.Model(
        step_fn=self.step_fn, params=self.params,
        init_carry=functools.partial(lm.init_carry, self.loaded.cfg.model),
        vocab_size=int(self.loaded.cfg.model.vocab_size),
        tokenizer=self.tokenizer)

  @property
  def engine(self) -> engines.Engine:
    """The running batch every generate() goes through (built on first use)."""
    with self._engine_lock:
      if self._engine is None:
        self._engine = engines.Engine(self.engine_model(),
                                      **self._engine_options)
      return self._engine

  def set_params(self, params) -> None:
    """New weights, laid out as the old ones (one device, or split over the
    stripe devices): the compiled programs stay valid."""
    self.params = jax.device_put(
        params, jax.tree.map(lambda a: a.sharding, self.params))
    if self._engine is not None:
      self._engine.model.params = self.params

  def close(self) -> None:
    if self._engine is not None:
      self._engine.close()

  def encode(self, prompt: str) -> np.ndarray:
    if not prompt:
      raise UserError("a prompt is empty: pass some text, e.g. --prompt='The '")
    return np.asarray(self.tokenizer.encode_prompt(prompt), np.int32)

  def prime(self, rows: list[np.ndarray],
            track_seen: bool = True) -> sampling.DecodeState:
    """Consumes every row's prompt as one window: the DecodeState to run
    `sampling.generate_chunk` from (the generation benchmark times that
    model-level loop; requests go through the engine).

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
      on_text: optional callback(row, new_text), called as row 0's text
        grows (for streaming; from the engine's thread).

    Returns:
      one string per row: prompt + generated text, cut before `stop`.
    """
    options.check()
    if not prompts:
      raise UserError("no prompts given: pass --prompt or --prompt_file")
    # A UserError for text the model cannot read, before any row runs.
    ids = {p: self.encode(p) for p in prompts}
    settings = to_settings(options)
    rows = [(p, j) for p in prompts for j in range(options.num_samples)]
    engine = self.engine
    done = []
    try:
      for i, (prompt, j) in enumerate(rows):
        stream = (lambda text: on_text(0, text)) if (
            on_text is not None and i == 0) else None
        done.append(engine.submit(
            prompt, dataclasses.replace(settings, sample_index=j),
            on_text=stream, block=True, ids=ids[prompt]))
      return [p + c.result() for (p, _), c in zip(rows, done)]
    except engines.BadPrompt as e:
      raise UserError(f"{e}") from None
    finally:
      for c in done:
        c.cancel()  # a no-op once finished; frees the rest after an error


def to_settings(options: Options, stops=()) -> engines.Settings:
  """An engine request's settings from sample Options (plus stop strings)."""
  return engines.Settings(
      max_new_tokens=int(options.max_new_tokens),
      temperature=float(options.temperature), top_k=int(options.top_k),
      top_p=float(options.top_p),
      repetition_penalty=float(options.repetition_penalty),
      seed=int(options.seed),
      stop=tuple(stops) or ((options.stop,) if options.stop else ()))


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


def run(cfg, workdir: str, prompts: list[str] | None = None, *,
        preview: bool = False) -> list[str]:
  """--mode=sample: cfg.sample's prompt, or `prompts` (from --prompt_file).

  The engine has the server's `serve.slots`, so a text here is the server's
  byte for byte (each program's arithmetic depends on its batch size).
  preview=True (training's closing sample) sizes it to the rows instead:
  every decode call computes every slot, and with a 267,735-word head one
  row's token cost 24x more at 64 slots than at 1 (376 ms against 15.7 ms,
  hidden 512, 2 CPU cores).
  """
  options = Options.from_config(cfg.sample)
  options.check()  # before loading a checkpoint
  prompts = prompts or [cfg.sample.prompt]
  stream = bool(cfg.sample.stream)
  if stream and len(prompts) * options.num_samples > 1:
    raise UserError("--config.sample.stream prints one text as it grows: use "
                    "one prompt and --config.sample.num_samples=1, or drop "
                    "--config.sample.stream")
  loaded = loading.load_for_inference(cfg, workdir)
  slots = engine_options(loaded.cfg)["slots"]
  if preview:
    slots = min(slots, len(prompts) * options.num_samples)
  generator = Generator(loaded, decode_block=options.chunk, slots=slots)
  show = jax.process_index() == 0
  header = lambda i, n: (f"----- sample {i + 1}/{n} (step {loaded.step}, "
                         f"temperature {options.temperature}) -----")
  on_text = None
  if stream and show:
    print(header(0, 1) + "\n" + prompts[0], end="", flush=True)
    on_text = lambda row, text: print(text, end="", flush=True)
  try:
    texts = generator.generate(prompts, options, on_text=on_text)
  finally:
    generator.close()
  if show and stream:
    print("\n", flush=True)
  elif show:
    for i, text in enumerate(texts):
      print(f"{header(i, len(texts))}\n{text}\n", flush=True)
  return texts
