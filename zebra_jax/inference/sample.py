"""--mode=sample: generate text from one or several prompts with a trained workdir.

Every row (prompt x num_samples) is one request to the serving engine
(zebra_jax.engine), the same one `--mode=serve` and the Triton
model run: prompts enter in fixed-size chunks, then every decode call
advances every row, each with its own parameters (one SamplingParams, the
server's type) and random stream (row i draws from stream i of the seed).
So a row's text is the same here and through the server, whatever ran
beside it. The cost
per token does not grow with the length of the text: each new token is one
step of the recurrence with the (h, c) carry.
"""

import dataclasses
import functools
import threading

import jax
import numpy as np

from zebra_jax.errors import UserError, read_user_file
from zebra_jax import engine as engines
from zebra_jax.inference import loading
from zebra_jax.model import lm


def sampling_params(sample_cfg, **overrides) -> engines.SamplingParams:
  """config.sample's sampling parameters (config/base.py defines and bounds
  every field), overridden; `stop` is one string there, a tuple here."""
  names = {f.name for f in dataclasses.fields(engines.SamplingParams)}
  values = {k: sample_cfg[k] for k in names if k in sample_cfg}
  values["stop"] = (values["stop"],) if values.get("stop") else ()
  values.update(overrides)
  return engines.SamplingParams(**values)


def serving_defaults(cfg) -> engines.SamplingParams:
  """What a served request gets for a parameter it does not send, from
  --mode=serve and from the exported Triton model alike: the config's
  sample group, but a fresh seed per request."""
  return sampling_params(cfg.sample, seed=None)


def check_params(params: engines.SamplingParams) -> None:
  """UserError naming the config field for a value no request can honour
  (host side, cheap: before a checkpoint loads)."""
  try:
    params.check()
  except engines.ParamError as e:
    value = getattr(params, e.field)
    raise UserError(f"--config.sample.{e.field}={value!r} {e.reason}"
                    ) from None


ENGINE_FIELDS = ("slots", "queue", "prefill_chunk", "prefill_rows",
                 "decode_block", "small_batch_blocks", "small_batch_rows",
                 "prefix_cache_bytes")


def engine_options(cfg, **overrides) -> dict:
  """The engine's sizes from cfg.serve (slots, queue, chunks), overridden."""
  serve = cfg.get("serve", {})
  defaults = {"slots": 64, "queue": 256, "prefill_chunk": 16,
              "prefill_rows": 16, "decode_block": 4,
              "small_batch_blocks": 4, "small_batch_rows": 4,
              "prefix_cache_bytes": engines.DEFAULT_PREFIX_CACHE_BYTES}
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
      self._engine.set_params(self.params)

  def close(self) -> None:
    if self._engine is not None:
      self._engine.close()

  def encode(self, prompt: str) -> np.ndarray:
    if not prompt:
      raise UserError("a prompt is empty: pass some text, e.g. --prompt='The '")
    return np.asarray(self.tokenizer.encode_prompt(prompt), np.int32)

  def generate(self, prompts: list[str], params: engines.SamplingParams,
               num_samples: int = 1, on_text=None) -> list[str]:
    """Continuations (prompt included) for every prompt x num_samples:
    `complete`'s texts after their prompts."""
    order = [p for p in prompts for _ in range(num_samples)]
    return [p + text for p, text in zip(
        order, self.complete(prompts, params, num_samples, on_text))]

  def complete(self, prompts: list[str], params: engines.SamplingParams,
               num_samples: int = 1, on_text=None) -> list[str]:
    """The generated text alone for every prompt x num_samples.

    Args:
      prompts: texts; rows are prompt-major (p0 s0, p0 s1, ..., p1 s0, ...),
        row i drawing from stream i of the seed.
      params: sampling parameters; checked here.
      on_text: optional callback(row, new_text), called as each row's text
        grows (for streaming; from the engine's thread).

    Returns:
      one string per row, cut before a stop string.
    """
    check_params(params)
    if not prompts:
      raise UserError("no prompts given: pass --prompt or --prompt_file")
    # A UserError for text the model cannot read, before any row runs.
    ids = {p: self.encode(p) for p in prompts}
    order = [p for p in prompts for _ in range(num_samples)]
    rows = [engines.Row(p, params, ids[p], i) for i, p in enumerate(order)]
    if on_text is not None:
      for i, row in enumerate(rows):
        row.on_text = lambda text, tokens, i=i: on_text(i, text)
    try:
      done = self.engine.submit_many(rows, block=True)
    except engines.BadPrompt as e:
      raise UserError(f"{e}") from None
    try:
      return [r.result() for r in done]
    finally:
      for r in done:
        r.cancel()  # a no-op once finished; frees the rest after an error


