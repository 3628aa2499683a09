"""Evaluation: loss, perplexity and accuracy over a whole split.

The split is cut into `batch_size` contiguous rows and read in `seq_len`
windows with the carry passed along, so every token (but the < batch_size left
over when the split does not divide into rows) is scored with its full left
context. The last, shorter window is scored too. Perplexity is
exp(summed loss / token count) over the split.
"""

import functools
import time

import jax
import numpy as np

from zebra_jax import checkpoint, metrics, model, parallel, setup, writer
from zebra_jax.errors import UserError


def eval_step(params, carry, inputs, targets, *, graphdef):
  """One window without dropout: (new carry, metric sums)."""
  logits, carry = model.apply(graphdef, params, inputs, carry)
  return carry, metrics.token_sums(logits, targets)


class Evaluator:
  """Scores token-id splits with a fixed batch and window on the mesh."""

  def __init__(self, graphdef, mesh, model_cfg, batch_size: int, seq_len: int):
    parallel.check_batch(batch_size, "eval.batch_size")
    self.mesh, self.batch_size, self.seq_len = mesh, batch_size, seq_len
    self.model_cfg = model_cfg
    self.graphdef = graphdef
    rep, bat = parallel.replicated(mesh), parallel.batch_sharded(mesh)
    self._step = jax.jit(functools.partial(eval_step, graphdef=graphdef),
                         in_shardings=(rep, bat, bat, bat),
                         out_shardings=(bat, rep), donate_argnums=1)

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
    carry = jax.device_put(model.init_carry(self.model_cfg, self.batch_size),
                           parallel.batch_sharded(self.mesh))
    starts = list(range(0, rows.shape[1] - 1, self.seq_len))
    if max_batches:
      starts = starts[:max_batches]
    sums, start_time = [], time.perf_counter()
    for start in starts:
      end = min(start + self.seq_len, rows.shape[1] - 1)
      inputs = parallel.global_batch(self.mesh, rows[:, start:end])
      targets = parallel.global_batch(self.mesh, rows[:, start + 1:end + 1])
      carry, s = self._step(params, carry, inputs, targets)
      sums.append(s)  # Stays on device: no host sync per window.
    host = jax.device_get(sums)
    total = {k: float(np.sum([h[k] for h in host], dtype=np.float64))
             for k in ("loss_sum", "correct", "count")}
    out = metrics.summarize(total["loss_sum"], total["correct"], total["count"])
    out["seconds"] = time.perf_counter() - start_time
    return out


def run(cfg, workdir: str, splits_to_eval=("valid", "test")) -> dict:
  """--mode=eval: scores the workdir's best checkpoint on valid and test."""
  loaded = setup.load_for_inference(cfg, workdir)
  mesh = parallel.make_mesh()
  evaluator = Evaluator(loaded.graphdef, mesh, loaded.cfg.model,
                        cfg.eval.batch_size, cfg.eval.seq_len)
  log = writer.MetricWriter(workdir, tensorboard=False)
  results = {}
  for split in splits_to_eval:
    res = evaluator.run(loaded.params, loaded.splits[split])
    results[split] = res
    log.eval_summary(split, loaded.step, res)
  log.close()
  return results
