"""The package's import graph: no cycles, and imports only run downward.

Floors, lowest first (as docs/architecture.md and the README draw them):
errors; model and data (side by side, neither imports the other); config;
runtime; inference; training; benchmarks (they time training and
inference); cli (flag parsing and mode dispatch, shared by main and the
tools); tools (scripts: nothing imports them); main. A module imports only
from its own part and the floors below it: no two parts may import each
other. Imports made inside functions count as much as those at the top of a
module: a lazy import that dodges a cycle is still a cycle.
"""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "zebra_jax")

# Lowest first; the parts of one floor do not import each other.
FLOORS = (("errors",), ("model", "data"), ("config",), ("runtime",),
          ("inference",), ("training",), ("benchmarks",), ("cli",),
          ("tools",), ("main",))
# What each part may import from the package (besides itself): the floors
# below its own.
ALLOWED = {part: {low for below in FLOORS[:level] for low in below}
           for level, floor in enumerate(FLOORS) for part in floor}


def _modules() -> dict[str, str]:
  """Dotted module name -> file path, for every module of the package."""
  found = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3]
      dotted = rel.replace(os.sep, ".").removesuffix(".__init__")
      found[dotted] = path
  return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
  """The package modules `path` imports, wherever in the file it does."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      # `from a.b import c` imports the module a.b.c when there is one, else
      # the name c from a.b.
      names = [f"{node.module}.{a.name}"
               if f"{node.module}.{a.name}" in modules else node.module
               for a in node.names]
    else:
      continue
    out.update(n for n in names if n in modules)
  return out


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(path, modules) for name, path in modules.items()}


def _part(module: str) -> str:
  """The part a module belongs to: its subpackage, or the module itself for
  zebra_jax.main and zebra_jax.errors."""
  parts = module.split(".")
  if len(parts) == 1:
    return "package"
  return parts[1]


def test_the_graph_is_read_from_the_package():
  graph = _graph()  # the checks below mean nothing on an empty graph
  assert "zebra_jax.model.lm" in graph and "zebra_jax.main" in graph
  assert "zebra_jax.model.recurrence" in graph["zebra_jax.model.lm"]


def test_no_import_cycles():
  graph = _graph()
  state: dict[str, str] = {}  # module -> "open" while on the stack, "done"

  def visit(module, stack):
    state[module] = "open"
    for dep in sorted(graph[module]):
      if state.get(dep) == "open":
        cycle = stack[stack.index(dep):] + [dep]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if dep not in state:
        visit(dep, stack + [dep])
    state[module] = "done"

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])


def test_imports_run_downward():
  wrong = []
  for module, deps in _graph().items():
    part = _part(module)
    if part == "package":
      continue
    assert part in ALLOWED, f"{module}: add its folder to ALLOWED"
    for dep in deps:
      if _part(dep) not in ALLOWED[part] | {part, "package"}:
        wrong.append(f"{module} imports {dep}")
  assert not wrong, "\n".join(wrong)


def test_no_two_parts_may_import_each_other():
  mutual = sorted((a, b) for a in ALLOWED for b in ALLOWED[a]
                  if a in ALLOWED[b])
  assert not mutual


def test_every_part_of_the_package_has_a_floor():
  parts = {_part(m) for m in _graph()} - {"package"}
  assert parts == set(ALLOWED)


def test_nothing_outside_tools_imports_tools():
  """tools/ holds scripts: what they share lives in a library floor."""
  wrong = [f"{module} imports {dep}" for module, deps in _graph().items()
           for dep in deps
           if _part(dep) == "tools" and _part(module) != "tools"]
  assert not wrong, "\n".join(wrong)


def test_no_tool_imports_another_tool():
  wrong = [f"{module} imports {dep}" for module, deps in _graph().items()
           for dep in deps if _part(module) == _part(dep) == "tools"
           and dep != "zebra_jax.tools"]
  assert not wrong, "\n".join(wrong)


def _documented_floors(path: str, start: str) -> list[str]:
  """The parts named, in order, by the first code block after `start` in a
  doc: the names (`name/` or `name.py`) that begin each line."""
  text = open(os.path.join(ROOT, path), encoding="utf-8").read()
  block = text[text.index(start):].split("```")[1]
  found = []
  for line in block.splitlines():
    names = re.match(r"((?:(?:zebra_jax/)?\w+(?:/|\.py)\s+)*)", line)
    found += re.findall(r"(\w+)(?:/|\.py)\s", names.group(1))
  return found


def _floor_order(parts: list[str]) -> list[int]:
  """The level in FLOORS of each named part, in the order named."""
  level = {p: i for i, floor in enumerate(FLOORS) for p in floor}
  return [level[p] for p in parts if p in level]


def test_the_docs_draw_the_floors_in_this_order():
  top_first = _documented_floors("docs/architecture.md", "## Floors")
  assert set(ALLOWED) <= set(top_first), top_first
  assert _floor_order(top_first) == sorted(_floor_order(top_first),
                                           reverse=True), top_first
  lowest_first = _documented_floors("README.md", "## Architecture")
  assert set(ALLOWED) <= set(lowest_first), lowest_first
  assert _floor_order(lowest_first) == sorted(_floor_order(lowest_first)), (
      lowest_first)


@pytest.mark.parametrize("low", ["model", "data"])
def test_model_and_data_import_nothing_above_them(low):
  above = set(ALLOWED) - {"errors", "model", "data"}
  for module, deps in _graph().items():
    if _part(module) == low:
      assert not {_part(d) for d in deps} & above, (module, deps)


def _test_module_imports(path: str) -> list[str]:
  """The imports in `path` that name a test module (tests.<...>.test_*),
  whether as `import tests.x.test_y`, `from tests.x.test_y import ...`,
  `from tests.x import test_y` or relative."""
  found = []
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names if a.name.startswith("tests.")]
    elif isinstance(node, ast.ImportFrom) and (
        node.level or (node.module or "").split(".")[0] == "tests"):
      base = "." * node.level + (node.module or "")
      names = [f"{base}.{a.name}" for a in node.names]
    else:
      continue
    found += [f"{path}:{node.lineno}: {name}" for name in names
              if any(part.startswith("test_") for part in name.split("."))]
  return found


def test_no_test_module_imports_another():
  """Shared code lives in tests/helpers.py, tests/references.py and
  tests/conftest.py, never in a test module another one imports."""
  tests = os.path.dirname(os.path.abspath(__file__))
  paths = [os.path.join(folder, name) for folder, _, files in os.walk(tests)
           for name in files if name.endswith(".py")]
  assert len([p for p in paths if os.path.basename(p).startswith("test_")]) > 30
  assert [hit for path in sorted(paths)
          for hit in _test_module_imports(path)] == []
