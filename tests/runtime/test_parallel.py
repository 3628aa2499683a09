"""Data parallelism, gradient accumulation, mixed precision and loss scaling.

The reference for every multi-device result is the same computation on one
device (a 1-device mesh in this process) or in one process.
"""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.errors import UserError
from zebra_jax.runtime import checkpoint, parallel
from zebra_jax.training import loop, train_state
from tests.helpers import (REPO, assert_trees_close, random_batches,
                           run_train_steps, tiny_sgd_config, tiny_word_config,
                           write_wikitext)


# wt103.py:tiny has the adaptive head, whose chunked loss sorts rows over the
# global (sharded) batch; the full head is checked at 8 devices.
@pytest.mark.parametrize("num_devices,head", [(2, "adaptive"), (4, "adaptive"),
                                              (8, "adaptive"), (8, "full")])
def test_sharded_steps_equal_single_device(num_devices, head):
  cfg = tiny_sgd_config(head=head)
  batches = random_batches(cfg, 3)
  one, m1 = run_train_steps(cfg, 1, batches)
  many, mn = run_train_steps(cfg, num_devices, batches)
  assert_trees_close(one.params, many.params, atol=1e-6)
  assert_trees_close(one.carry, many.carry, atol=1e-6)
  for a, b in zip(m1, mn):
    assert a["loss_sum"] == pytest.approx(b["loss_sum"], rel=1e-6)
  # The run moved: params after 3 steps differ from the initial ones.
  init = train_state.init_state(cfg, parallel.make_mesh(jax.devices()[:1]))[2]
  for a, b in zip(jax.tree.leaves(init.params), jax.tree.leaves(one.params)):
    assert not np.allclose(jax.device_get(a), b)  # every parameter learns


def test_carry_and_batch_are_sharded_params_replicated():
  cfg = tiny_sgd_config()
  mesh = parallel.make_mesh()
  _, _, state = train_state.init_state(cfg, mesh)
  h0 = state.carry[0][0]
  assert h0.sharding.spec == jax.sharding.PartitionSpec("data")
  assert len(h0.addressable_shards) == 8
  assert h0.addressable_shards[0].data.shape == (cfg.data.batch_size // 8,
                                                 cfg.model.hidden_size)
  assert all(x.sharding.is_fully_replicated
             for x in jax.tree.leaves(state.params))


def test_gradient_accumulation_gives_the_same_update():
  cfg = tiny_sgd_config()
  batches = random_batches(cfg, 2)
  k1, m1 = run_train_steps(cfg, 8, batches, accum=1)
  # 2 devices x 4 micro-batches
  k2, m2 = run_train_steps(cfg, 2, batches, accum=4)
  assert_trees_close(k1.params, k2.params, atol=1e-6)
  assert_trees_close(k1.carry, k2.carry, atol=1e-6)
  assert m1[-1]["loss_sum"] == pytest.approx(m2[-1]["loss_sum"], rel=1e-6)
  assert m1[-1]["grad_norm"] == pytest.approx(m2[-1]["grad_norm"], rel=1e-5)


def test_batch_that_does_not_split_is_a_config_error():
  with pytest.raises(UserError, match="does not divide over 8 devices"):
    parallel.check_batch(12, "data.batch_size")
  with pytest.raises(UserError, match="micro-batches"):
    parallel.check_batch(16, "data.batch_size", micro_batches=4)


def _overflowing(state):
  """The same state with a loss scale so large that the scaled grads overflow."""
  huge = jnp.asarray(np.finfo(np.float32).max, jnp.float32)
  return state.replace(loss_scale=state.loss_scale.replace(scale=huge))


@pytest.mark.parametrize("num_devices", [1, 8])
def test_float16_overflow_skips_the_step(num_devices):
  cfg = tiny_sgd_config(dtype="float16")
  mesh = parallel.make_mesh(jax.devices()[:num_devices])
  _, _, state = train_state.init_state(cfg, mesh)
  before = jax.device_get(_overflowing(state))
  after, metrics = run_train_steps(cfg, num_devices, random_batches(cfg, 1),
                                   state=_overflowing(state))
  assert metrics[0]["skipped"] == 1.0
  for x, y in zip(jax.tree.leaves((before.params, before.opt_state)),
                  jax.tree.leaves((after.params, after.opt_state))):
    np.testing.assert_array_equal(x, y)  # bit-identical
  assert float(after.loss_scale.scale) == float(before.loss_scale.scale) / 2
  assert int(after.loss_scale.skipped) == 1
  assert int(after.step) == 1  # the step counter still advances


