"""Evaluation: loss, perplexity and accuracy over a whole split.

The split is cut into `batch_size` contiguous rows and read in `seq_len`
windows with the carry passed along, so every token (but the < batch_size left
over when the split does not divide into rows) is scored with its full left
context. The last, shorter window is scored too. Perplexity is
exp(summed loss / token count) over the split, never a mean of per-window
values; char-level runs also report bits per character (loss / ln 2).

Windows are summed on the devices and added up once on the host in float64,
so the numbers do not depend on how many devices share the batch.
"""

import functools
import math
import time

import jax
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.inference import loading
from zebra_jax.model import lm, metrics
from zebra_jax.runtime import parallel, writer


_WINDOWS_IN_FLIGHT = 8  # enough to hide dispatch, few enough to never stall


def eval_step(params, carry, inputs, targets, *, graphdef):
  """One window without dropout: (new carry, metric sums)."""
  sums, carry = lm.token_sums(graphdef, params, inputs, targets, carry)
  return carry, sums


class Evaluator:
  """Scores token-id splits with a fixed batch and window on the mesh."""

  def __init__(self, graphdef, mesh, model_cfg, batch_size: int, seq_len: int):
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
    step = functools.partial(eval_step, graphdef=graphdef)
    step = lm.with_stripe_parallel(step, mesh)
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

  def run(self, params, ids: np.ndarray, max_batches: int = 0) -> dict:
    """Sums over the split (or its first max_batches windows) -> summary."""
    rows = self.rows(ids)
    # A no-op when params already live on this mesh (tests use a smaller one).
    params = jax.device_put(params, parallel.param_shardings(self.mesh, params))
    carry = jax.device_put(lm.init_carry(self.model_cfg, self.batch_size),
                           parallel.carry_sharded(self.mesh))
    starts = list(range(0, rows.shape[1] - 1, self.seq_len))
    if max_batches:
      starts = starts[:max_batches]
    keys = ("loss_sum", "correct", "count")
    total = dict.fromkeys(keys, 0.0)
    pending, start_time = [], time.perf_counter()

    def collect():  # adds the pending windows' sums on the host, in float64
      host = jax.device_get(pending)
      for k in keys:
        total[k] += float(np.sum([h[k] for h in host], dtype=np.float64))
      pending.clear()

    for start in starts:
      end = min(start + self.seq_len, rows.shape[1] - 1)
      inputs = parallel.global_batch(self.mesh, rows[:, start:end])
      targets = parallel.global_batch(self.mesh, rows[:, start + 1:end + 1])
      carry, s = self._step(params, carry, inputs, targets)
      pending.append(s)  # stays on device: no host sync per window
      # A bounded number of windows in flight: queueing a whole split's
      # collectives at once can outrun XLA's all-reduce rendezvous timeout
      # on several devices per process.
      if len(pending) == _WINDOWS_IN_FLIGHT:
        collect()
    collect()
    out = metrics.summarize(total["loss_sum"], total["correct"], total["count"])
    out["bpc"] = out["loss"] / math.log(2)  # bits per token; per char if char
    out["seconds"] = time.perf_counter() - start_time
    out["tok_per_s"] = out["tokens"] / max(out["seconds"], 1e-9)
    return out


SPLIT_CHOICES = {"valid": ("valid",), "test": ("test",),
                 "all": ("valid", "test")}


def summary_block(split: str, step: int, res: dict, char_level: bool) -> str:
  """The Transformer-XL end-of-run block, e.g. `| test loss 3.15 | ...`."""
  rule = "=" * 89
  line = (f"| {split} at step {step} | {res['tokens']:.0f} tokens "
          f"| time {res['seconds']:.1f}s | {res['tok_per_s']:.0f} tok/s "
          f"| {split} loss {res['loss']:.2f} | {split} ppl {res['ppl']:.2f} "
          f"| {split} acc {res['acc']:.3f}")
  if char_level:
    line += f" | {split} bpc {res['bpc']:.3f}"
  return f"{rule}\n{line}\n{rule}"


def run(cfg, workdir: str, splits_to_eval=("valid", "test"),
        mesh=None) -> dict:
  """--mode=eval: scores the workdir's best checkpoint on the given splits.

  Args:
    splits_to_eval: split names, or "valid" | "test" | "all" (--split).
    mesh: defaults to every device; tests pass a 1-device mesh.
  """
  if isinstance(splits_to_eval, str):
    if splits_to_eval not in SPLIT_CHOICES:
      raise UserError(f"--split={splits_to_eval} is unknown: use one of "
                      f"{', '.join(SPLIT_CHOICES)}")
    splits_to_eval = SPLIT_CHOICES[splits_to_eval]
  loaded = loading.load_for_inference(cfg, workdir)
  mesh = mesh or parallel.make_mesh(
      stripe_devices=loaded.cfg.parallel.stripe_devices)
  evaluator = Evaluator(loaded.graphdef, mesh, loaded.cfg.model,
                        cfg.eval.batch_size, cfg.eval.seq_len)
  char_level = loaded.tokenizer.char_level
  log = writer.MetricWriter(workdir, tensorboard=False)
  results = {}
  for split in splits_to_eval:
    res = evaluator.run(loaded.params, loaded.splits[split])
    if not char_level:
      del res["bpc"]  # bits per word-token is not a number anyone compares
    results[split] = res
    log.info(summary_block(split, loaded.step, res, char_level))
    log.record(f"final_{split}", loaded.step,
                {k: res[k] for k in ("loss", "ppl", "acc", "bpc", "tokens",
                                     "seconds") if k in res})
  log.close()
  return results
