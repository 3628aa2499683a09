"""Every config field, as zebra_jax defines it: the starting point of a config.

The fields, their defaults, what each means and which values it allows live
in zebra_jax/config/base.py; this config returns them as they stand.
Experiment configs (demo.py, wt103.py) start from `get_config()` and
state only what differs. Any field can be overridden on the command line,
e.g. --config.model.num_stripes=8.

  python -m zebra_jax.main --config=base   # runs as it stands
"""

import ml_collections

from zebra_jax.config import base


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  if variant:
    raise ValueError(f"unknown variant {variant!r}: base has none; use "
                     "demo:tiny or wt103:tiny")
  return base.get_config()
