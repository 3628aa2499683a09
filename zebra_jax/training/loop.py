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
from zebra_jax.inference import sample
from zebra_jax.model import lm, metrics, stripe_parallel
from zebra_jax.model.config import ModelConfig
from zebra_jax import progress
from zebra_jax.runtime import checkpoint, parallel, profiling, rundir, writer
from zebra_jax.training import evaluate, loss_scale, optim, preemption
from zebra_jax.training.train_state import init_state, TrainState


_POLL_EVERY = 10  # steps between agreed stop checks with several processes
# The hparams dashboard's metric columns: each the latest value of a scalar.
HPARAMS_METRICS = ("train/loss", "valid/loss", "valid/ppl",
                   "summary/best_valid_ppl")


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
               tx: optax.GradientTransformation, accum_steps: int = 1,
               mesh=None):
  """One window: (state, batch) -> (state, metric sums).

  batch: inputs/targets [batch, time] int32 and reset, a bool scalar that
  zeroes the carry (start of an epoch, or every step with random windows).
  With accum_steps = k the batch runs as k micro-batches whose gradients are
  summed before one update: the same update as k = 1, in 1/k the activations.
  A step whose gradients are not finite changes neither params nor optimizer
  state; the loss scale backs off (float16) and counts it. mesh: the
  devices the model splits over (lm.apply), None for one.
  """
  carry = jax.tree.map(lambda a: jnp.where(batch["reset"], 0.0, a), state.carry)
  dropout_rng = jax.random.fold_in(state.rng, state.step)
  total_tokens = batch["targets"].size  # static: the loss is a mean over it
  scale = state.loss_scale

  def grads_of(params, inputs, targets, carry, rng):
    def loss_fn(params):
      # No extra full-vocabulary pass for accuracy under either head (see
      # lm.token_sums): the train log shows no acc; evaluation counts it.
      sums, new_carry = lm.token_sums(graphdef, params, inputs, targets,
                                         carry, rng, with_accuracy=False,
                                         mesh=mesh)
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
  if stripe_parallel.active(mesh) is not None:
    # Gradients laid out as the parameters: the embedding's arrives split
    # over "stripe" (from a grouped first layer) and is gathered once here,
    # not as the updated parameter and every optimizer moment after it.
    grads = jax.lax.with_sharding_constraint(
        grads, parallel.param_shardings(mesh, grads))
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
                           accum_steps=accum_steps, mesh=mesh)
  return jax.jit(step, in_shardings=(shardings, batch_shardings),
                 out_shardings=(shardings, rep), donate_argnums=0)


def make_batch(mesh, batcher, index: int, epoch: int = 0) -> dict:
  """The step's batch `index` of `epoch`, placed on the mesh."""
  inputs, targets = batcher.get(index, epoch)
  return {"inputs": parallel.global_batch(mesh, inputs),
          "targets": parallel.global_batch(mesh, targets),
          "reset": np.asarray(batcher.starts_fresh(index))}


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
  vocab_size, tokenizer, splits = rundir.prepare(cfg, workdir)
  model = dataclasses.replace(ModelConfig.of(cfg.model), vocab_size=vocab_size)
  mesh = parallel.make_mesh(stripe_devices=cfg.parallel.stripe_devices)
  parallel.check_batch(cfg.data.batch_size, "data.batch_size", mesh,
                       cfg.train.grad_accum_steps)
  graphdef, tx, state = init_state(cfg, mesh, model)
  ckpt = checkpoint.Checkpointer(workdir, cfg.checkpoint.keep_latest,
                                 cfg.checkpoint.keep_best)
  restored = ckpt.restore_latest(state, writer.info)
  # The logs drop what they hold past the step training goes on from.
  log = writer.MetricWriter(workdir, start_step=restored[0] if restored else 0)
  run = _Run(cfg, log, ckpt, stop_request, state)
  if restored is not None:
    run.resume(*restored)
  batcher = pipeline.make_batcher(cfg.data, splits["train"], cfg.seed,
                                  jax.process_index(), jax.process_count())
  step_fn = compile_train_step(graphdef, tx, mesh, state,
                               cfg.train.grad_accum_steps)
  evaluator = evaluate.Evaluator(graphdef, mesh, model, cfg.eval.batch_size,
                                 cfg.eval.seq_len, accuracy=cfg.eval.accuracy)
  float(run.lr_at(0))  # compiles the lookup now, not inside the first timed window
  n_params = lm.num_params(run.state.params)
  log.info(f"model: {n_params:,} parameters | {model.num_layers} layers x "
           f"hidden {model.hidden_size} in {model.num_stripes} stripes "
           f"| vocab {model.vocab_size} | {jax.device_count()} "
           f"{jax.devices()[0].platform} device(s)")
  eval_sampler = _make_eval_sampler(cfg, model, tokenizer, graphdef)
  step = first_step = int(run.state.step)
  log.hparams(_with_model(cfg, model).to_dict(), HPARAMS_METRICS, step)
  profiler = profiling.StepProfiler(workdir, cfg.profile.start_step,
                                    cfg.profile.num_steps, step, log.info)
  bar = progress.Progress(cfg.train.num_steps, initial_step=step,
                          enabled=None if jax.process_index() == 0 else False)
  log.record("start", step, {})  # wall-clock origin for plots
  started = run.started = time.perf_counter()
  try:
    with stop_request:
      stop = step >= cfg.train.num_steps
      while not stop:
        batch = make_batch(mesh, batcher, run.position.index,
                           run.position.epoch)
        profiler.before_step(step)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          run.state, sums = step_fn(run.state, batch)
        profiler.after_step(step, sums)
        step += 1
        run.position = run.position.advance(batcher.batches_per_epoch)
        bar.update(step)
        run.window.sums.append(sums)
        run.close_first_window()
        if step % cfg.train.log_every == 0 and run.window.sums:
          tok_s, loss = run.log_window(step, batcher)
          bar.update(step, tok_s=tok_s, loss=loss)
        stop = step >= cfg.train.num_steps
        stop = run.poll_stop(step, started) or stop
        run.eval_and_save(step, stop, evaluator, splits["valid"], eval_sampler)
      run.save_last(step)
      bar.close()
      profiler.close()
      ckpt.close()
  except BaseException:
    bar.close()
    if eval_sampler is not None:
      eval_sampler.close()
    ckpt.abandon()  # let an in-flight good save finish; keep what is on disk
    log.close()
    raise
  if eval_sampler is not None:
    eval_sampler.close()
  wall = time.perf_counter() - started
  trained = step - first_step
  tokens_per_batch = batcher.tokens_per_batch
  evaluated = run.best_step is not None  # else no loss, not an infinite one
  summary = {"steps": step,
             "best_valid_loss": run.best_valid if evaluated else None,
             "best_valid_ppl": (float(np.exp(min(run.best_valid, 700)))
                                if evaluated else None),
             "best_valid_step": run.best_step,
             "tokens_seen": step * tokens_per_batch,
             "tok_per_s": trained * tokens_per_batch / max(wall, 1e-9),
             "wall_s": wall, "train_s": wall - run.paused,
             "params": n_params, "preempted": run.preempted,
             # A signal stopped it before num_steps: the exit status says so.
             "stopped_early": run.preempted and step < cfg.train.num_steps,
             "checkpoints": ckpt.directory}
  log.summary(summary, workdir, config_path)
  log.close()
  return summary


