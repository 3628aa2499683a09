"""The package's import graph: no cycles, and imports only run downward;
and importing it changes nothing in the process but what a module declares.

Floors, lowest first (as docs/architecture.md and the README draw them):
errors and the serving engine (engine/, a library that imports
nothing from the package, so that an export copies it whole and config can
read its sampling bounds); model and data (side by side, neither imports the
other); config;
configs (the shipped configs, data built on config/base.py); runtime;
inference (loading, sampling, scoring, export, Triton); serving (the HTTP
service); training; api (the Python API, zebra_jax.load); cli (flag parsing
and mode dispatch, shared by main and the lab's scripts); main. A module imports only from its own part and
the floors below it: no two parts may import each other. Imports made inside
functions count as much as those at the top of a module: a lazy import that
dodges a cycle is still a cycle.

The lab (lab/, beside the package) stands on top: it imports the package,
the package never imports it. Inside it the scripts (lab/NAME.py, run as
python -m lab.NAME) stand on lab/benchmarks/, and no script imports another.
"""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "zebra_jax")
LAB = os.path.join(ROOT, "lab")

# Lowest first; the parts of one floor do not import each other.
FLOORS = (("errors", "strict_json", "progress", "engine"), ("model", "data"),
          ("config",), ("configs",), ("runtime",), ("inference",),
          ("serving",), ("training",), ("api",), ("cli",), ("main",))
# What each part may import from the package (besides itself): the floors
# below its own.
ALLOWED = {part: {low for below in FLOORS[:level] for low in below}
           for level, floor in enumerate(FLOORS) for part in floor}


def _modules(package: str = PACKAGE) -> dict[str, str]:
  """Dotted module name -> file path, for every module of a package."""
  found = {}
  for folder, _, files in os.walk(package):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      rel = os.path.relpath(path, os.path.dirname(package))[:-3]
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


def _graph(package: str = PACKAGE) -> dict[str, set[str]]:
  modules = _modules(package)
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
  assert "zebra_jax.model.recurrence.scan" in graph["zebra_jax.model.layer"]


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


def test_the_serving_engine_imports_nothing_from_the_package():
  """engine/ travels alone (the Triton model's copy): not even a
  relative import may leave its folder."""
  engine = os.path.join(PACKAGE, "engine")
  files = [f for f in os.listdir(engine) if f.endswith(".py")]
  assert "scheduler.py" in files
  for name in files:
    path = os.path.join(engine, name)
    assert "zebra_jax" not in _top_level_imports(path), name
    tree = ast.parse(open(path, encoding="utf-8").read())
    assert not [n for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.level > 1], name


def test_no_two_parts_may_import_each_other():
  mutual = sorted((a, b) for a in ALLOWED for b in ALLOWED[a]
                  if a in ALLOWED[b])
  assert not mutual


def test_every_part_of_the_package_has_a_floor():
  parts = {_part(m) for m in _graph()} - {"package"}
  assert parts == set(ALLOWED)


def _top_level_imports(path: str) -> set[str]:
  """The first name of every module `path` imports, wherever in the file."""
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
    if isinstance(node, ast.Import):
      found.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      found.add(node.module.split(".")[0])
  return found


def test_the_package_never_imports_the_lab():
  """The wheel ships zebra_jax/ alone: an import of lab/ would fail there."""
  wrong = [name for name, path in _modules().items()
           if "lab" in _top_level_imports(path)]
  assert not wrong, wrong


def _lab_script(module: str) -> bool:
  """lab.NAME (a script) rather than lab, lab.benchmarks or below."""
  return module.count(".") == 1 and module != "lab.benchmarks"


def test_the_lab_stands_on_the_package():
  graph = _graph(LAB)
  assert "lab.bench" in graph and "lab.benchmarks.speed" in graph["lab.bench"]
  assert "zebra_jax" in _top_level_imports(_modules(LAB)["lab.bench"])
  scripts_imported = [f"{module} imports {dep}"
                      for module, deps in graph.items() for dep in deps
                      if _lab_script(dep)]
  assert not scripts_imported, "\n".join(scripts_imported)


