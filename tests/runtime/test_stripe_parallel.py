"""Stripe parallelism: one model's stripes split over the mesh's "stripe" axis.

The reference for every result is the same computation on one device. The
compiled step is read back to check the design: no collective inside any time
loop, one exchange per layer boundary and window (and its transpose in the
backward pass), the head's re-layout by rows, and the gradient all-reduces.
"""

import functools
import re

import jax
import numpy as np
import pytest

from zebra_jax.errors import UserError
from zebra_jax.model import lm
from zebra_jax.model.config import ModelConfig
from zebra_jax.runtime import checkpoint, config_checks, parallel
from zebra_jax.training import loop, train_state
from tests import hlo_collectives as hc
from tests.helpers import (compiled_train_step, random_batches, stripe_config,
                           stripe_mesh)

MESHES = [(1, 8), (2, 4), (4, 2)]  # (data, stripe)


def _run(cfg, mesh, batches, accum=1, state=None):
  graphdef, tx, fresh = train_state.init_state(cfg, mesh)
  state = fresh if state is None else state
  step = loop.compile_train_step(graphdef, tx, mesh, state, accum)
  metrics = []
  for b in batches:
    batch = {k: parallel.global_batch(mesh, v) if v.ndim else v
             for k, v in b.items()}
    state, m = step(state, batch)
    metrics.append(jax.device_get(m))
  return state, metrics