class _Run:
  """What the loop carries between steps besides the batch: the train state,
  the data position, the best validation loss, the open log window, and the
  named steps that read them (log a window, poll for a stop, eval and save)."""

  def __init__(self, cfg, log, ckpt, stop_request, state):
    self.cfg, self.log, self.ckpt = cfg, log, ckpt
    self.stop_request = stop_request
    self.state = state
    self.position = pipeline.DataPosition()
    self.best_valid, self.best_step = float("inf"), None
    self.window, self.first = _Window(), True
    self.evals, self.bad_run, self.preempted = 0, 0, False
    self.last_valid = None  # the latest step's valid metrics, if it evaluated
    self.last_saved = int(state.step)
    # Seconds spent evaluating and saving inside the loop, so that records
    # can give the training time alone (time-to-perplexity comparisons).
    self.started, self.paused = time.perf_counter(), 0.0
    self.lr_at = optim.learning_rate_schedule(cfg.optim, cfg.train.num_steps)
    # One process polls its own flags every step; several agree on a stop in
    # a collective, every few steps (a host sync each step would stall
    # dispatch).
    self.poll_every = (1 if jax.process_count() == 1
                       else max(1, min(cfg.train.log_every, _POLL_EVERY)))

  def resume(self, latest: int, state, meta) -> None:
    """Continue from a restored checkpoint."""
    self.state, self.last_saved = state, int(state.step)
    self.position = pipeline.DataPosition.from_dict(meta["position"])
    best = meta["best_valid_loss"]  # null (older: Infinity) before an eval
    self.best_valid = float("inf") if best is None else best
    self.best_step = meta["best_valid_step"]
    self.log.info(f"resuming from checkpoint at step {latest} "
                  f"(epoch {self.position.epoch}, batch {self.position.index})")

  def close_first_window(self) -> None:
    """The first step includes compiling: keep it out of ms/batch."""
    if not self.first:
      return
    jax.block_until_ready(self.window.sums[-1])
    self.log.info(f"first step (compiling included) took "
                  f"{time.perf_counter() - self.window.start:.1f} s")
    self.window, self.first = _Window(), False

  def log_window(self, step: int, batcher) -> tuple[float, float]:
    """One train log line for the steps since the last; (tok/s, loss)."""
    per_step, elapsed = self.window.flush()
    # The sums are all-reduced, so every process sees the same skips and
    # stops at the same step.
    self.bad_run = _consecutive_skips(per_step, self.bad_run)
    if self.bad_run >= self.cfg.train.max_consecutive_skips:
      raise UserError(
          f"{self.bad_run} steps in a row up to step {step} had non-finite "
          f"gradients; stopped without saving them (the last good "
          f"checkpoint is kept): lower --config.optim.learning_rate, set "
          f"--config.optim.clip_norm, or use --config.model.dtype=float32")
    good = [m for m in per_step if not m["skipped"]] or per_step
    total = {k: float(np.sum([m[k] for m in good], dtype=np.float64))
             for k in good[0]}
    summary = metrics.summarize(total["loss_sum"], total.get("correct"),
                                total["count"])
    tok_s = len(per_step) * batcher.tokens_per_batch / elapsed
    scale = self.state.loss_scale
    self.log.train_line(
        epoch=self.position.epoch + 1, step=step,
        batch=self.position.index or batcher.batches_per_epoch,
        batches=batcher.batches_per_epoch, lr=float(self.lr_at(step - 1)),
        ms_per_batch=1000 * elapsed / len(per_step), tok_per_s=tok_s,
        loss=summary["loss"], ppl=summary["ppl"], acc=summary["acc"],
        grad_norm=total["grad_norm"] / len(good),
        loss_scale=float(scale.scale) if scale.dynamic else None,
        skipped=int(scale.skipped))
    return tok_s, summary["loss"]

  def poll_stop(self, step: int, started: float) -> bool:
    """Whether the time budget or a stop signal ends the run at this step
    (polled on the same steps in every process)."""
    if step % self.poll_every:
      return False
    budget_s = self.cfg.train.time_budget_minutes * 60.0
    out_of_time = bool(budget_s) and time.perf_counter() - started > budget_s
    reason = self.stop_request.poll(step, out_of_time)
    if reason == "time budget":
      self.log.info(f"time budget of {self.cfg.train.time_budget_minutes} min "
                    f"reached at step {step}")
      return True
    if reason is not None:
      who = (f" (process {', '.join(map(str, self.stop_request.senders))})"
             if jax.process_count() > 1 else "")
      self.log.info(f"received {reason}{who}: saving a checkpoint at step "
                    f"{step} and stopping; rerun the same command to resume")
      self.preempted = True
      return True
    return False

  def eval_and_save(self, step: int, stop: bool, evaluator, valid_ids,
                    eval_sampler) -> None:
    """Evaluates on valid every eval_every steps and at a normal end; saves
    every checkpoint.every_steps and after every evaluation."""
    cfg, valid = self.cfg, None
    evaluate_now = (step % cfg.train.eval_every == 0
                    or (stop and not self.preempted))
    if not evaluate_now and step % cfg.checkpoint.every_steps:
      self.last_valid = None
      return
    jax.block_until_ready(self.state)  # the steps so far count as training
    entered = time.perf_counter()
    if evaluate_now:
      valid = evaluator.run(self.state.params, valid_ids,
                            cfg.train.eval_max_batches)
      if valid["loss"] < self.best_valid:
        self.best_valid, self.best_step = valid["loss"], step
      self.evals += 1
      self.log.eval_line(self.evals, step, "valid", valid,
                         train_s=entered - self.started - self.paused)
      if eval_sampler is not None:
        self.log.text("sample", eval_sampler(self.state.params), step)
      self.window = _Window()  # Keep eval time out of the next ms/batch.
    self.last_valid = valid
    self._save(step, valid)
    self.paused += time.perf_counter() - entered

  def save_last(self, step: int) -> None:
    """The final step's checkpoint, unless the last step saved already."""
    if self.last_saved != step:
      self._save(step, self.last_valid)

  def _save(self, step: int, valid) -> None:
    meta = {"step": step, "position": self.position.to_dict(),
            "best_valid_loss": (self.best_valid if self.best_step is not None
                                else None),  # strict JSON: no Infinity
            "best_valid_step": self.best_step}
    self.ckpt.save(step, self.state, meta, valid["loss"] if valid else None)
    self.last_saved = step


