"""The package's import graph: no cycles, and imports only run downward.

Floors, lowest first: errors; model and data (independent of each other);
config (every field's default and rule, config files); runtime; inference; training; the command line and tools on top (they share
the flag parsing, and the command line runs some tools as modes). Imports made
inside functions count as much as those at the top of a module: a lazy import
that dodges a cycle is still a cycle.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "zebra_jax")

# What each part may import from the package (besides itself).
ALLOWED = {
    "errors": set(),
    "model": {"errors"},
    "data": {"errors"},
    "config": {"errors", "model", "data"},
    "runtime": {"errors", "model", "data", "config"},
    "inference": {"errors", "model", "data", "config", "runtime"},
    "training": {"errors", "model", "data", "config", "runtime", "inference"},
    "cli": {"errors", "model", "data", "config", "runtime", "inference",
            "training", "tools"},
    "tools": {"errors", "model", "data", "config", "runtime", "inference",
              "training", "cli"},  # the shared flag parsing; cli runs bench and plot
}


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
  """The floor a module lives on: its subpackage, or cli for the entry point."""
  parts = module.split(".")
  if len(parts) == 1:
    return "package"
  if parts[1] in ("main", "cli"):
    return "cli"
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


@pytest.mark.parametrize("low", ["model", "data"])
def test_model_and_data_import_nothing_above_them(low):
  above = {"training", "inference", "cli", "tools", "runtime", "config"}
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