def _documented_floors(path: str, start: str) -> list[str]:
  """The parts named, in order, by the first code block after `start` in a
  doc: the names (`name/` or `name.py`) that begin each line."""
  text = open(os.path.join(ROOT, path), encoding="utf-8").read()
  block = text[text.index(start):].split("```")[1]
  found = []
  for line in block.splitlines():
    names = re.match(r"((?:(?:zebra_jax/)?(?:\w+/)*\w+(?:/|\.py)\s+)*)",
                     line)
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
  # The lab, beside the package, is drawn above its top floor.
  assert top_first.index("lab") < top_first.index("main"), top_first
  assert lowest_first.index("lab") > lowest_first.index("main"), lowest_first


@pytest.mark.parametrize("low", ["model", "data"])
def test_model_and_data_import_nothing_above_them(low):
  above = set(ALLOWED) - set(FLOORS[0]) - {"model", "data"}
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


def test_only_the_lab_tests_import_the_lab():
  """The product's tests hold it against references of their own
  (tests/references.py, tests/hlo_collectives.py): a test that imported the
  lab would check the product against the code that measures it."""
  tests = os.path.dirname(os.path.abspath(__file__))
  lab_tests = os.path.join(tests, "lab")
  paths = [os.path.join(folder, name) for folder, _, files in os.walk(tests)
           if not (folder + os.sep).startswith(lab_tests + os.sep)
           for name in files if name.endswith(".py")]
  assert os.path.join(tests, "engine", "test_engine.py") in paths
  wrong = [os.path.relpath(p, ROOT) for p in sorted(paths)
           if "lab" in _top_level_imports(p)]
  assert not wrong, wrong


# What importing a module may change in the process, by module: each kind
# it changes, and why. Any other change at import is a failure, and so is a
# declaration that no longer holds.
DECLARED_EFFECTS = {
    "zebra_jax.main": {
        "flags": "the zebra-jax command's absl flags (--config, --mode...)"},
    "zebra_jax.runtime.distributed": {
        "flags": "the multi-process flags main and the lab share"},
    "zebra_jax.runtime.checkpoint": {
        "logging": "a filter on absl's logger that drops orbax's per-file "
                   "lines and the errors of its own background threads"},
}


def _module_local_call(node: ast.stmt, defined: set[str]) -> bool:
  """`name.method(...)` on a name the module itself defined (e.g. a
  custom_vjp's defvjp): it changes only the module."""
  if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
    return False
  func = node.value.func
  while isinstance(func, ast.Attribute):
    func = func.value
  return isinstance(func, ast.Name) and func.id in defined


def _import_guard(node: ast.stmt) -> bool:
  """try: import x / except ImportError: x = None."""
  return (isinstance(node, ast.Try) and
          all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)
          and all(isinstance(h.type, ast.Name) and h.type.id in (
              "ImportError", "ModuleNotFoundError") for h in node.handlers))


def _statements_that_act(path: str) -> list[str]:
  """A module's top-level statements other than a docstring, imports,
  definitions, assignments, import guards, calls on what it defined, and
  `if __name__ == "__main__":`."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  defined = {n.name for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
  defined |= {t.id for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
  acting = []
  for i, node in enumerate(tree.body):
    if (isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                          ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                          ast.AnnAssign))
        or (i == 0 and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant))
        or (isinstance(node, ast.If)
            and ast.unparse(node.test) == "__name__ == '__main__'")
        or _import_guard(node) or _module_local_call(node, defined)):
      continue
    acting.append(f"{path}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
  return acting


def test_module_top_levels_only_define():
  """A statement that acts at import (a call, an if, a loop) needs its
  module in DECLARED_EFFECTS."""
  found = [hit for name, path in sorted(_modules().items())
           if name not in DECLARED_EFFECTS
           for hit in _statements_that_act(path)]
  assert not found, "\n".join(found)


def _dependency_order(graph: dict[str, set[str]]) -> list[str]:
  """Every module after the modules it imports: importing them in this
  order charges each change to the module that made it."""
  order, seen = [], set()

  def visit(module):
    seen.add(module)
    for dep in sorted(graph[module]):
      if dep not in seen:
        visit(dep)
    order.append(module)
  for module in sorted(graph):
    if module not in seen:
      visit(module)
  return order


def _third_party_imports() -> list[str]:
  """The modules outside the package that its modules import at top level
  (for `from a import b`, a and, where it is a module, a.b)."""
  found = set()
  for path in _modules().values():
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
      if isinstance(node, ast.Import):
        found.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        found.add(node.module)
        found.update(f"{node.module}.{a.name}" for a in node.names)
  return sorted(n for n in found if n.split(".")[0] != "zebra_jax")


# Run in a fresh process: imports what the package imports, then each module
# of the package in dependency order, and reports what each import changed.
_IMPORT_EVERY_MODULE = """
import importlib, importlib.util, json, logging, os, signal, sys, threading
import warnings
third_party, modules = json.loads(sys.argv[1])
for name in third_party:
  try:
    importlib.import_module(name)
  except ImportError:
    pass  # an optional dependency: the modules that need it are skipped