def _assert_close(a, b, rtol=1e-6):
  """Every leaf within rtol of the reference, relative to its largest value."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    scale = max(float(np.max(np.abs(x))), 1e-30)
    assert float(np.max(np.abs(x - y))) <= rtol * scale


# ----------------------------------------------------------------- config


def test_stripe_devices_must_divide_stripes_and_devices():
  cfg = stripe_config(stripe_devices=3)
  cfg.model.num_stripes = 6
  cfg.model.hidden_size = 36
  with pytest.raises(UserError, match="does not divide the 8 devices"):
    config_checks.validate(cfg)
  cfg = stripe_config(stripe_devices=16)
  with pytest.raises(UserError, match="does not divide model.num_stripes=8"):
    config_checks.validate(cfg)
  with pytest.raises(UserError, match="stripe_devices=3"):
    parallel.make_mesh(stripe_devices=3)


def test_mesh_and_shardings():
  cfg = stripe_config("grouped")
  mesh = stripe_mesh(2, 4)
  assert mesh.axis_names == ("data", "stripe")
  assert dict(mesh.shape) == {"data": 2, "stripe": 4}
  _, _, state = train_state.init_state(cfg, mesh)
  layer = state.params["layers"][1]
  spec = lambda v: v[...].sharding.spec
  assert spec(layer["w_x"]) == jax.sharding.PartitionSpec("stripe")  # grouped
  assert spec(layer["w_h"]) == jax.sharding.PartitionSpec("stripe")
  assert spec(layer["b"]) == jax.sharding.PartitionSpec("stripe")
  assert state.params["embed"][...].sharding.is_fully_replicated
  moments = [x for path, x in jax.tree_util.tree_flatten_with_path(
      state.opt_state)[0] if "'w_h'" in jax.tree_util.keystr(path)]
  assert moments and all(m.sharding.spec == jax.sharding.PartitionSpec(
      "stripe") for m in moments)  # the optimizer state is split as well
  h = state.carry[0][0]
  assert h.sharding.spec == jax.sharding.PartitionSpec("data", "stripe")
  assert h.addressable_shards[0].data.shape == (4, 8)  # 8 rows / 2, 32 / 4
  dense = train_state.init_state(stripe_config("dense"), mesh)[2]
  assert spec(dense.params["layers"][0]["w_x"]) == jax.sharding.PartitionSpec(
      None, "stripe")
  # One stripe device: today's data-parallel shardings.
  one = train_state.init_state(cfg, stripe_mesh(8, 1))[2]
  assert one.carry[0][0].sharding.spec == jax.sharding.PartitionSpec("data")
  assert all(x.sharding.is_fully_replicated
             for x in jax.tree.leaves(one.params))


# ------------------------------------------- the compiled step, read back


def _design(cfg, data, stripe):
  """Collectives per train step (no accumulation) by the design, for the
  kinds the design fixes; all-reduces are checked apart (XLA combines them).
  Each exchange runs once forward and once, transposed, backward."""
  m = ModelConfig.of(cfg.model)
  width = m.hidden_size // m.num_stripes
  expect = {"all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}

  def exchange(all_to_all: bool):
    if all_to_all:
      expect["all-to-all"] += 2
    else:  # all-gather forward, reduce-scatter backward
      expect["all-gather"] += 1
      expect["reduce-scatter"] += 1

  grouped = m.stripe_input == "grouped"
  # The embedding, looked up by rows, gathered for each data group's rows
  # (a grouped first layer takes only its stripes' inputs: all-to-all).
  exchange(grouped and m.embed_size % m.num_stripes == 0)
  for _ in range(m.num_layers - 1):  # layer boundaries
    exchange(grouped and width % stripe == 0)
  exchange(True)  # the last window, re-laid out by rows for the head
  return expect


@pytest.mark.parametrize("stripe_input,data,stripe,recurrence", [
    ("dense", 1, 8, "scan"), ("grouped", 1, 8, "scan"),
    ("dense", 2, 4, "scan"), ("grouped", 2, 4, "scan"),
    ("grouped", 2, 4, "native")])
def test_no_collective_inside_the_time_loop(stripe_input, data, stripe,
                                            recurrence):
  cfg = stripe_config(stripe_input, stripe, recurrence=recurrence)
  text = compiled_train_step(cfg, data, stripe).as_text()
  # Two layers: a forward and a backward time loop each, as while loops or
  # as one call each into the native library (and, the stripes being
  # small, one call each for the window's weight gradients).
  if recurrence == "scan":
    assert len(hc.while_bodies(text)) == 4
  else:
    assert hc.while_bodies(text) == []
    calls = re.findall(r'custom_call_target="zebra_native_(\w+)_[0-9a-f]{12}"',
                       text)
    assert sorted(calls) == sorted(
        ["forward_projected", "backward_grads"] * 2)
  assert hc.in_while_loops(text) == []
  counts = hc.count(text)
  for kind, n in _design(cfg, data, stripe).items():
    assert counts.get(kind, 0) == n, (kind, counts)
  assert counts.get("collective-permute", 0) == 0
  # The exchange moves one window of layer outputs: [B/data, T, H] gathered,
  # or this device's [B/data, T, H/stripe] share for all-to-all.
  rows, t, h = 8 // data, 4, 32
  found = hc.collectives_in(text)
  # Every all-gather is one window of activations (the embedding's or a
  # layer's); every all-to-all and reduce-scatter moves this device's share
  # of one.
  assert {b for k, b in found if k == "all-gather"} <= {rows * t * h * 4}
  share = rows * t * h // stripe * 4
  assert {b for k, b in found
          if k in ("all-to-all", "reduce-scatter")} == {share}
  # All-reduces: scalars (loss sums, gradient norm, finiteness); the
  # embedding's and head's gradient, summed once over the whole mesh (the
  # tied table's lookup and head parts added first); with data > 1 the
  # layers' gradient over "data", this device's share of it.
  _, params = lm.create(ModelConfig.of(cfg.model), 0)
  layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
  other_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - layer_bytes
  sized = sorted(b for k, b in found if k == "all-reduce" and b > 16)
  expected = [other_bytes] + ([layer_bytes // stripe] if data > 1 else [])
  assert sized == sorted(expected)


@pytest.mark.parametrize("stripe_input", ["dense", "grouped"])
def test_data_parallel_step_moves_only_gradients(stripe_input):
  """With one stripe device each device runs its own rows end to end: the
  step's only collectives are all-reduces (the gradients and the scalars),
  never a gathered batch of activations."""
  cfg = stripe_config(stripe_input, 1)
  text = compiled_train_step(cfg, 8, 1).as_text()
  assert set(hc.count(text)) == {"all-reduce"}
  assert hc.in_while_loops(text) == []
  # Every parameter's gradient once: the tied table's lookup and head parts
  # are added on each device before the reduction.
  _, params = lm.create(ModelConfig.of(cfg.model), 0)
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  assert sum(b for k, b in hc.collectives_in(text)) == total


def test_accumulation_loop_holds_only_the_layer_exchanges():
  cfg = stripe_config("dense", 4, recurrence="scan")
  text = compiled_train_step(cfg, 2, 4, accum=2).as_text()
  bodies = hc.while_bodies(text)
  comps = hc.computations(text)
  # The time loops are the innermost ones: no while op in their bodies.
  inner = [b for b in bodies
           if not any(hc._opcode(l)[0] == "while" for l in comps[b])]
  assert len(inner) == 4
  assert hc.collectives_in(text, inner) == []


def test_parameter_state_per_device_shrinks_by_the_stripe_devices():
  """compiled.memory_analysis(): the step's arguments on one device hold
  1/p of the layers' parameters and optimizer state (SGD: one moment)."""
  cfg = stripe_config("grouped")
  sizes = {}
  for data, stripe in ((8, 1), (1, 8)):
    cfg.parallel.stripe_devices = stripe
    sizes[stripe] = compiled_train_step(
        cfg, data, stripe).memory_analysis().argument_size_in_bytes
  _, params = lm.create(ModelConfig.of(cfg.model), 0)
  layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
  # 8 rows per device instead of 1: inputs and targets, int32 [rows, 4].
  batch = 2 * (8 - 1) * 4 * 4
  assert sizes[1] - sizes[8] == 2 * layer_bytes * 7 // 8 - batch