def _make_eval_sampler(cfg, model, tokenizer, graphdef):
  """A function params -> a short text from cfg.sample.prompt, for TensorBoard.

  One Generator is reused so its compiled loop is too. Single-process only:
  generation runs on one local device.
  """
  if not cfg.train.sample_at_eval or jax.process_count() > 1:
    return None
  params = sample.sampling_params(
      cfg.sample, max_new_tokens=min(cfg.sample.max_new_tokens, 200))
  generator = None

  def draw(weights) -> str:
    nonlocal generator
    if generator is None:  # (config, tokenizer, params): no data needed
      generator = sample.Generator.from_parts(
          _with_model(cfg, model), tokenizer, graphdef, weights, slots=1,
          decode_block=int(cfg.sample.chunk))
    else:  # same compiled code, new weights, laid out as the old ones (one
      # device, or split over the stripe devices: loading.placement)
      generator.set_params(weights)
    return generator.generate([cfg.sample.prompt], params)[0]

  def close() -> None:  # the engine's thread ends with the run
    if generator is not None:
      generator.close()

  draw.close = close
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


def _with_model(cfg: ml_collections.ConfigDict,
                model: ModelConfig) -> ml_collections.ConfigDict:
  """cfg whose model section is `model` (the vocabulary size resolved)."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.model = dataclasses.asdict(model)
  return cfg