import jax
from absl import flags
# host_memory read by path, not imported: importing it would import the
# package (its __init__) before the first look.
spec = importlib.util.spec_from_file_location("_malloc_probe", sys.argv[2])
host_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_memory)
try:
  from jax._src.xla_bridge import backends_are_initialized
except ImportError:
  backends_are_initialized = lambda: None

def loggers():
  found = {"": logging.getLogger()}
  found.update((n, l) for n, l in logging.Logger.manager.loggerDict.items()
               if isinstance(l, logging.Logger))
  return {n: (l.level, l.propagate, l.disabled,
              [id(h) for h in l.handlers], [id(f) for f in l.filters])
          for n, l in found.items()}

def state():
  return {
      "environ": dict(os.environ), "cwd": os.getcwd(),
      "sys.path": list(sys.path), "flags": sorted(flags.FLAGS),
      "logging": loggers(), "warnings": [repr(f) for f in warnings.filters],
      "signals": {int(s): repr(signal.getsignal(s))
                  for s in signal.valid_signals()
                  if s not in (signal.SIGKILL, signal.SIGSTOP)},
      "threads": threading.active_count(),
      "jax.config": {k: repr(v) for k, v in jax.config.values.items()},
      "jax backend": backends_are_initialized(),
      "malloc": host_memory.settings_in_effect(),
      "stdio": [id(sys.stdout), id(sys.stderr), id(sys.stdin)]}

def changed(before, after):
  if before["logging"] != after["logging"]:  # a new plain logger is no change
    plain = (logging.NOTSET, True, False, [], [])
    after = {**after, "logging": {n: v for n, v in after["logging"].items()
             if n in before["logging"] or tuple(v) != plain}}
  return sorted(k for k in before if before[k] != after[k])

effects, skipped = {}, []
for name in modules:
  before = state()
  try:
    importlib.import_module(name)
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] == "zebra_jax":
      raise
    skipped.append(f"{name} (no {e.name})")
    continue
  kinds = changed(before, state())
  if kinds:
    effects[name] = kinds
print(json.dumps({"effects": effects, "skipped": skipped}))
"""


def test_importing_the_package_changes_only_what_it_declares(tmp_path):
  """Each module imported in turn, in a fresh process: the environment,
  working directory, sys.path, absl flags, logging, warning filters, signal
  handlers, threads, jax's config and backend, malloc and stdio are as they
  were, but for DECLARED_EFFECTS."""
  modules = _dependency_order(_graph())
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "ZEBRA_JAX_SYSTEM_MALLOC")}
  out = subprocess.run(
      [sys.executable, "-c", _IMPORT_EVERY_MODULE,
       json.dumps([_third_party_imports(), modules]),
       os.path.join(PACKAGE, "runtime", "host_memory.py")],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  imported = [m for m in modules
              if not any(s.startswith(f"{m} ") for s in report["skipped"])]
  assert "zebra_jax.main" in imported and len(imported) > 50, report
  observed = {m: set(kinds) for m, kinds in report["effects"].items()}
  undeclared = {m: kinds - set(DECLARED_EFFECTS.get(m, ()))
                for m, kinds in observed.items()}
  assert not {m: k for m, k in undeclared.items() if k}, report
  stale = {m: set(kinds) - observed.get(m, set())
           for m, kinds in DECLARED_EFFECTS.items() if m in imported}
  assert not {m: k for m, k in stale.items() if k}, stale
