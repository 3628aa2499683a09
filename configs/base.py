"""Every config field, as zebra_jax defines it: the starting point of a config.

The fields, their defaults, what each means and which values it allows live
in the package (zebra_jax/config/base.py), so an installed package has them
too. Experiment configs (demo.py, wt103.py) start from `get_config()` and
state only what differs. Any field can be overridden on the command line,
e.g. --config.model.num_stripes=8.

  python -m zebra_jax.main --config=configs/base.py   # runs as it stands
"""

import ml_collections

from zebra_jax.config import base


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  if variant:
    raise ValueError(f"unknown variant {variant!r}: configs/base.py has "
                     "none; use configs/demo.py:tiny or configs/wt103.py:tiny")
  return base.get_config()