def read_prompt_file(path: str) -> list[str]:
  """One prompt per non-empty line; `\\n` inside a line stands for a newline."""
  lines = read_user_file(path, "--prompt_file", "pass a text file with one "
                         "prompt per line").splitlines()
  prompts = [l.replace("\\n", "\n") for l in lines if l.strip()]
  if not prompts:
    raise UserError(f"--prompt_file {path} holds no prompts: write one prompt "
                    "per line")
  return prompts


def checked_request(cfg, prompts: list[str] | None = None
                    ) -> tuple[engines.SamplingParams, list[str]]:
  """(cfg.sample's parameters, the prompts: `prompts` or cfg.sample.prompt),
  checked before any checkpoint loads."""
  params = sampling_params(cfg.sample)
  check_params(params)
  prompts = prompts or [cfg.sample.prompt]
  if cfg.sample.stream and len(prompts) * int(cfg.sample.num_samples) > 1:
    raise UserError("--config.sample.stream prints one text as it grows: use "
                    "one prompt and --config.sample.num_samples=1, or drop "
                    "--config.sample.stream")
  return params, prompts


def show(cfg, step: int, prompts: list[str], params: engines.SamplingParams,
         complete) -> list[str]:
  """--mode=sample's printing: each text under a header, or with
  cfg.sample.stream the one text as it grows.

  complete(on_text) generates every prompt x cfg.sample.num_samples (a
  Generator's or the Python API's `complete`); returns prompt + text each.
  """
  num_samples = int(cfg.sample.num_samples)
  stream = bool(cfg.sample.stream)
  show_here = jax.process_index() == 0
  header = lambda i, n: (f"----- sample {i + 1}/{n} (step {step}, "
                         f"temperature {params.temperature}) -----")
  on_text = None
  if stream and show_here:
    print(header(0, 1) + "\n" + prompts[0], end="", flush=True)
    on_text = lambda row, text: print(text, end="", flush=True)
  order = [p for p in prompts for _ in range(num_samples)]
  texts = [p + text for p, text in zip(order, complete(on_text))]
  if show_here and stream:
    print("\n", flush=True)
  elif show_here:
    for i, text in enumerate(texts):
      print(f"{header(i, len(texts))}\n{text}\n", flush=True)
  return texts


def run(cfg, workdir: str, prompts: list[str] | None = None, *,
        preview: bool = False) -> list[str]:
  """Training's closing sample: cfg.sample's prompt, or `prompts`.

  The engine has the server's `serve.slots`, so a text here is the server's
  byte for byte (each program's arithmetic depends on its batch size).
  preview=True sizes it to the rows instead: every decode call computes
  every slot, and with a 267,735-word head one row's token costs many times
  more among 64 slots than alone.
  """
  params, prompts = checked_request(cfg, prompts)  # before loading
  loaded = loading.load_for_inference(cfg, workdir)
  slots = engine_options(loaded.cfg)["slots"]
  if preview:
    slots = min(slots, len(prompts) * int(cfg.sample.num_samples))
  generator = Generator(loaded, decode_block=int(cfg.sample.chunk),
                        slots=slots)
  try:
    return show(cfg, loaded.step, prompts, params,
                lambda on_text: generator.complete(
                    prompts, params, int(cfg.sample.num_samples),
                    on_text=on_text))
  finally:
    generator.close()
