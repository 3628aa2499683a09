"""Files zebra_jax writes parse with strict JSON readers: no NaN/Infinity."""

import json
import numpy as np
import pytest

from zebra_jax import strict_json
from zebra_jax.runtime import writer


def _strict_loads(text):
  def reject(constant):
    raise ValueError(f"{constant} is not JSON")
  return json.loads(text, parse_constant=reject)


def test_non_finite_values_become_null_at_any_depth():
  value = {"a": float("inf"), "b": [1.5, float("nan"), (np.float32("-inf"),)],
           "c": {"d": np.float64(2.5), "e": np.int64(3)}, "f": "NaN"}
  text = strict_json.dumps(value, sort_keys=True)
  assert _strict_loads(text) == {"a": None, "b": [1.5, None, [None]],
                                 "c": {"d": 2.5, "e": 3}, "f": "NaN"}
  # Python's own json writes what strict readers reject.
  with pytest.raises(ValueError):
    _strict_loads(json.dumps({"a": float("inf")}))


def test_dump_writes_null(tmp_path):
  path = tmp_path / "x.json"
  with open(path, "w") as f:
    strict_json.dump({"x": [float("nan"), 1.0]}, f, indent=2)
  assert _strict_loads(path.read_text()) == {"x": [None, 1.0]}


def test_metrics_jsonl_writes_null_for_non_finite(tmp_path):
  log = writer.MetricWriter(str(tmp_path), tensorboard=False)
  log.record("summary", 3, {"best_valid_loss": float("inf"),
                            "loss": float("nan"), "ppl": 4.0})
  log.close()
  [line] = (tmp_path / "metrics.jsonl").read_text().splitlines()
  record = _strict_loads(line)
  assert record["best_valid_loss"] is None and record["loss"] is None
  assert record["ppl"] == 4.0 and record["step"] == 3
