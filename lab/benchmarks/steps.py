"""The JAX steps the benchmarks time: core layers, LM, eval, word-level,
each compiled once and called as a `Runner`; and generation through the
serving engine.

The LM rows run the product's own train step (training/loop.py's
compile_train_step), so a change to that step is what they measure; only the
core rows (stacked layers, no embedding or head) build a step of their own.
"""

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lab.benchmarks.shapes import model_config, zipf_probs
from zebra_jax import engine
from zebra_jax.config import base
from zebra_jax.model import lm

def adam_step(loss_fn, tx):
  """(params, opt_state, *args) -> (params, opt_state, loss); donates state."""
  def step(params, opt_state, *args):
    loss, grads = jax.value_and_grad(loss_fn)(params, *args)
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1))


def _random_split(build):
  """(graphdef, params) of build(), params drawn uniformly in +-0.1.

  Speed does not depend on the values, and the real initializers (orthogonal
  blocks need a QR) take seconds to compile per shape.
  """
  graphdef, shapes = nnx.split(nnx.eval_shape(build))
  leaves, treedef = jax.tree.flatten(shapes)

  @jax.jit
  def draw(key):
    keys = jax.random.split(key, len(leaves))
    return [jax.random.uniform(k, x.shape, x.dtype, -0.1, 0.1)
            for k, x in zip(keys, leaves)]
  return graphdef, jax.tree.unflatten(treedef, draw(jax.random.key(0)))


def random_model(cfg):
  """(graphdef, params) of the product's LM for a model config, params
  random (_random_split): what every benchmark of a model's speed builds."""
  return _random_split(lambda: lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))


class Runner:
  """A compiled step and its live arguments; calling it runs one step.

  feedback maps output positions to the argument they replace next call (the
  donated train state, or the eval carry).
  """

  def __init__(self, jitted, args, feedback: dict[int, int]):
    self.compiled = jitted.lower(*args).compile()
    self.args, self.feedback = list(args), feedback

  timing = "jax"  # device_timing reads its rounds from a profiler trace

  def __call__(self):
    self.dispatch()
    self.wait()

  def dispatch(self):
    """One step enqueued, not waited for: its outputs feed the next."""
    self.out = self.compiled(*self.args)
    for out_index, arg_index in self.feedback.items():
      self.args[arg_index] = self.out[out_index]

  def wait(self):
    jax.block_until_ready(self.out)


def core_runner(shape, stripes, *, seq_len=None, remat=False, custom_vjp=True,
                grouped=False, kernel="scan", bf16_projections=False,
                bf16_recurrence=False):
  """Stacked ZebraLSTMLayers (no embedding/softmax) + Adam on random inputs.

  custom_vjp=False differentiates the scan with plain autodiff: the row that
  shows what the hand-written backward pass (recurrence.py) buys. grouped:
  block-diagonal input projections, the stripes shuffled between layers as
  the LM does. kernel: the layers' recurrence (model.recurrence);
  bf16_projections, bf16_recurrence: model.cpu_bf16_projections and
  model.cpu_bf16_recurrence resolved on (native only)."""
  b, t, h = shape["batch"], seq_len or shape["seq_len"], shape["hidden"]
  dt = lm.compute_dtype(shape["dtype"])
  graphdef, params = _random_split(lambda: nnx.List([
      lm.ZebraLSTMLayer(h, h, stripes, rngs=nnx.Rngs(i), dtype=dt,
                        remat=remat, custom_vjp=custom_vjp, grouped=grouped,
                        kernel=kernel, bf16_projections=bf16_projections,
                        bf16_recurrence=bf16_recurrence)
      for i in range(shape["layers"])]))
  x = jax.random.normal(jax.random.key(0), (b, t, h), dt)
  zeros = jnp.zeros((b, h), jnp.float32)

  def loss_fn(params, x):
    y = x
    for i, layer in enumerate(nnx.merge(graphdef, params)):
      with jax.named_scope(f"zebra_lstm_{i}"):
        if i > 0 and grouped:
          y = lm.stripe_shuffle(y, stripes)
        y, _ = layer(y, (zeros, zeros))
    return jnp.sum(jnp.square(y.astype(jnp.float32))) / y.size

  tx = optax.adam(1e-3)
  return Runner(adam_step(loss_fn, tx), (params, tx.init(params), x),
                 {0: 0, 1: 1})


