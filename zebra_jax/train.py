"""Training: the train state, one jitted truncated-BPTT step, and the loop.

The loop is resumable: rerunning the same command with the same --workdir
restores params, optimizer state, step, RNG, carry and data position from the
latest checkpoint and continues with the batch an uninterrupted run would read.
"""

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from zebra_jax import checkpoint, data, evaluate, metrics, model, optim
from zebra_jax import parallel, setup, writer
from zebra_jax.train_state import TrainState, init_state
from zebra_jax.errors import UserError


def train_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef,
               tx: optax.GradientTransformation):
  """One window: (state, batch) -> (state, metric sums).

  batch: inputs/targets [batch, time] int32 and reset, a bool scalar that
  zeroes the carry (start of an epoch, or every step with random windows).
  """
  carry = jax.tree.map(lambda a: jnp.where(batch["reset"], 0.0, a), state.carry)
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    logits, new_carry = model.apply(graphdef, params, batch["inputs"], carry,
                                    dropout_rng)
    with jax.named_scope("loss"):
      sums = metrics.token_sums(logits, batch["targets"])
    return sums["loss_sum"] / sums["count"], (new_carry, sums)

  grads, (new_carry, sums) = jax.grad(loss_fn, has_aux=True)(state.params)
  with jax.named_scope("optimizer"):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
  sums["grad_norm"] = optax.tree.norm(grads)
  new_state = state.replace(step=state.step + 1, params=params,
                            opt_state=opt_state,
                            carry=jax.lax.stop_gradient(new_carry))
  return new_state, sums


def compile_train_step(graphdef, tx, mesh, state):
  shardings = parallel.state_shardings(mesh, state)
  rep, bat = parallel.replicated(mesh), parallel.batch_sharded(mesh)
  batch_shardings = {"inputs": bat, "targets": bat, "reset": rep}
  return jax.jit(functools.partial(train_step, graphdef=graphdef, tx=tx),
                 in_shardings=(shardings, batch_shardings),
                 out_shardings=(shardings, rep), donate_argnums=0)


class _Window:
  """Sums of per-step metrics since the last log line (kept on device)."""

  def __init__(self):
    self.sums, self.start, self.steps = [], time.perf_counter(), 0

  def flush(self) -> tuple[dict[str, float], float, int]:
    host = jax.device_get(self.sums)
    total = {k: float(np.sum([h[k] for h in host], dtype=np.float64))
             for k in host[0]}
    elapsed, steps = time.perf_counter() - self.start, self.steps
    self.__init__()
    return total, elapsed, steps


def run(cfg: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains until num_steps (or the time budget); returns the run summary."""
  cfg, tokenizer, splits = setup.prepare(cfg, workdir)
  mesh = parallel.make_mesh()
  parallel.check_batch(cfg.data.batch_size, "data.batch_size")
  graphdef, tx, state = init_state(cfg, mesh)
  log = writer.MetricWriter(workdir)
  ckpt = checkpoint.Checkpointer(workdir, cfg.checkpoint.keep_latest,
                                 cfg.checkpoint.keep_best)
  position = data.DataPosition()
  best_valid = float("inf")
  if (latest := ckpt.latest_step()) is not None:
    state, meta = ckpt.restore(latest, state)
    position = data.DataPosition.from_dict(meta["position"])
    best_valid = meta.get("best_valid_loss", best_valid)
    log.info(f"resuming from checkpoint at step {latest} "
             f"(epoch {position.epoch}, batch {position.index})")
  batcher = data.make_batcher(cfg.data, splits["train"], cfg.seed,
                              jax.process_index(), jax.process_count())
  step_fn = compile_train_step(graphdef, tx, mesh, state)
  evaluator = evaluate.Evaluator(graphdef, mesh, cfg.model,
                                 cfg.eval.batch_size, cfg.eval.seq_len)
  lr_at = optim.learning_rate_schedule(cfg.optim, cfg.train.num_steps)
  n_params = model.num_params(state.params)
  log.info(f"model: {n_params:,} parameters | {cfg.model.num_layers} layers x "
           f"hidden {cfg.model.hidden_size} in {cfg.model.num_stripes} stripes "
           f"| vocab {cfg.model.vocab_size} | {jax.device_count()} "
           f"{jax.devices()[0].platform} device(s)")

  step = int(state.step)
  budget_s = cfg.train.time_budget_minutes * 60.0
  started = time.perf_counter()
  window, valid, last_saved, first = _Window(), None, step, True
  evals = 0
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  random_windows = cfg.data.batching == "random"
  while step < cfg.train.num_steps:
    if budget_s and time.perf_counter() - started > budget_s:
      log.info(f"time budget of {cfg.train.time_budget_minutes} min reached")
      break
    inputs, targets = batcher.get(position.index, position.epoch)
    batch = {"inputs": parallel.global_batch(mesh, inputs),
             "targets": parallel.global_batch(mesh, targets),
             "reset": np.asarray(random_windows or position.index == 0)}
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      state, sums = step_fn(state, batch)
    step += 1
    position = position.advance(batcher.batches_per_epoch)
    window.sums.append(sums)
    window.steps += 1
    if first:  # The first step includes compiling: keep it out of ms/batch.
      jax.block_until_ready(sums)
      log.info(f"first step (compiling included) took "
               f"{time.perf_counter() - window.start:.1f} s")
      window, first = _Window(), False
    if step % cfg.train.log_every == 0 and window.steps:
      total, elapsed, steps = window.flush()
      s = metrics.summarize(total["loss_sum"], total["correct"], total["count"])
      if not np.isfinite(s["loss"]):
        raise UserError(
            f"training loss became non-finite by step {step}; the last good "
            f"checkpoint is kept: lower --config.optim.learning_rate or set "
            f"--config.optim.clip_norm")
      log.train_line(
          epoch=position.epoch + 1, step=step,
          batch=position.index or batcher.batches_per_epoch,
          batches=batcher.batches_per_epoch, lr=float(lr_at(step - 1)),
          ms_per_batch=1000 * elapsed / steps,
          tok_per_s=steps * tokens_per_step / elapsed, loss=s["loss"],
          ppl=s["ppl"], acc=s["acc"],
          grad_norm=total["grad_norm"] / steps)
    valid = None
    if step % cfg.train.eval_every == 0 or step == cfg.train.num_steps:
      valid = evaluator.run(state.params, splits["valid"],
                            cfg.train.eval_max_batches)
      best_valid = min(best_valid, valid["loss"])
      evals += 1
      log.eval_line(evals, step, "valid", valid)
      window = _Window()  # Keep eval time out of the next ms/batch.
    if step % cfg.checkpoint.every_steps == 0 or valid is not None:
      _save(ckpt, step, state, position, best_valid, valid)
      last_saved = step
  if last_saved != step:
    _save(ckpt, step, state, position, best_valid, valid)
  ckpt.close()
  wall = time.perf_counter() - started
  summary = {"steps": step, "best_valid_loss": best_valid,
             "best_valid_ppl": float(np.exp(min(best_valid, 700))),
             "wall_s": wall, "params": n_params,
             "checkpoints": ckpt.directory}
  log.summary(summary, workdir)
  log.close()
  return summary


def _save(ckpt, step, state, position, best_valid, valid):
  meta = {"step": step, "position": position.to_dict(),
          "best_valid_loss": best_valid}
  ckpt.save(step, state, meta, valid["loss"] if valid else None)
