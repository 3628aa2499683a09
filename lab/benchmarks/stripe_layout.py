"""What each device holds and sends in the train step, by stripe devices.

Compiles the real train step on a `data x stripe` mesh over every device (N
emulated CPU devices on one host: `--xla_force_host_platform_device_count`)
for each stripe-axis size, and reads back per device: the parameter and
optimizer bytes it holds (the shards on one device), XLA's temporaries for
the step (activations kept for the backward pass, and workspace), and the
collectives of the compiled program, with those inside a time loop counted
apart. Nothing runs: speed on one CPU says nothing about NVLink, so none is
reported.
"""

import jax
import ml_collections
import numpy as np

from tests import hlo_collectives
from zebra_jax.model.config import ModelConfig
from zebra_jax.runtime import parallel
from zebra_jax.training import loop, train_state

KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")


def _device_bytes(tree, device) -> int:
  """Bytes of `tree`'s shards that live on `device`."""
  return sum(shard.data.nbytes for x in jax.tree.leaves(tree)
             for shard in x.addressable_shards if shard.device == device)


def layout_row(cfg: ml_collections.ConfigDict, stripe: int) -> dict:
  """One stripe-axis size: per-device bytes and the step's collectives."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.parallel.stripe_devices = stripe
  mesh = parallel.make_mesh(stripe_devices=stripe)
  graphdef, tx, state = train_state.init_state(cfg, mesh)
  step = loop.compile_train_step(graphdef, tx, mesh, state, 1)
  shape = (cfg.data.batch_size, cfg.data.seq_len)
  ids = parallel.global_batch(mesh, np.zeros(shape, np.int32))
  compiled = step.lower(state, {"inputs": ids, "targets": ids,
                                "reset": np.asarray(True)}).compile()
  text = compiled.as_text()
  device = jax.devices()[0]
  counts = hlo_collectives.count(text)
  layers = {"params": state.params["layers"]}
  return {
      "data": len(jax.devices()) // stripe, "stripe": stripe,
      "param_bytes": _device_bytes(state.params, device),
      "layer_param_bytes": _device_bytes(layers, device),
      "opt_bytes": _device_bytes(state.opt_state, device),
      "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
      "collectives": {k: counts.get(k, 0) for k in KINDS},
      "in_time_loops": len(hlo_collectives.in_while_loops(text)),
  }


def layout_rows(cfg, stripes) -> list[dict]:
  return [layout_row(cfg, s) for s in stripes]


def markdown(cfg, rows) -> str:
  """The rows as a table, headed by the model they describe."""
  m = ModelConfig.of(cfg.model)
  kib = lambda b: f"{b / 1024:,.0f}"
  out = [f"{m.num_layers} layers, hidden {m.hidden_size} in {m.num_stripes} "
         f"stripes ({m.stripe_input}), vocabulary {m.vocab_size}, "
         f"{cfg.optim.name}; batch {cfg.data.batch_size} x window "
         f"{cfg.data.seq_len}, {len(jax.devices())} devices. KiB per device.",
         "",
         "| data x stripe | params | of which layers | optimizer | XLA temporaries "
         "| all-gather | reduce-scatter | all-to-all | all-reduce | "
         "in a time loop |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    c = r["collectives"]
    out.append(
        f"| {r['data']} x {r['stripe']} | {kib(r['param_bytes'])} | "
        f"{kib(r['layer_param_bytes'])} | {kib(r['opt_bytes'])} | "
        f"{kib(r['temp_bytes'])} | "
        + " | ".join(str(c[k]) for k in KINDS)
        + f" | {r['in_time_loops']} |")
  return "\n".join(out)
