"""JSON that every parser accepts: non-finite floats become null.

Python's json module writes float("inf") and float("nan") as the bare words
Infinity and NaN, which are not JSON: jq, JavaScript's JSON.parse, Go and most
other readers reject the whole line. Every file and response zebra_jax writes
goes through here; allow_nan=False makes a value that slipped past the
conversion fail loudly instead of writing a broken file.
"""

import json
import math
from typing import Any

import numpy as np


def finite(value: Any) -> Any:
  """`value` with every non-finite float (NumPy's too) replaced by None,
  inside dicts, lists and tuples; NumPy scalars become Python numbers."""
  if isinstance(value, dict):
    return {k: finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [finite(v) for v in value]
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def dumps(value: Any, **kwargs) -> str:
  """json.dumps of finite(value), refusing NaN and Infinity literals.

  Most values have nothing to convert: they go straight to the encoder,
  which refuses a non-finite float (ValueError) and a NumPy scalar
  (TypeError); only then is the value walked. The text is the same either
  way (finite changes nothing else), and a server's answer of a few
  hundred log-probabilities is not walked twice."""
  try:
    return json.dumps(value, allow_nan=False, **kwargs)
  except (ValueError, TypeError):
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def dump(value: Any, f, **kwargs) -> None:
  """json.dump of finite(value), refusing NaN and Infinity literals."""
  json.dump(finite(value), f, allow_nan=False, **kwargs)