# ------------------------------------------------------- the same numbers


@pytest.mark.parametrize("stripe_input", ["dense", "grouped"])
@pytest.mark.parametrize("data,stripe", MESHES)
def test_steps_equal_single_device(stripe_input, data, stripe):
  cfg = stripe_config(stripe_input, stripe)
  batches = random_batches(cfg, 3)
  one, m1 = _run(cfg, stripe_mesh(1, 1), batches)
  many, mn = _run(cfg, stripe_mesh(data, stripe), batches)
  assert many.params["layers"][0]["w_h"][...].sharding.spec[0] == "stripe"
  _assert_close(jax.device_get(one.params), jax.device_get(many.params))
  _assert_close(jax.device_get(one.carry), jax.device_get(many.carry))
  for a, b in zip(m1, mn):
    assert a["loss_sum"] == pytest.approx(b["loss_sum"], rel=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_dropout_masks_equal_single_device():
  """Dropout between layers draws the same mask on a stripe-split window."""
  cfg = stripe_config("dense", 4, dropout_hidden=0.3, dropout_output=0.3)
  batches = random_batches(cfg, 2)
  one, m1 = _run(cfg, stripe_mesh(1, 1), batches)
  many, mn = _run(cfg, stripe_mesh(2, 4), batches)
  _assert_close(jax.device_get(one.params), jax.device_get(many.params))
  assert m1[-1]["loss_sum"] == pytest.approx(mn[-1]["loss_sum"], rel=1e-6)


ADAPTIVE = {"head": "adaptive", "adaptive_cutoffs": (8, 16),
            "adaptive_div_val": 2, "adaptive_chunk_rows": 8}


@pytest.mark.parametrize("stripe_input,head", [
    ("dense", {}), ("grouped", {}), ("grouped", ADAPTIVE)])
def test_gradients_equal_single_device(stripe_input, head):
  """Loss and every gradient, the full and the tied adaptive head (its
  tables shared with the adaptive input) run on rows over the mesh."""
  cfg = stripe_config(stripe_input, 4, **head)
  b = random_batches(cfg, 1)[0]

  def grads(mesh):
    graphdef, _, state = train_state.init_state(cfg, mesh)
    def loss(params, inputs, targets, carry):
      sums, _ = lm.token_sums(graphdef, params, inputs, targets, carry,
                              mesh=mesh)
      return sums["loss_sum"] / targets.size, sums["correct"]
    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    inputs, targets = (parallel.global_batch(mesh, b[k])
                       for k in ("inputs", "targets"))
    return jax.device_get(fn(state.params, inputs, targets, state.carry))

  ((l1, c1), g1), ((ln, cn), gn) = grads(stripe_mesh(1, 1)), grads(stripe_mesh(2, 4))
  assert float(l1) == pytest.approx(float(ln), rel=1e-6)
  assert float(c1) == float(cn)
  _assert_close(g1, gn)


def test_scores_and_logits_equal_single_device():
  """The per-row outputs (scoring's log p, sampling's logits) come back in
  row order, split over the mesh or, for rows that do not divide, whole."""
  cfg = stripe_config("grouped", 4, **ADAPTIVE)
  b = random_batches(cfg, 1)[0]

  def outputs(mesh, rows):
    graphdef, _, state = train_state.init_state(cfg, mesh)
    carry = jax.tree.map(lambda x: x[:rows], state.carry)
    logp = jax.jit(functools.partial(
        lm.target_log_probs, graphdef, mesh=mesh))(
            state.params, b["inputs"][:rows], b["targets"][:rows], carry)[0]
    logits = jax.jit(functools.partial(lm.apply, graphdef, mesh=mesh))(
        state.params, b["inputs"][:rows], carry)[0]
    return jax.device_get((logp, logits))

  for rows in (8, 2):  # 8 rows over 8 devices; 2 do not divide
    one = outputs(stripe_mesh(1, 1), rows)
    many = outputs(stripe_mesh(1, 4) if rows == 2 else stripe_mesh(2, 4), rows)
    _assert_close(one, many)


@pytest.mark.parametrize("stripe_input", ["dense", "grouped"])
def test_remat_and_accumulation_equal_single_device(stripe_input):
  cfg = stripe_config(stripe_input, 4, remat=True)
  batches = random_batches(cfg, 2)
  one, m1 = _run(cfg, stripe_mesh(1, 1), batches)
  many, mn = _run(cfg, stripe_mesh(2, 4), batches, accum=2)
  _assert_close(jax.device_get(one.params), jax.device_get(many.params))
  _assert_close(jax.device_get(one.carry), jax.device_get(many.carry))
  assert m1[-1]["loss_sum"] == pytest.approx(mn[-1]["loss_sum"], rel=1e-6)


@pytest.mark.slow
def test_pallas_kernel_on_each_devices_stripes():
  """The fused kernel (interpret mode off GPUs) runs inside shard_map too."""
  cfg = stripe_config("grouped", 4, recurrence="pallas")
  batches = random_batches(cfg, 1)
  one, _ = _run(cfg, stripe_mesh(1, 1), batches)
  many, _ = _run(cfg, stripe_mesh(2, 4), batches)
  _assert_close(jax.device_get(one.params), jax.device_get(many.params))


def test_checkpoint_moves_between_meshes(tmp_path):
  cfg = stripe_config("grouped", 8)
  batches = random_batches(cfg, 2)
  first, _ = _run(cfg, stripe_mesh(1, 8), batches[:1])
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(1, first, {"position": {"epoch": 0, "index": 1}})
  ckpt.close()
  saved = jax.device_get(first)
  reference, _ = _run(cfg, stripe_mesh(1, 8), batches[1:], state=first)  # donated
  for data, stripe in ((8, 1), (1, 1)):
    mesh = stripe_mesh(data, stripe)
    _, target = train_state.abstract_state(cfg, mesh)
    restored, _ = checkpoint.Checkpointer(str(tmp_path)).restore(1, target)
    _assert_close(saved, jax.device_get(restored), rtol=0)
    after, _ = _run(cfg, mesh, batches[1:], state=restored)
    _assert_close(jax.device_get(reference.params),
                  jax.device_get(after.params))


# --------------------------------------------------------------- end to end


def test_train_and_eval_with_stripe_devices(tmp_path):
  cfg = stripe_config("grouped", 4)
  cfg.data.source, cfg.data.path = "text", str(tmp_path / "story.txt")
  (tmp_path / "story.txt").write_text("".join(
      f"line {i}: the quick brown fox jumps over the lazy dog.\n"
      for i in range(100)))
  cfg.model.vocab_size = 0
  cfg.train.update(num_steps=4, eval_every=4, log_every=2,
                   eval_max_batches=2)
  summary = loop.run(cfg, str(tmp_path / "run"))
  assert summary["steps"] == 4
  assert np.isfinite(summary["best_valid_loss"])
