"""Evaluation: loss, perplexity and accuracy over a whole split.

The split is cut into `batch_size` contiguous rows and read in `seq_len`
windows with the carry passed along, so every token (but the < batch_size left
over when the split does not divide into rows) is scored with its full left
context. The last, shorter window is scored too. Perplexity is
exp(summed loss / token count) over the split, never a mean of per-window
values; char-level runs also report bits per character (loss / ln 2).

Windows are summed on the devices and added up once on the host in float64,
so the numbers do not depend on how many devices share the batch.

eval.max_tokens bounds a pass: every row is scored up to column
max_tokens / batch_size, so the subset still spans the whole split; the
report says so. eval.accuracy=false leaves the correct-prediction count out,
which for the adaptive head spares a full-vocabulary pass per token (its
loss reads the head and the target's own cluster only).
"""

import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zebra_jax.data import pipeline, splits as splits_lib
from zebra_jax.errors import UserError
from zebra_jax.inference import loading
from zebra_jax.model import adaptive_softmax as asm, lm, metrics
from zebra_jax.model.config import ModelConfig
from zebra_jax import progress
from zebra_jax.runtime import parallel, writer


_WINDOWS_IN_FLIGHT = 8  # enough to hide dispatch, few enough to never stall
_LINE_EVERY_S = 10.0  # progress lines off a terminal (long CPU evaluations)


