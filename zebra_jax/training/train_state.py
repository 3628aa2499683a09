"""The train state pytree, built fresh or as an abstract restore target."""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from zebra_jax.model import lm
from zebra_jax.model.config import ModelConfig
from zebra_jax.runtime import parallel
from zebra_jax.training import loss_scale, optim


@flax.struct.dataclass
class TrainState:
  step: jax.Array        # int32 scalar: updates applied so far
  params: Any            # nnx.State, float32 master weights
  opt_state: Any         # optax state
  carry: lm.Carry     # (h, c) per layer, [batch, hidden]: sharded on 'data'
  rng: jax.Array         # uint32[2] base key; dropout uses fold_in(rng, step)
  loss_scale: loss_scale.LossScale  # dynamic for float16; counts skipped steps


def _build(cfg: ml_collections.ConfigDict, model: ModelConfig, tx):
  graphdef, params = lm.create(model, cfg.seed)
  state = TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
      carry=lm.init_carry(model, cfg.data.batch_size),
      rng=jax.random.PRNGKey(cfg.seed),
      loss_scale=make_loss_scale(cfg))
  return graphdef, state


def make_loss_scale(cfg: ml_collections.ConfigDict) -> loss_scale.LossScale:
  """Dynamic scaling for float16 compute; a fixed scale of 1 otherwise."""
  ls = cfg.train.loss_scale
  return loss_scale.LossScale.create(
      dynamic=cfg.model.dtype == "float16", initial_scale=ls.initial_scale,
      growth_interval=ls.growth_interval, growth_factor=ls.growth_factor,
      backoff_factor=ls.backoff_factor, min_scale=ls.min_scale)


def init_state(cfg: ml_collections.ConfigDict, mesh,
               model: ModelConfig | None = None):
  """(graphdef, optimizer, fresh state placed with the mesh's shardings).

  model: the network to build; cfg.model's when left out (a config whose
  vocab_size is already known).
  """
  model = ModelConfig.of(cfg.model if model is None else model)
  tx = optim.make_optimizer(cfg.optim, cfg.train.num_steps)
  graphdef, state = _build(cfg, model, tx)
  return graphdef, tx, jax.device_put(
      state, parallel.state_shardings(mesh, state))


def abstract_state(cfg: ml_collections.ConfigDict, mesh):
  """(graphdef, ShapeDtypeStructs with shardings): a restore target, no memory."""
  tx = optim.make_optimizer(cfg.optim, cfg.train.num_steps)
  model = ModelConfig.of(cfg.model)
  graphdef, _ = lm.abstract(model)
  state = jax.eval_shape(lambda: _build(cfg, model, tx)[1])
  shardings = parallel.state_shardings(mesh, state)
  target = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      state, shardings)
  return graphdef, target