def test_float16_scale_grows_after_good_steps_and_training_proceeds():
  cfg = tiny_sgd_config(dtype="float16")
  cfg.train.loss_scale.growth_interval = 2
  state, metrics = run_train_steps(cfg, 8, random_batches(cfg, 3))
  assert [m["skipped"] for m in metrics] == [0.0, 0.0, 0.0]
  start = cfg.train.loss_scale.initial_scale
  assert float(state.loss_scale.scale) == start * 2  # grew once after 2 steps
  assert int(state.loss_scale.good_steps) == 1


def test_float32_non_finite_step_is_skipped_too():
  cfg = tiny_sgd_config()
  mesh = parallel.make_mesh(jax.devices()[:8])
  _, _, state = train_state.init_state(cfg, mesh)
  poisoned = jax.tree.map(lambda x: x, state)
  w_x = poisoned.params["layers"][0]["w_x"]
  w_x[...] = w_x[...].at[0, 0, 0].set(jnp.nan)
  before = jax.device_get(poisoned)
  after, metrics = run_train_steps(cfg, 8, random_batches(cfg, 1),
                                   state=poisoned)
  assert metrics[0]["skipped"] == 1.0
  np.testing.assert_array_equal(before.params["layers"][0]["w_h"][...],
                                after.params["layers"][0]["w_h"][...])
  assert float(after.loss_scale.scale) == 1.0  # no scaling outside float16


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_trains_like_float32(tmp_path, dtype):
  data = write_wikitext(tmp_path / "wt")
  losses = {}
  for name in ("float32", dtype):
    cfg = tiny_word_config(data)
    cfg.model.dtype = name
    cfg.train.update(num_steps=40, eval_every=40, report_at_end=False)
    loop.run(cfg, str(tmp_path / name))
    records = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")]
    train_losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert train_losses[-1] < train_losses[0] - 0.3, name  # it learns
    losses[name] = [r["loss"] for r in records if r["kind"] == "valid"][-1]
  assert losses[dtype] == pytest.approx(losses["float32"], abs=0.1)


def test_checkpoint_from_8_devices_restores_on_2_and_1(tmp_path):
  cfg = tiny_sgd_config()
  state, _ = run_train_steps(cfg, 8, random_batches(cfg, 1))
  mesh8 = parallel.make_mesh()
  _, target8 = train_state.abstract_state(cfg, mesh8)
  placed = jax.device_put(state, jax.tree.map(lambda s: s.sharding, target8))
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(1, placed, {"position": {"epoch": 0, "index": 1}})
  ckpt.close()
  for n in (2, 1):
    mesh = parallel.make_mesh(jax.devices()[:n])
    _, target = train_state.abstract_state(cfg, mesh)
    restored, meta = checkpoint.Checkpointer(str(tmp_path)).restore(1, target)
    assert meta["position"] == {"epoch": 0, "index": 1}
    h = restored.carry[0][0]
    assert len(h.sharding.device_set) == n
    assert_trees_close(state, jax.device_get(restored), atol=0)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _losses(stdout: str) -> list[float]:
  return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", stdout)]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  data = write_wikitext(tmp_path / "wt")
  args = ["-m", "zebra_jax.main", "--config=wt103:tiny",
          f"--config.data.path={data}", "--config.train.num_steps=4",
          "--config.train.log_every=1", "--config.train.report_at_end=false",
          "--config.data.batch_size=16", "--config.model.dropout_hidden=0",
          "--config.model.dropout_output=0"]
  env8 = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
              JAX_PLATFORMS="cpu")
  single = subprocess.run([sys.executable, *args, f"--workdir={tmp_path}/one"],
                          env=env8, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert single.returncode == 0, single.stderr
  env4 = dict(env8, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, *args, f"--workdir={tmp_path}/two",
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}"], env=env4, cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err
  assert "8 cpu device(s)" in outs[0][0]
  assert outs[1][0].count("| loss") == 0  # only process 0 logs
  one, two = _losses(single.stdout), _losses(outs[0][0])
  assert len(one) == 3 and len(two) == 3  # steps 2..4 (step 1 is compiling)
  np.testing.assert_allclose(one, two, atol=0.006)  # printed to 2 decimals
  m_one = [json.loads(l) for l in open(tmp_path / "one" / "metrics.jsonl")]
  m_two = [json.loads(l) for l in open(tmp_path / "two" / "metrics.jsonl")]
  np.testing.assert_allclose([r["loss"] for r in m_one if r["kind"] == "train"],
                             [r["loss"] for r in m_two if r["kind"] == "train"],
                             rtol=1e-5)
