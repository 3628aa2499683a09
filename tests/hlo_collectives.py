"""Collectives in a compiled XLA program, read from its HLO text.

What the stripe-parallel tests and lab/notes/scaling-model.md check the
design against: how many collectives of each kind a step runs, how many
bytes they move, and whether any sits inside a while loop (a `lax.scan`:
the recurrence's time loop). The tests own it; the lab's stripe-layout table
reads the same counts with it.
"""

import collections
import re

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter",
               "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1,
                "f64": 8, "s64": 8, "u64": 8, "s8": 1, "u8": 1, "s16": 2,
                "u16": 2}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# "%name = type[dims]{layout} opcode(" or a tuple type "(t1, t2) opcode("
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s"
                          r"([a-z][\w\-]*)\(")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|"
                     r"false_computation|branch_computations)=\{?([^,}\)]+"
                     r"(?:,\s*%?[\w.\-]+)*)\}?")
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")


def computations(hlo: str) -> dict[str, list[str]]:
  """Each computation's name -> its instruction lines."""
  comps, name = {}, None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("{")[0].split("(")[0]:
      name = m.group(1)
      comps[name] = []
    elif line.strip() == "}":
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps


def _opcode(line: str):
  m = _INSTRUCTION.match(line)
  return (m.group(2), m.group(1)) if m else (None, None)


def _kind(opcode):
  """all-gather-start -> all-gather; None for anything not a collective."""
  for kind in COLLECTIVES:
    if opcode in (kind, kind + "-start"):
      return kind
  return None


def _group_size(line: str):
  """Devices per replica group, where the text says; None otherwise."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\})", line)
  if m:
    return len(m.group(1).strip("{}").split(","))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return int(np.prod([int(sizes[a]) for a in
                        re.findall(r"'(\w+)'", m.group(2))]))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if m:
    return int(m.group(2))
  return None


def _called(line: str) -> list[str]:
  names = []
  for m in _CALLED.finditer(line):
    names += [n.strip().lstrip("%") for n in m.group(1).split(",")]
  return names


def _bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(shape_text):
    if not dims:  # scalars (loss sums, norms, flags): left out
      continue
    size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += size * _DTYPE_BYTES.get(dtype, 4)
  return total


def _reachable(comps, roots) -> set[str]:
  seen, todo = set(), list(roots)
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      todo += _called(line)
  return seen


def while_bodies(hlo: str) -> list[str]:
  """The body computation of every while op."""
  bodies = []
  for lines in computations(hlo).values():
    for line in lines:
      if _opcode(line)[0] == "while":
        bodies += re.findall(r"body=%?([\w.\-]+)", line)
  return bodies


def collectives_in(hlo: str, roots=None) -> list[tuple[str, int]]:
  """(kind, result bytes without scalars) of every collective in the computations reachable
  from `roots` (default: the whole program)."""
  comps = computations(hlo)
  names = comps if roots is None else _reachable(comps, roots)
  found = []
  for name in names:
    for line in comps[name]:
      opcode, shape = _opcode(line)
      kind = _kind(opcode)
      if kind and _group_size(line) != 1:  # groups of one device: no-ops
        found.append((kind, _bytes(shape)))
  return found


def ring_bytes_sent(kind: str, result_bytes: int, group: int) -> float:
  """Bytes one device sends for a collective over `group` devices whose
  result has `result_bytes` (ring algorithms; all-to-all sends all but its
  own share)."""
  share = (group - 1) / group
  return {"all-gather": share * result_bytes,
          "reduce-scatter": (group - 1) * result_bytes,
          "all-to-all": share * result_bytes,
          "all-reduce": 2 * share * result_bytes}.get(kind, result_bytes)


def count(hlo: str, roots=None) -> dict[str, int]:
  return dict(collections.Counter(k for k, _ in collectives_in(hlo, roots)))


def in_while_loops(hlo: str) -> list[tuple[str, int]]:
  """Collectives inside any while loop's body (or what it calls)."""
  return collectives_in(hlo, while_bodies(hlo))