def random_tokens(shape, seq_len=None, seed=0):
  t = seq_len or shape["seq_len"]
  if shape.get("zipf"):  # the word-level shape: Zipf-distributed ids
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.choice(shape["vocab"], (shape["batch"], t + 1),
                                  p=zipf_probs(shape["vocab"])), jnp.int32)
  return jax.random.randint(jax.random.key(seed), (shape["batch"], t + 1), 0,
                            shape["vocab"])


def train_step(model, batch_size: int, devices=None):
  """The product's train step (training/loop.py) for `model` (a model config)
  over a data mesh of `devices` (default: the first): (jitted step, fresh
  state, mesh). The state's params are random (_random_split) and its
  optimizer Adam at 1e-3, the one torch's reference runs; the step donates it.

  Imported here: the training floor brings the multi-process flags, which
  importing a benchmark should not define.
  """
  # pylint: disable=g-import-not-at-top
  from zebra_jax.runtime import parallel
  from zebra_jax.training import loop, train_state
  cfg = base.get_config()
  cfg.model.update(model)
  cfg.data.batch_size = batch_size
  mesh = parallel.make_mesh(devices or jax.devices()[:1])
  graphdef, params = random_model(model)
  tx = optax.adam(1e-3)
  state = train_state.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
      carry=lm.init_carry(model, batch_size),
      rng=jax.random.PRNGKey(cfg.seed),
      loss_scale=train_state.make_loss_scale(cfg))
  state = jax.device_put(state, parallel.state_shardings(mesh, state))
  return loop.compile_train_step(graphdef, tx, mesh, state), state, mesh


def train_batch(mesh, tokens) -> dict:
  """[batch, time + 1] ids -> the train step's batch, sharded on 'data'; the
  carry is kept from step to step, as a stream batcher keeps it."""
  # pylint: disable-next=g-import-not-at-top
  from zebra_jax.runtime import parallel
  tokens = np.asarray(tokens, np.int32)
  return {"inputs": parallel.global_batch(mesh, tokens[:, :-1]),
          "targets": parallel.global_batch(mesh, tokens[:, 1:]),
          "reset": np.asarray(False)}


def _train_runner(model, shape, tokens) -> Runner:
  step, state, mesh = train_step(model, shape["batch"])
  return Runner(step, (state, train_batch(mesh, tokens)), {0: 0})


def word_runner(shape, stripes, *, grouped=False, head="full",
                kernel="scan"):
  """The product's train step at the word-level shape (word_shape), full or
  adaptive head. kernel: the layers' recurrence (model.recurrence)."""
  cfg = model_config(shape, stripes, grouped, head, recurrence=kernel)
  return _train_runner(cfg, shape, random_tokens(shape))


def head_runner(shape, head="full", cpu_bf16_head="off",
                cpu_fused_head="off"):
  """The product's head alone (lm.ZebraLM.token_sums, as the train step
  calls it): the mean cross-entropy's gradient with respect to the head's
  parameters and to fixed hidden states [batch, window, hidden], no
  optimizer. head: "full" (tied to the embedding, as the LM rows) or
  "adaptive" (tied to the adaptive input). The loss's value is computed
  too, as the train step and torch's row compute it: under `jax.grad`
  alone XLA drops the work only the value needs (the adaptive tails'
  forward loops). cpu_bf16_head, cpu_fused_head: those model fields."""
  cfg = model_config(shape, 1, head=head, cpu_bf16_head=cpu_bf16_head,
                     cpu_fused_head=cpu_fused_head)
  graphdef, params = random_model(cfg)
  b, t, h = shape["batch"], shape["seq_len"], shape["hidden"]
  hidden = jax.random.uniform(jax.random.key(1), (b, t, h), jnp.float32,
                              -0.1, 0.1)
  targets = random_tokens(shape)[:, 1:]

  def loss(hidden, params):
    sums = nnx.merge(graphdef, params).token_sums(hidden, targets,
                                                  with_accuracy=False)
    return sums["loss_sum"] / targets.size
  return Runner(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                (hidden, params), {})


