"""Dropout's keep masks: JAX's threefry2x32 bit for bit, the keep rate,
and the same mask on one device as over a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import random as jex_random
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zebra_jax.model import dropout


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_the_hash_is_jaxs_threefry2x32(seed):
  rng = np.random.default_rng(seed)
  k0, k1 = (jnp.uint32(w) for w in rng.integers(0, 2 ** 32, 2))
  counts = jnp.asarray(rng.integers(0, 2 ** 32, 2 * 999), jnp.uint32)
  want = np.asarray(jex_random.threefry_2x32((k0, k1), counts))
  got = jax.jit(dropout.threefry2x32)(k0, k1, counts[:999], counts[999:])
  np.testing.assert_array_equal(np.concatenate([np.asarray(g) for g in got]),
                                want)


@pytest.mark.parametrize("shape", [(4001,), (20, 35, 200)])
def test_keep_mask_keeps_at_the_rate_asked(shape):
  size = int(np.prod(shape))
  for keep in (0.8, 0.5, 0.1):
    mask = np.asarray(dropout.keep_mask(jax.random.key(7), keep, shape))
    assert mask.shape == shape and mask.dtype == bool
    # within 5 binomial standard deviations
    assert abs(mask.mean() - keep) < 5 * np.sqrt(keep * (1 - keep) / size)


def test_keys_draw_their_own_masks_and_the_same_key_the_same():
  shape = (50, 40)
  a = dropout.keep_mask(jax.random.key(1), 0.5, shape)
  again = dropout.keep_mask(jax.random.key(1), 0.5, shape)
  b = dropout.keep_mask(jax.random.key(2), 0.5, shape)
  raw = dropout.keep_mask(jax.random.PRNGKey(1), 0.5, shape)
  np.testing.assert_array_equal(a, again)
  np.testing.assert_array_equal(a, raw)  # a raw uint32[2] key: the same
  assert 0.3 < np.mean(np.asarray(a) != np.asarray(b)) < 0.7


def test_a_sharded_mask_is_one_devices_mask():
  devices = np.array(jax.devices())
  if len(devices) < 2:
    pytest.skip("one device: set XLA_FLAGS=--xla_force_host_platform_device_count=8")
  mesh = Mesh(devices, ("x",))
  shape = (len(devices) * 5, 35, 200)
  draw = lambda key: dropout.keep_mask(key, 0.8, shape)
  whole = jax.jit(draw)(jax.random.key(3))
  sharded = jax.jit(draw, out_shardings=NamedSharding(mesh, P("x")))(
      jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(sharded), np.asarray(whole))


def test_another_prngs_key_draws_by_bernoulli():
  key = jax.random.key(5, impl="rbg")
  np.testing.assert_array_equal(
      dropout.keep_mask(key, 0.7, (300,)),
      jax.random.bernoulli(key, 0.7, (300,)))
