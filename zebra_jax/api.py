"""The Python API: a trained workdir as one object that generates, scores
and evaluates.

  import zebra_jax
  model = zebra_jax.load("runs/demo")
  model.generate(["The module "], zebra_jax.SamplingParams(temperature=0.7))
  model.score(["The module imports"])[0].log_likelihood
  model.evaluate("valid")                               # perplexity

The command line's sample, score and eval modes load their model here, so
a text generated or scored from Python is the command's, byte for byte.
It stands above training (evaluation lives there) and below cli.
"""

import os
import queue
import threading
from typing import Callable, Iterator

import ml_collections

from zebra_jax.config import files
from zebra_jax.engine import SamplingParams
from zebra_jax.errors import UserError
from zebra_jax.inference import loading
from zebra_jax.inference import sample as sampling, score as scoring
from zebra_jax.runtime import rundir
from zebra_jax.training import evaluate as evaluation

SPLITS = ("valid", "test")


class Model:
  """A trained ZebraLSTM with its tokenizer, ready to generate, score and
  evaluate. Build one with `zebra_jax.load`; `close()` (or a `with` block)
  stops its serving engine's thread."""

  def __init__(self, loaded: loading.Loaded,
               settings: ml_collections.ConfigDict | None = None):
    self.loaded = loaded  # config, tokenizer, graph and params (inference/)
    # The caller's eval settings and corpus (the CLI's config); default the
    # workdir's own.
    self._settings = settings if settings is not None else loaded.cfg
    self._generator = None
    self._scorer = None
    self._lock = threading.Lock()

  @property
  def config(self) -> ml_collections.ConfigDict:
    """The workdir's config.json, with the caller's inference settings."""
    return self.loaded.cfg

  @property
  def step(self) -> int:
    """The training step of the checkpoint these parameters come from."""
    return self.loaded.step

  @property
  def tokenizer(self):
    return self.loaded.tokenizer

  @property
  def params(self):
    """The parameters: a tree of arrays, as `model.safetensors` names them
    once exported (docs/python-api.md)."""
    return self.loaded.params

  def sampling_params(self, **overrides) -> SamplingParams:
    """config.sample's parameters (the command line's defaults), overridden:
    model.sampling_params(temperature=0, max_new_tokens=50)."""
    return sampling.sampling_params(self.config.sample, **overrides)

  def generate(self, prompts: list[str], params: SamplingParams | None = None,
               *, num_samples: int = 1,
               on_text: Callable[[int, str], None] | None = None
               ) -> list[str]:
    """The text generated after each prompt (prompt not included).

    Rows are prompt-major: num_samples texts of prompts[0], then of
    prompts[1]...; row i draws from stream i of params.seed, so a row's text
    does not depend on the others. params: None takes `sampling_params()`.
    on_text(row, piece) hears each row's text as it grows (from the
    engine's thread).
    """
    _check_list(prompts, "prompts", "model.stream(prompt) streams one")
    params = params if params is not None else self.sampling_params()
    return self._generating().complete(list(prompts), params, num_samples,
                                       on_text=on_text)

  def stream(self, prompt: str, params: SamplingParams | None = None
             ) -> Iterator[str]:
    """The text generated after `prompt`, piece by piece as it is decoded:
    `"".join(model.stream(p, params)) == model.generate([p], params)[0]`."""
    pieces = queue.SimpleQueue()
    finished = object()

    def work():
      try:
        self.generate([prompt], params,
                      on_text=lambda row, piece: pieces.put(piece))
        pieces.put(finished)
      except BaseException as e:  # pylint: disable=broad-except
        pieces.put(e)  # raised again in the caller's thread

    threading.Thread(target=work, name="zebra_jax stream", daemon=True).start()
    while (piece := pieces.get()) is not finished:
      if isinstance(piece, BaseException):
        raise piece
      yield piece

  def score(self, texts: list[str]) -> list[scoring.TextScore]:
    """Each text's `log_likelihood` (natural log, of every token after the
    first given those before it), `count` of scored tokens, `loss`,
    `perplexity` and per-token `logprobs`, read in eval.seq_len windows
    from a zero state (as --mode=score)."""
    _check_list(texts, "texts", "wrap one text in a list")
    scorer = self._scoring()
    return [scorer.score_text(text) for text in texts]

  def evaluate(self, split_or_file: str = "valid") -> float:
    """The perplexity of a split of the training corpus ("valid", "test")
    or of a UTF-8 text file, as --mode=eval computes it."""
    if split_or_file in SPLITS:
      names, text_files = (split_or_file,), ()
    elif os.path.isfile(split_or_file):
      names, text_files = (), (split_or_file,)
    else:
      raise UserError(f"{split_or_file!r} is neither a split nor a file: pass "
                      f"one of {', '.join(SPLITS)} or a text file's path")
    results = evaluation.evaluations(self._settings, self.loaded, names,
                                     text_files)
    return float(results[split_or_file]["ppl"])

  def close(self) -> None:
    """Stops the engine's thread (if anything was generated)."""
    with self._lock:
      if self._generator is not None:
        self._generator.close()
        self._generator = None

  def __enter__(self) -> "Model":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _generating(self) -> sampling.Generator:
    """The serving engine's generator, with the server's slots (so a text
    is the server's and the command's byte for byte), built once."""
    with self._lock:
      if self._generator is None:
        self._generator = sampling.Generator(
            self.loaded, decode_block=int(self.config.sample.chunk))
      return self._generator

  def _scoring(self) -> scoring.Scorer:
    with self._lock:
      if self._scorer is None:
        self._scorer = scoring.Scorer(self.loaded, self._settings.eval.seq_len)
      return self._scorer


def _check_list(items, name: str, hint: str) -> None:
  if isinstance(items, str):
    raise TypeError(f"{name} is one string: pass a list of them ({hint})")


def load(workdir: str, *, step: int | None = None,
         config: ml_collections.ConfigDict | None = None) -> Model:
  """The model a training run left in `workdir`: its config.json, tokenizer
  and best checkpoint by validation loss (or `step`'s). Needs no corpus but
  to evaluate its splits.

  config: settings to run it with (eval, sample, serve, compute dtype), as
  the command line's --config; default the workdir's own.
  """
  if not os.path.exists(rundir.config_path(workdir)):
    raise UserError(f"workdir {workdir} has no config.json: train first with "
                    f"--mode=train --workdir={workdir}")
  settings = config if config is not None else files.load_saved(workdir)
  return Model(loading.load_for_inference(settings, workdir, step), settings)
