"""--mode=score: loss and perplexity of given texts (Transformer-XL's --manual).

Each text is tokenized the way a split is (word level: `<eos>` after every
line), then read from a zero carry in windows of `eval.seq_len` with the carry
passed along: exactly what `--mode=eval` does on a split holding only that
text with `eval.batch_size=1`. The first token has no left context, so a text
of n tokens scores n - 1 predictions. `--verbose` prints the log-probability
of every predicted token.
"""

import dataclasses
import functools
import math

import jax
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.inference import loading
from zebra_jax.model import lm


def window_logprobs(params, carry, inputs, targets, *, graphdef, mesh=None):
  """log p(target | left context) for one window.

  Args:
    inputs, targets: int32 [batch, time].
  Returns:
    (new carry, float32 [batch, time] log-probabilities).
  """
  logp, carry = lm.target_log_probs(graphdef, params, inputs, targets,
                                       carry, mesh=mesh)
  return carry, logp


@dataclasses.dataclass
class TextScore:
  """One text's result; `logprobs[i]` is for token i + 1 given tokens <= i."""
  tokens: list[str]
  logprobs: np.ndarray      # float64 [len(tokens) - 1]
  char_level: bool

  @property
  def count(self) -> int:
    return len(self.logprobs)

  @property
  def log_likelihood(self) -> float:
    """Natural-log probability of the text after its first token."""
    return float(self.logprobs.sum())

  @property
  def loss(self) -> float:
    return float(-self.logprobs.sum() / self.count)

  @property
  def perplexity(self) -> float:
    return math.exp(min(self.loss, 700.0))

  def summary(self) -> dict:
    out = {"tokens": self.count, "loss": self.loss, "ppl": self.perplexity}
    if self.char_level:
      out["bpc"] = self.loss / math.log(2)
    return out


class Scorer:
  """Scores texts one at a time (batch 1) in fixed windows: one compile."""

  def __init__(self, loaded: loading.Loaded, seq_len: int):
    self.loaded, self.seq_len = loaded, int(seq_len)
    if self.seq_len <= 0:
      raise UserError(f"eval.seq_len={seq_len} must be positive: set "
                      "--config.eval.seq_len to e.g. 128")
    # One device, or the run's stripe devices (loading.placement).
    place = loading.placement(loaded)
    self.params = place.params
    self._window = jax.jit(functools.partial(
        window_logprobs, graphdef=loaded.graphdef, mesh=place.mesh))

  def score_ids(self, ids: np.ndarray) -> np.ndarray:
    """float64 [len(ids) - 1]: log-probabilities of ids[1:]."""
    ids = np.asarray(ids, np.int32)
    if ids.size < 2:
      raise UserError(f"a text of {ids.size} token(s) has nothing to score: "
                      "pass a text of at least two tokens")
    n, t = ids.size - 1, self.seq_len
    # Pad the last window to full length: later positions never change earlier
    # outputs, and every window then shares one compiled shape.
    padded = np.zeros(-(-n // t) * t + 1, np.int32)
    padded[:ids.size] = ids
    carry = lm.init_carry(self.loaded.cfg.model, 1)
    out = []
    for start in range(0, n, t):
      carry, logp = self._window(self.params, carry,
                                 padded[None, start:start + t],
                                 padded[None, start + 1:start + t + 1])
      out.append(logp[0])  # stays on device until the end: no sync per window
    return np.concatenate(jax.device_get(out)).astype(np.float64)[:n]

  def score_text(self, text: str) -> TextScore:
    tokenizer = self.loaded.tokenizer
    ids = tokenizer.encode(text)
    return TextScore([tokenizer.token_text(i) for i in ids],
                     self.score_ids(ids), tokenizer.char_level)


def read_texts(texts, text_files) -> list[tuple[str, str]]:
  """(name, text) for every --text and --text_file, in that order."""
  out = [(f"text {i + 1}", t) for i, t in enumerate(texts or [])]
  for path in text_files or []:
    try:
      with open(path, encoding="utf-8") as f:
        out.append((path, f.read()))
    except (OSError, UnicodeDecodeError) as e:
      raise UserError(f"cannot read --text_file {path}: {e}: pass a UTF-8 "
                      "text file") from None
  if not out:
    raise UserError("nothing to score: pass --text='some text' or "
                    "--text_file=PATH")
  return out


def format_line(name: str, res: dict) -> str:
  line = (f"| {name} | {res['tokens']} tokens | loss {res['loss']:.4f} "
          f"| ppl {res['ppl']:.2f}")
  return line + (f" | bpc {res['bpc']:.4f}" if "bpc" in res else "")


def format_tokens(score: TextScore) -> str:
  """One line per predicted token: position, token, log-probability."""
  return "\n".join(f"{i + 1:6d}  {score.tokens[i + 1]!r:>16}  {lp:9.4f}"
                   for i, lp in enumerate(score.logprobs))


def report(named: list[tuple[str, str]], scores: list[TextScore],
           verbose: bool = False) -> list[dict]:
  """--mode=score's printing: one summary line per (name, text) and its
  score (and every token's log-probability when verbose); returns them."""
  results = []
  for (name, _), score in zip(named, scores):
    res = {"name": name, **score.summary()}
    if verbose:
      res["token_logprobs"] = [[tok, float(lp)] for tok, lp in
                               zip(score.tokens[1:], score.logprobs)]
    results.append(res)
    if jax.process_index() == 0:
      print(format_line(name, res), flush=True)
      if verbose:
        print(format_tokens(score), flush=True)
  return results


def run(cfg, workdir: str, texts=(), text_files=(),
        verbose: bool = False) -> list[dict]:
  """Scores --text and --text_file with a workdir's model: prints and
  returns one summary per text."""
  named = read_texts(texts, text_files)
  scorer = Scorer(loading.load_for_inference(cfg, workdir), cfg.eval.seq_len)
  return report(named, [scorer.score_text(t) for _, t in named], verbose)
