"""Inverted dropout, its keep masks drawn by threefry2x32 written out.

Why not `jax.random.bernoulli`: JAX lowers threefry on a CPU as a loop of
its five rounds, and XLA copies the loop's state (two [N] counter arrays)
every round: at the word_language_model shape (three [20, 35, 200] masks
a step) the masks took 1.9 ms of a 40-51 ms train step. The same hash, its
rounds unrolled in jax.numpy, fuses into one elementwise pass. It is
JAX's threefry2x32 (Salmon et al. 2011: its rotations and key schedule),
tested bit for bit against `jax.extend.random.threefry_2x32`. Each
element's bits come from the mask's key and the element's index, so a
sharded array draws the same mask as one device does.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32 with 20 rounds: key words k0, k1 (uint32 scalars), counter
  words x0, x1 (uint32 arrays) -> two uint32 arrays of their shape."""
  ks = (k0, k1, k0 ^ k1 ^ _PARITY)
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
      x1 = x0 ^ x1
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def _key_words(rng):
  """The key's two uint32 words, or None for a key of another PRNG."""
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  return None if rng.shape != (2,) else (rng[0], rng[1])


def keep_mask(rng, keep: float, shape) -> jax.Array:
  """A bool array of `shape`, each element True with probability `keep`
  (to 2^-32), from a threefry key; another PRNG's key draws by
  jax.random.bernoulli."""
  words = _key_words(rng)
  if words is None:
    return jax.random.bernoulli(rng, keep, shape)
  size = int(np.prod(shape))
  half = (size + 1) // 2
  counters = lax.iota(jnp.uint32, half)
  bits = jnp.concatenate(threefry2x32(*words, counters,
                                      jnp.zeros_like(counters)))
  threshold = np.uint32(min(round(keep * 2.0 ** 32), 2 ** 32 - 1))
  return (bits[:size] < threshold).reshape(shape)


def dropout(x, rate: float, rng):
  """Inverted dropout; a no-op when rng is None (evaluation) or rate is 0."""
  if rng is None or rate == 0.0:
    return x
  keep = keep_mask(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
