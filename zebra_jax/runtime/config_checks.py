"""Config validation: every bad value becomes one line that says how to fix it.

Each field's own rule comes with its definition in config/base.py; the checks
here are those that read several fields together.
"""

import jax
import ml_collections

from zebra_jax.config import base
from zebra_jax.data import sources
from zebra_jax.errors import UserError
from zebra_jax.model.adaptive_softmax import cluster_bounds
from zebra_jax.runtime import parallel


def _get(cfg, dotted):
  node = cfg
  for part in dotted.split("."):
    if part not in node:
      raise UserError(f"config has no field {dotted}: start from the demo "
                      f"or wt103 config, which define every field")
    node = node[part]
  return node


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Raises UserError for the first bad value found."""
  for name, field in base.fields():
    error = field.rule.error(name, _get(cfg, name))
    if error:
      raise UserError(error)
  m = cfg.model
  if m.hidden_size % m.num_stripes:
    raise UserError(
        f"model.hidden_size={m.hidden_size} is not divisible by "
        f"model.num_stripes={m.num_stripes}: pick num_stripes that divides "
        f"hidden_size (e.g. {_divisor_hint(m.hidden_size, m.num_stripes)})")
  parallel.check_stripe_devices(cfg.parallel.stripe_devices, m.num_stripes,
                                jax.device_count())
  if m.head == "adaptive":
    _check_cutoffs(m.adaptive_cutoffs)
  if sources.SOURCES[cfg.data.source].needs_path and not cfg.data.path:
    raise UserError(f"data.source={cfg.data.source!r} needs a path: set "
                    f"--config.data.path to the folder or file(s) to read")


def _check_cutoffs(cutoffs) -> None:
  """A sequence of increasing positive ints (those >= vocab are dropped later)."""
  if not isinstance(cutoffs, (list, tuple)) or not all(
      isinstance(c, int) and not isinstance(c, bool) for c in cutoffs):
    raise UserError(f"--config.model.adaptive_cutoffs={cutoffs!r} is not a "
                    "tuple of word ids: use e.g. '(20000, 40000, 200000)'")
  cluster_bounds(0, cutoffs)  # positive and strictly increasing


def _divisor_hint(hidden: int, stripes: int) -> int:
  divisors = [d for d in range(1, hidden + 1) if hidden % d == 0]
  return min(divisors, key=lambda d: abs(d - stripes))
