"""SamplingParams as tensors and JSON: one Triton input per dataclass field.

`--mode=export` writes the manifest's `sample` defaults (`to_json`) and
config.pbtxt's optional inputs (`config_inputs`) from this module, the
Triton model reads a request's inputs with it (`read`), and clients build
them with it (`rows`). All of them walk `dataclasses.fields(SamplingParams)`,
so a field added to the type becomes an input everywhere with no edit, or,
when its annotation has no encoding in `ENCODINGS`, export refuses it.

An input is the field's name in capitals with one row per prompt; the model
reads the first row. An absent input takes the manifest's default.
"""

import dataclasses
import json

import numpy as np

from .params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Encoding:
  """How values of one annotation travel: a row of `dims` of `dtype`."""
  triton_type: str        # config.pbtxt's data_type
  dtype: type
  dims: tuple             # one row's shape; -1 = any length
  encode: object          # value -> numpy array of `dims`
  decode: object          # one row (numpy) -> value
  from_json: object       # the manifest's JSON value -> value


def _whole(x) -> int:
  if not float(x).is_integer():
    raise ValueError(f"{x} is not a whole number")
  return int(x)


def _scalar(cast, dtype, triton_type):
  return Encoding(triton_type, dtype, (1,),
                  encode=lambda v: np.array([v], dtype),
                  decode=lambda row: cast(np.asarray(row).reshape(-1)[0]),
                  from_json=lambda v: v if v is None else cast(v))


def _encode_strings(v):
  if any("\0" in s for s in v):
    raise ValueError("a string holds a NUL byte, which separates them")
  return np.frombuffer("\0".join(v).encode("utf-8"), np.uint8)


def _decode_strings(row):
  data = np.asarray(row, np.uint8).tobytes()
  return tuple(data.decode("utf-8").split("\0")) if data else ()


def _encode_pairs(v):
  return np.array([[t, b] for t, b in v], np.float64).reshape(-1, 2)


def _decode_pairs(row):
  return tuple((_whole(t), float(b))
               for t, b in np.asarray(row, np.float64).reshape(-1, 2))


_INT = _scalar(int, np.int64, "TYPE_INT64")
_FLOAT = _scalar(float, np.float64, "TYPE_FP64")  # a Python float, exactly

# By annotation. Ids are INT64 rows of any length; strings are UTF-8
# bytes joined by NUL (UINT8, not BYTES:
# Triton 2.51's Python backend misreads BYTES under numpy 2); pairs are
# [n, 2] rows (ids up to 2^31 - 1 are exact in float64).
ENCODINGS = {
    int: _INT,
    int | None: _INT,       # None: the input is absent
    float: _FLOAT,
    float | None: _FLOAT,
    tuple[int, ...]: Encoding(
        "TYPE_INT64", np.int64, (-1,), lambda v: np.array(v, np.int64),
        lambda row: tuple(int(x) for x in np.asarray(row).reshape(-1)),
        lambda v: tuple(int(x) for x in v)),
    tuple[str, ...]: Encoding(
        "TYPE_UINT8", np.uint8, (-1,), _encode_strings, _decode_strings,
        lambda v: tuple(v)),
    tuple[tuple[int, float], ...]: Encoding(
        "TYPE_FP64", np.float64, (-1, 2), _encode_pairs, _decode_pairs,
        lambda v: tuple((int(t), float(b)) for t, b in v)),
}


@dataclasses.dataclass(frozen=True)
class Input:
  """One SamplingParams field as a Triton input."""
  field: str
  name: str
  encoding: Encoding


def inputs() -> list[Input]:
  """Every field's input, in the dataclass's order; TypeError for a field
  whose annotation has no encoding (so it is never dropped silently)."""
  out = []
  for f in dataclasses.fields(SamplingParams):
    if f.type not in ENCODINGS:
      raise TypeError(f"SamplingParams.{f.name} is annotated {f.type}, "
                      "which has no Triton encoding: add one to "
                      "ENCODINGS in engine/wire.py")
    out.append(Input(f.name, f.name.upper(), ENCODINGS[f.type]))
  return out


def by_name() -> dict[str, Input]:
  return {i.name: i for i in inputs()}


def rows(name: str, value, count: int) -> np.ndarray:
  """Input `name` carrying `value` in each of `count` rows; ValueError
  naming the input for an unknown name or a value it cannot carry."""
  known = by_name()
  if name not in known:
    raise ValueError(f"unknown input {name}: use {', '.join(known)}")
  encoding = known[name].encoding
  try:
    row = encoding.encode(value)
  except (OverflowError, TypeError, ValueError) as e:
    raise ValueError(f"{name}: {value!r} cannot travel as "
                     f"{encoding.triton_type} ({e})") from None
  return np.broadcast_to(row, (count,) + row.shape).copy()


def read(tensor) -> dict:
  """The fields a request sends: `tensor(name)` is its input as numpy, or
  None when absent. ValueError naming the input for a malformed one."""
  values = {}
  for i in inputs():
    array = tensor(i.name)
    if array is None:
      continue
    array = np.asarray(array)
    if array.ndim != 1 + len(i.encoding.dims) or not len(array):
      raise ValueError(f"{i.name} must be {i.encoding.triton_type} "
                       f"[batch, {', '.join(map(str, i.encoding.dims))}]")
    try:
      values[i.field] = i.encoding.decode(array[0])
    except (UnicodeDecodeError, ValueError) as e:
      raise ValueError(f"{i.name}: {e}") from None
  return values


def to_json(params: SamplingParams) -> dict:
  """Every field's value, for the manifest (tuples become lists)."""
  return json.loads(json.dumps(dataclasses.asdict(params)))


def from_json(values: dict) -> dict:
  """The manifest's `sample` as SamplingParams' fields; ValueError when it
  lacks a field or holds one the type does not (an export from another
  version)."""
  names = {i.field for i in inputs()}
  missing, unknown = names - set(values), set(values) - names
  if missing or unknown:
    raise ValueError(
        f"manifest.json's sample lacks {sorted(missing)} and has unknown "
        f"{sorted(unknown)}: export again with the zebra_jax whose engine "
        "this model runs")
  return {i.field: i.encoding.from_json(values[i.field]) for i in inputs()}


def config_inputs() -> str:
  """config.pbtxt's optional input entries, one per field."""
  lines = []
  for i in inputs():
    ragged = ("\n    allow_ragged_batch: true" if -1 in i.encoding.dims
              else "")
    dims = ", ".join(map(str, i.encoding.dims))
    lines.append(f'  {{ name: "{i.name}"  data_type: '
                 f"{i.encoding.triton_type}  dims: [ {dims} ]  optional: true"
                 f"{ragged} }}")
  return ",\n".join(lines)
