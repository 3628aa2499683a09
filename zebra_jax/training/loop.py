"""Training: the train state, one jitted truncated-BPTT step, and the loop.

The loop is resumable: rerunning the same command with the same --workdir
restores params, optimizer state, step, RNG, carry and data position from the
latest checkpoint and continues with the batch an uninterrupted run would read.
"""

import contextlib
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from zebra_jax.data import pipeline
from zebra_jax.errors import UserError
from zebra_jax.inference import loading, sample
from zebra_jax.model import lm, metrics
from zebra_jax.runtime import checkpoint, parallel, profiling, progress, rundir, writer
from zebra_jax.training import evaluate, loss_scale, optim, preemption
from zebra_jax.training.train_state import init_state, TrainState


_POLL_EVERY = 10  # steps between agreed stop checks with several processes


def _to_micro(x, k):
  """[B, ...] -> [k, B/k, ...]: micro-batch j holds rows j, j+k, j+2k, ...

  Rows stay on their device (each device's contiguous block splits evenly),
  so accumulation needs no communication until the gradient all-reduce.
  """
  return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def _from_micro(x):
  """Inverse of _to_micro: [k, B/k, ...] -> [B, ...]."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def train_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef,
               tx: optax.GradientTransformation, accum_steps: int = 1):
  """One window: (state, batch) -> (state, metric sums).

  batch: inputs/targets [batch, time] int32 and reset, a bool scalar that
  zeroes the carry (start of an epoch, or every step with random windows).
  With accum_steps = k the batch runs as k micro-batches whose gradients are
  summed before one update: the same update as k = 1, in 1/k the activations.
  A step whose gradients are not finite changes neither params nor optimizer
  state; the loss scale backs off (float16) and counts it.
  """
  carry = jax.tree.map(lambda a: jnp.where(batch["reset"], 0.0, a), state.carry)
  dropout_rng = jax.random.fold_in(state.rng, state.step)
  total_tokens = batch["targets"].size  # static: the loss is a mean over it
  scale = state.loss_scale

  def grads_of(params, inputs, targets, carry, rng):
    def loss_fn(params):
      # No extra full-vocabulary pass for accuracy (adaptive head): see
      # lm.token_sums; the train log then shows no acc.
      sums, new_carry = lm.token_sums(graphdef, params, inputs, targets,
                                         carry, rng, with_accuracy=False)
      return scale.scale_loss(sums["loss_sum"] / total_tokens), (new_carry, sums)
    return jax.grad(loss_fn, has_aux=True)(params)

  if accum_steps == 1:
    grads, (new_carry, sums) = grads_of(state.params, batch["inputs"],
                                        batch["targets"], carry, dropout_rng)
  else:
    def micro_step(acc, micro):
      inputs, targets, carry, j = micro
      g, (c, s) = grads_of(state.params, inputs, targets, carry,
                           jax.random.fold_in(dropout_rng, j))
      return jax.tree.map(jnp.add, acc, g), (c, s)

    micro = (_to_micro(batch["inputs"], accum_steps),
             _to_micro(batch["targets"], accum_steps),
             jax.tree.map(lambda a: _to_micro(a, accum_steps), carry),
             jnp.arange(accum_steps))
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (new_carry, sums) = jax.lax.scan(micro_step, zeros, micro)
    new_carry = jax.tree.map(_from_micro, new_carry)
    sums = jax.tree.map(jnp.sum, sums)

  grads = scale.unscale(grads)
  finite = loss_scale.all_finite(grads)
  with jax.named_scope("optimizer"):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
  sums["grad_norm"] = jnp.where(finite, optax.tree.norm(grads), 0.0)
  sums["skipped"] = (~finite).astype(jnp.float32)
  new_carry = jax.tree.map(lambda a: jnp.where(jnp.isfinite(a), a, 0.0),
                           jax.lax.stop_gradient(new_carry))
  new_state = state.replace(
      step=state.step + 1,
      params=loss_scale.select(finite, params, state.params),
      opt_state=loss_scale.select(finite, opt_state, state.opt_state),
      carry=new_carry, loss_scale=scale.update(finite))
  return new_state, sums


def compile_train_step(graphdef, tx, mesh, state, accum_steps: int = 1):
  shardings = parallel.state_shardings(mesh, state)
  rep, bat = parallel.replicated(mesh), parallel.batch_sharded(mesh)
  batch_shardings = {"inputs": bat, "targets": bat, "reset": rep}
  step = functools.partial(train_step, graphdef=graphdef, tx=tx,
                           accum_steps=accum_steps)
  return jax.jit(step, in_shardings=(shardings, batch_shardings),
                 out_shardings=(shardings, rep), donate_argnums=0)


class _Window:
  """Per-step metric sums since the last log line (kept on device until then)."""

  def __init__(self):
    self.sums, self.start = [], time.perf_counter()

  def flush(self) -> tuple[list[dict[str, float]], float]:
    """(per-step host metrics, seconds since the window opened); then resets."""
    host, elapsed = jax.device_get(self.sums), time.perf_counter() - self.start
    self.__init__()
    return host, elapsed


def run(cfg: ml_collections.ConfigDict, workdir: str,
        config_path: str | None = None) -> dict[str, Any]:
  """Trains until num_steps (or the time budget); returns the run summary.

  config_path only shapes the follow-up commands the summary prints.
  """
  stop_request = preemption.StopRequest()
  # Several processes catch stop signals from the start: one sent to a single
  # process while the data is prepared or the step compiles still stops every
  # process at the first agreed poll (had it died alone, the others would wait
  # in a collective). A single process may stop at once: nothing to save yet.
  with stop_request if jax.process_count() > 1 else contextlib.nullcontext():
    return _train(cfg, workdir, config_path, stop_request)


def _train(cfg, workdir, config_path, stop_request) -> dict[str, Any]:
  cfg, tokenizer, splits = rundir.prepare(cfg, workdir)
  mesh = parallel.make_mesh()
  accum = cfg.train.grad_accum_steps
  parallel.check_batch(cfg.data.batch_size, "data.batch_size", mesh, accum)
  graphdef, tx, state = init_state(cfg, mesh)
  log = writer.MetricWriter(workdir)
  ckpt = checkpoint.Checkpointer(workdir, cfg.checkpoint.keep_latest,
                                 cfg.checkpoint.keep_best)
  position = pipeline.DataPosition()
  best_valid, best_step = float("inf"), None
  if (restored := ckpt.restore_latest(state, log.info)) is not None:
    latest, state, meta = restored
    position = pipeline.DataPosition.from_dict(meta["position"])
    best_valid = meta.get("best_valid_loss", best_valid)
    best_step = meta.get("best_valid_step", best_step)
    log.info(f"resuming from checkpoint at step {latest} "
             f"(epoch {position.epoch}, batch {position.index})")
  batcher = pipeline.make_batcher(cfg.data, splits["train"], cfg.seed,
                              jax.process_index(), jax.process_count())
  step_fn = compile_train_step(graphdef, tx, mesh, state, accum)
  evaluator = evaluate.Evaluator(graphdef, mesh, cfg.model,
                                 cfg.eval.batch_size, cfg.eval.seq_len)
  lr_at = optim.learning_rate_schedule(cfg.optim, cfg.train.num_steps)
  float(lr_at(0))  # compiles the lookup now, not inside the first timed window
  n_params = lm.num_params(state.params)
  log.info(f"model: {n_params:,} parameters | {cfg.model.num_layers} layers x "
           f"hidden {cfg.model.hidden_size} in {cfg.model.num_stripes} stripes "
           f"| vocab {cfg.model.vocab_size} | {jax.device_count()} "
           f"{jax.devices()[0].platform} device(s)")

  step = first_step = int(state.step)
  budget_s = cfg.train.time_budget_minutes * 60.0
  started = time.perf_counter()
  window, valid, last_saved, first = _Window(), None, step, True
  evals, bad_run = 0, 0
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  random_windows = cfg.data.batching == "random"
  profiler = profiling.StepProfiler(workdir, cfg.profile.start_step,
                                   cfg.profile.num_steps)
  eval_sampler = _make_eval_sampler(cfg, tokenizer, splits, graphdef)
  # One process polls its own flags every step; several agree on a stop in a
  # collective, every few steps (a host sync each step would stall dispatch).
  polls_every_step = jax.process_count() == 1
  poll_every = max(1, min(cfg.train.log_every, _POLL_EVERY))
  bar = progress.Progress(cfg.train.num_steps, initial_step=step,
                          enabled=None if jax.process_index() == 0 else False)
  log.record("start", step, {})  # wall-clock origin for plots
  try:
    with stop_request:
      stop, preempted = step >= cfg.train.num_steps, False
      while not stop:
        inputs, targets = batcher.get(position.index, position.epoch)
        batch = {"inputs": parallel.global_batch(mesh, inputs),
                 "targets": parallel.global_batch(mesh, targets),
                 "reset": np.asarray(random_windows or position.index == 0)}
        profiler.before_step(step)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          state, sums = step_fn(state, batch)
        profiler.after_step(step, sums)
        step += 1
        position = position.advance(batcher.batches_per_epoch)
        bar.update(step)
        window.sums.append(sums)
        if first:  # The first step includes compiling: keep it out of ms/batch.
          jax.block_until_ready(sums)
          log.info(f"first step (compiling included) took "
                   f"{time.perf_counter() - window.start:.1f} s")
          window, first = _Window(), False
        if step % cfg.train.log_every == 0 and window.sums:
          per_step, elapsed = window.flush()
          # The sums are all-reduced, so every process sees the same skips
          # and stops at the same step.
          bad_run = _consecutive_skips(per_step, bad_run)
          if bad_run >= cfg.train.max_consecutive_skips:
            raise UserError(
                f"{bad_run} steps in a row up to step {step} had non-finite "
                f"gradients; stopped without saving them (the last good "
                f"checkpoint is kept): lower --config.optim.learning_rate, set "
                f"--config.optim.clip_norm, or use --config.model.dtype=float32")
          good = [m for m in per_step if not m["skipped"]] or per_step
          total = {k: float(np.sum([m[k] for m in good], dtype=np.float64))
                   for k in good[0]}
          summary = metrics.summarize(total["loss_sum"], total.get("correct"),
                                      total["count"])
          log.train_line(
              epoch=position.epoch + 1, step=step,
              batch=position.index or batcher.batches_per_epoch,
              batches=batcher.batches_per_epoch, lr=float(lr_at(step - 1)),
              ms_per_batch=1000 * elapsed / len(per_step),
              tok_per_s=len(per_step) * tokens_per_step / elapsed,
              loss=summary["loss"], ppl=summary["ppl"], acc=summary["acc"],
              grad_norm=total["grad_norm"] / len(good),
              loss_scale=float(state.loss_scale.scale)
              if state.loss_scale.dynamic else None,
              skipped=int(state.loss_scale.skipped))
          bar.update(step, tok_s=len(per_step) * tokens_per_step / elapsed,
                     loss=summary["loss"])
        stop = step >= cfg.train.num_steps
        if polls_every_step or step % poll_every == 0:  # same steps everywhere
          out_of_time = bool(budget_s) and (
              time.perf_counter() - started > budget_s)
          reason = stop_request.poll(step, out_of_time)
          if reason == "time budget":
            log.info(f"time budget of {cfg.train.time_budget_minutes} min "
                     f"reached at step {step}")
            stop = True
          elif reason is not None:
            who = (f" (process {', '.join(map(str, stop_request.senders))})"
                   if jax.process_count() > 1 else "")
            log.info(f"received {reason}{who}: saving a checkpoint at step "
                     f"{step} and stopping; rerun the same command to resume")
            stop = preempted = True
        valid = None
        if step % cfg.train.eval_every == 0 or (stop and not preempted):
          valid = evaluator.run(state.params, splits["valid"],
                                cfg.train.eval_max_batches)
          if valid["loss"] < best_valid:
            best_valid, best_step = valid["loss"], step
          evals += 1
          log.eval_line(evals, step, "valid", valid)
          if eval_sampler is not None:
            log.text("sample", eval_sampler(state.params), step)
          window = _Window()  # Keep eval time out of the next ms/batch.
        if step % cfg.checkpoint.every_steps == 0 or valid is not None:
          _save(ckpt, step, state, position, (best_valid, best_step), valid)
          last_saved = step
      if last_saved != step:
        _save(ckpt, step, state, position, (best_valid, best_step), valid)
      bar.close()
      profiler.close()
      ckpt.close()
  except BaseException:
    bar.close()
    ckpt.abandon()  # let an in-flight good save finish; keep what is on disk
    log.close()
    raise
  wall = time.perf_counter() - started
  trained = step - first_step
  summary = {"steps": step, "best_valid_loss": best_valid,
             "best_valid_ppl": float(np.exp(min(best_valid, 700))),
             "best_valid_step": best_step,
             "tokens_seen": step * tokens_per_step,
             "tok_per_s": trained * tokens_per_step / max(wall, 1e-9),
             "wall_s": wall, "params": n_params, "preempted": preempted,
             "checkpoints": ckpt.directory}
  log.summary(summary, workdir, config_path)
  log.close()
  return summary


def _make_eval_sampler(cfg, tokenizer, splits, graphdef):
  """A function params -> a short text from cfg.sample.prompt, for TensorBoard.

  One Generator is reused so its compiled loop is too. Single-process only:
  generation runs on one local device.
  """
  if not cfg.train.sample_at_eval or jax.process_count() > 1:
    return None
  options = dataclasses.replace(
      sample.Options.from_config(cfg.sample), num_samples=1,
      max_new_tokens=min(cfg.sample.max_new_tokens, 200))
  generator = None

  def draw(params) -> str:
    nonlocal generator
    if generator is None:
      generator = sample.Generator(
          loading.Loaded(cfg, tokenizer, splits, graphdef, params, 0))
    else:  # same compiled code, new weights
      generator.params = jax.device_put(params, jax.local_devices()[0])
    return generator.generate([cfg.sample.prompt], options)[0]

  try:  # a prompt this vocabulary cannot encode must not stop training
    tokenizer.encode_prompt(cfg.sample.prompt)
  except UserError as e:
    logging.warning("no samples in TensorBoard: %s", e)
    return None
  return draw


def _consecutive_skips(per_step: list[dict[str, float]], run: int) -> int:
  """Length of the run of skipped steps ending at the last step."""
  for m in per_step:
    run = run + 1 if m["skipped"] else 0
  return run


def _save(ckpt, step, state, position, best, valid):
  meta = {"step": step, "position": position.to_dict(),
          "best_valid_loss": best[0], "best_valid_step": best[1]}
  ckpt.save(step, state, meta, valid["loss"] if valid else None)