def eval_step(params, carry, inputs, targets, *, graphdef,
              accuracy: bool = True, head_width: int = 0, mesh=None):
  """One window without dropout: (new carry, metric sums).

  head_width: the head's widest logits block (the vocabulary, or the
  adaptive head's shortlist and clusters). The head then scores the window
  a few time steps at a time (`head_steps`), so its temporaries stay within
  the platform's budget whatever the window: a CPU scoring a whole window
  of a 267k vocabulary at once held a large block of them, which the
  process's heap kept as its high-water mark.
  """
  model = nnx.merge(graphdef, params)
  rows = model.rows(inputs.shape[0], mesh)
  hidden, carry = model.features(inputs, carry, rows=rows)
  b, t = targets.shape
  k = head_steps(b, t, head_width)
  if k == t:
    return carry, model.token_sums(hidden, targets, accuracy, rows)
  split = lambda a: jnp.swapaxes(a.reshape(b, t // k, k, *a.shape[2:]), 0, 1)

  def score(total, chunk):
    sums = model.token_sums(*chunk, accuracy, rows)
    return jax.tree.map(jnp.add, total, sums), None

  zeros = jax.tree.map(
      lambda a: jnp.zeros(a.shape, a.dtype),
      jax.eval_shape(lambda: model.token_sums(hidden[:, :k], targets[:, :k],
                                              accuracy, rows)))
  sums, _ = jax.lax.scan(score, zeros, (split(hidden), split(targets)))
  return carry, sums


def head_steps(batch: int, steps: int, head_width: int) -> int:
  """Time steps the head scores at once: the largest divisor of `steps`
  whose batch x steps rows of head_width float32 logits fit the
  platform's block budget (adaptive_softmax.CHUNK_BUDGET_BYTES); all of
  them when head_width is 0 or they fit."""
  if not head_width:
    return steps
  budget = asm.CHUNK_BUDGET_BYTES.get(jax.default_backend(),
                                      asm.ACCELERATOR_CHUNK_BUDGET_BYTES)
  most = max(1, budget // (4 * head_width * batch))
  return max(k for k in range(1, min(steps, most) + 1) if steps % k == 0)


def head_width(model_cfg) -> int:
  """The head's widest logits row: the vocabulary, or the adaptive head's
  shortlist plus one logit per tail cluster (its tails run in chunks of
  their own)."""
  m = ModelConfig.of(model_cfg)
  if m.head != "adaptive":
    return m.vocab_size
  bounds = asm.cluster_bounds(m.vocab_size, m.adaptive_cutoffs)
  return bounds[0][1] + len(bounds) - 1


class Evaluator:
  """Scores token-id splits with a fixed batch and window on the mesh."""

  def __init__(self, graphdef, mesh, model_cfg, batch_size: int, seq_len: int,
               accuracy: bool = True):
    rows = mesh.shape[parallel.DATA_AXIS]  # devices that split the batch
    if batch_size <= 0 or batch_size % rows:
      raise UserError(
          f"eval.batch_size={batch_size} does not divide over {rows} "
          f"devices: set --config.eval.batch_size to a multiple of {rows}")
    if seq_len <= 0:
      raise UserError(f"eval.seq_len={seq_len} must be positive: set "
                      "--config.eval.seq_len to e.g. 128")
    self.mesh, self.batch_size, self.seq_len = mesh, batch_size, seq_len
    self.model_cfg = model_cfg
    self.graphdef = graphdef
    rep, bat = parallel.replicated(mesh), parallel.batch_sharded(mesh)
    carry = parallel.carry_sharded(mesh)
    step = functools.partial(eval_step, graphdef=graphdef,
                             accuracy=accuracy,
                             head_width=head_width(model_cfg), mesh=mesh)
    # Params come replicated, or split over "stripe" as in training.
    params_in = rep if parallel.stripe_devices(mesh) == 1 else None
    self._step = jax.jit(step, in_shardings=(params_in, carry, bat, bat),
                         out_shardings=(carry, rep), donate_argnums=1)

  def rows(self, ids: np.ndarray) -> np.ndarray:
    """This process's rows of the split, [local_batch, row_len]."""
    row_len = len(ids) // self.batch_size
    if row_len < 2:
      raise UserError(
          f"a split of {len(ids)} tokens is too short for eval.batch_size="
          f"{self.batch_size}: lower --config.eval.batch_size")
    rows = np.asarray(ids[: row_len * self.batch_size]).reshape(
        self.batch_size, row_len)
    local = self.batch_size // jax.process_count()
    return rows[jax.process_index() * local:(jax.process_index() + 1) * local]

  def run(self, params, ids: np.ndarray, max_batches: int = 0,
          max_tokens: int = 0, label: str = "eval") -> dict:
    """Sums over the split -> summary.

    max_batches: only the first windows (in-loop evaluation); max_tokens:
    every row up to column max_tokens / batch_size (at least one token a
    row); 0 = no limit. The summary's "split_tokens" is what the whole
    split would have scored. Off a terminal a long pass prints a progress
    line every 10 s, named `label`.
    """
    rows = self.rows(ids)
    # A no-op when params already live on this mesh (tests use a smaller one).
    params = jax.device_put(params, parallel.param_shardings(self.mesh, params))
    carry = jax.device_put(lm.init_carry(self.model_cfg, self.batch_size),
                           parallel.carry_sharded(self.mesh))
    split_cols = rows.shape[1] - 1
    cols = split_cols
    if max_tokens:
      cols = min(cols, max(1, max_tokens // self.batch_size))
    starts = list(range(0, cols, self.seq_len))
    if max_batches:
      starts = starts[:max_batches]
      cols = min(cols, starts[-1] + self.seq_len)
    total = {"loss_sum": 0.0, "count": 0.0}
    pending, start_time = [], time.perf_counter()

    def collect():  # adds the pending windows' sums on the host, in float64
      host = jax.device_get(pending)
      for k in host[0] if host else ():
        total[k] = total.get(k, 0.0) + float(
            np.sum([h[k] for h in host], dtype=np.float64))
      pending.clear()

    bar = progress.Progress(
        self.batch_size * cols, desc=label, unit="tok",
        enabled=None if jax.process_index() == 0 else False,
        lines_every_s=_LINE_EVERY_S)
    with bar:
      for start in starts:
        end = min(start + self.seq_len, cols)
        inputs = parallel.global_batch(self.mesh, rows[:, start:end])
        targets = parallel.global_batch(self.mesh, rows[:, start + 1:end + 1])
        carry, s = self._step(params, carry, inputs, targets)
        pending.append(s)  # stays on device: no host sync per window
        # A bounded number of windows in flight: queueing a whole split's
        # collectives at once can outrun XLA's all-reduce rendezvous timeout
        # on several devices per process.
        if len(pending) == _WINDOWS_IN_FLIGHT:
          collect()
          bar.update(self.batch_size * end)
      collect()
      bar.update(self.batch_size * cols)
    out = metrics.summarize(total["loss_sum"], total.get("correct"),
                            total["count"])
    out["bpc"] = out["loss"] / math.log(2)  # bits per token; per char if char
    out["seconds"] = time.perf_counter() - start_time
    out["tok_per_s"] = out["tokens"] / max(out["seconds"], 1e-9)
    out["split_tokens"] = float(self.batch_size * split_cols)
    return out


SPLIT_CHOICES = {"valid": ("valid",), "test": ("test",),
                 "all": ("valid", "test")}


def summary_block(split: str, step: int, res: dict, char_level: bool) -> str:
  """The Transformer-XL end-of-run block, e.g. `| test loss 3.15 | ...`."""
  rule = "=" * 89
  tokens = f"{res['tokens']:.0f} tokens"
  if res.get("split_tokens", res["tokens"]) > res["tokens"]:
    tokens = (f"{res['tokens']:.0f} of {res['split_tokens']:.0f} tokens "
              f"(eval.max_tokens)")
  line = (f"| {split} at step {step} | {tokens} "
          f"| time {res['seconds']:.1f}s | {res['tok_per_s']:.0f} tok/s "
          f"| {split} loss {res['loss']:.2f} | {split} ppl {res['ppl']:.2f}")
  if res.get("acc") is not None:  # None: eval.accuracy=false
    line += f" | {split} acc {res['acc']:.3f}"
  if char_level:
    line += f" | {split} bpc {res['bpc']:.3f}"
  return f"{rule}\n{line}\n{rule}"


def run(cfg, workdir: str, splits_to_eval=("valid", "test"),
        mesh=None, text_files=(), *, loaded=None) -> dict:
  """--mode=eval: scores the workdir's best checkpoint on the given splits.

  The splits are those of the corpus cfg.data names, read with the trained
  tokenizer; text_files (--text_file) are scored whole instead. Only the
  training corpus' results are recorded in metrics.jsonl.

  Args:
    splits_to_eval: split names, or "valid" | "test" | "all" (--split).
    mesh: defaults to every device; tests pass a 1-device mesh.
    text_files: paths of UTF-8 files, each scored as one split.
    loaded: the workdir's model, already loaded (zebra_jax.load's).
  """
  names = split_names(splits_to_eval)
  check_text_files(text_files)
  loaded = loaded or loading.load_for_inference(cfg, workdir)
  log = writer.MetricWriter(workdir, tensorboard=False)
  char_level = loaded.tokenizer.char_level

  def report(split, res, trained):
    log.info(summary_block(split, loaded.step, res, char_level))
    if trained:
      log.record(f"final_{split}", loaded.step,
                 {k: res[k] for k in ("loss", "ppl", "acc", "bpc", "tokens",
                                      "split_tokens", "seconds")
                  if res.get(k) is not None})
  results = evaluations(cfg, loaded, names, text_files, mesh, info=log.info,
                        on_result=report)
  log.close()
  return results


def split_names(splits_to_eval) -> tuple[str, ...]:
  """Split names, from a tuple or from --split's "valid" | "test" | "all"."""
  if not isinstance(splits_to_eval, str):
    return tuple(splits_to_eval)
  if splits_to_eval not in SPLIT_CHOICES:
    raise UserError(f"--split={splits_to_eval} is unknown: use one of "
                    f"{', '.join(SPLIT_CHOICES)}")
  return SPLIT_CHOICES[splits_to_eval]


def check_text_files(text_files) -> None:
  for path in text_files:
    if not os.path.isfile(path):
      raise UserError(f"--text_file {path} does not exist: pass the path of "
                      "a UTF-8 text file")


def evaluations(cfg, loaded, names, text_files=(), mesh=None,
                info=lambda line: None, on_result=None) -> dict:
  """{split or file: summary}: the scoring of `run`, without its report.

  cfg gives the eval settings, `loaded` the model. info(line) hears how
  much of another corpus the vocabulary lacks; on_result(split, summary,
  trained) each result as it comes (trained: the training corpus' split).
  """
  corpus, trained = _corpus(cfg, loaded, names, text_files, info)
  mesh = mesh or parallel.make_mesh(
      stripe_devices=loaded.cfg.parallel.stripe_devices)
  evaluator = Evaluator(loaded.graphdef, mesh, loaded.cfg.model,
                        cfg.eval.batch_size, cfg.eval.seq_len,
                        accuracy=cfg.eval.accuracy)
  results = {}
  for split, ids in corpus.items():
    res = evaluator.run(loaded.params, ids, max_tokens=cfg.eval.max_tokens,
                        label=split)
    if not loaded.tokenizer.char_level:
      del res["bpc"]  # bits per word-token is not a number anyone compares
    results[split] = res
    if on_result is not None:
      on_result(split, res, trained)
  return results


def _corpus(cfg, loaded, names, text_files, info) -> tuple[dict, bool]:
  """({label: token ids} to score, whether it is the training corpus).

  Another corpus, or a text file, is read with the trained tokenizer as
  training read its valid and test splits: what the vocabulary lacks is
  <unk>, and one line says how much of it there is.
  """
  trained = pipeline.same_corpus(cfg.data, loaded.cfg.data)
  tokenizer = loaded.tokenizer
  if text_files and not trained:
    raise UserError(
        "--text_file names the text to evaluate, and the config names a "
        f"corpus other than the model's training one ({cfg.data.source} "
        f"{pipeline.make_source(cfg.data)}): pass --text_file or the "
        "--config.data.* corpus, not both")
  if text_files:
    corpus = {path: pipeline.encode_split(tokenizer,
                                          splits_lib.file_split(path, path))
              for path in text_files}
    what = ", ".join(text_files)
  elif trained:
    return {name: loaded.splits[name] for name in names}, True
  else:
    corpus = pipeline.read_with(tokenizer, cfg.data, names)
    what = f"{'/'.join(names)} of {pipeline.make_source(cfg.data)}"
  info(unknown_line(tokenizer, corpus, what))
  return corpus, False


def unknown_line(tokenizer, corpus: dict, what: str) -> str:
  """How many of the corpus' tokens the trained vocabulary lacks."""
  total = sum(int(ids.size) for ids in corpus.values())
  if tokenizer.unk_id is None:
    return f"| {what} | {total} tokens | none unknown (byte-level tokens) |"
  unknown = sum(int(np.count_nonzero(np.asarray(ids) == tokenizer.unk_id))
                for ids in corpus.values())
  return (f"| {what} | {total} tokens | {unknown} unknown to the trained "
          f"vocabulary, scored as <unk> |")