def lm_runner(shape, stripes, *, seq_len=None, remat=False, grouped=False,
              kernel="scan", cpu_bf16_head="off", cpu_fused_head="off",
              cpu_bf16_projections="off", cpu_bf16_recurrence="off"):
  """The product's train step: embedding, layers, tied head, mean CE, Adam.
  kernel: the layers' recurrence (model.recurrence); cpu_bf16_head,
  cpu_fused_head, cpu_bf16_projections, cpu_bf16_recurrence: those model
  fields."""
  cfg = model_config(shape, stripes, grouped, remat=remat, recurrence=kernel,
                     cpu_bf16_head=cpu_bf16_head,
                     cpu_fused_head=cpu_fused_head,
                     cpu_bf16_projections=cpu_bf16_projections,
                     cpu_bf16_recurrence=cpu_bf16_recurrence)
  return _train_runner(cfg, shape, random_tokens(shape, seq_len))


def eval_runner(shape, stripes, grouped=False, kernel="scan"):
  """The LM forward with carry, as evaluation runs it. Imported here: the
  training floor brings the multi-process flags, which importing a benchmark
  should not define."""
  from zebra_jax.training import evaluate  # pylint: disable=g-import-not-at-top
  cfg = model_config(shape, stripes, grouped, recurrence=kernel)
  graphdef, params = random_model(cfg)
  tokens = random_tokens(shape)
  step = jax.jit(functools.partial(evaluate.eval_step, graphdef=graphdef),
                 donate_argnums=1)
  return Runner(step, (params, lm.init_carry(cfg, shape["batch"]),
                        tokens[:, :-1], tokens[:, 1:]), {0: 1})


_SAMPLE = base.get_config().sample
_SAMPLE_FILTER = {k: _SAMPLE[k] for k in ("temperature", "top_k", "top_p")}


class IdText:
  """Token ids as text: the random models have no tokenizer, and the
  engine decodes a row's tokens once, at its end."""
  spaces_in_tokens = True

  def encode_prompt(self, text):
    return [int(w) for w in text.split()]

  def decode(self, ids):
    return " ".join(str(int(i)) for i in ids)


def gen_runner(shape, stripes, batch, grouped=False, nucleus=False,
               kernel="scan"):
  """One request of `batch` rows of shape["gen_tokens"] tokens each through
  the serving engine (zebra_jax.engine: what --mode=sample, training's
  samples and the server run), its slots sized to the rows as --mode=sample
  sizes a preview: a one-token prompt, then decode calls of
  config.sample.chunk tokens (fewer when the row asks fewer). From the full
  distribution; nucleus: with the sample config's default temperature,
  top_k and top_p. kernel: the layers' recurrence (model.recurrence)."""
  cfg = model_config(shape, stripes, grouped, recurrence=kernel)
  graphdef, params = random_model(cfg)
  tokens = shape["gen_tokens"]
  model = engine.Model(
      step_fn=functools.partial(lm.decode_step, graphdef=graphdef),
      params=params, init_carry=functools.partial(lm.init_carry, cfg),
      vocab_size=shape["vocab"], tokenizer=IdText())
  running = engine.Engine(model, slots=batch, queue=1, prefill_chunk=1,
                          prefill_rows=batch,
                          decode_block=min(tokens, int(_SAMPLE.chunk)))
  options = engine.SamplingParams(
      max_new_tokens=tokens, seed=0,
      **(_SAMPLE_FILTER if nucleus else dict(temperature=1.0)))
  rows = [engine.Row("0", options, sample_index=i) for i in range(batch)]

  def run():
    for request in running.submit_many(rows):
      request.result()
  run()  # the first request's host work (the programs compiled at start)
  weakref.finalize(run, running.close)  # the engine's thread ends with it
  return run
