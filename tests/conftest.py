"""Shared pytest setup.

XLA reads XLA_FLAGS once, when jax first initialises its backends, so the flag
must be set here, before any test module imports jax: every test then sees 8
fake CPU devices and the sharding tests can build a real multi-device mesh.

Tests run on the CPU even where a GPU is installed: the bitwise-resume and
8-device tests hold only there. `ZEBRA_JAX_TEST_GPU=1 pytest -m gpu` runs the
GPU smoke tests on the GPU instead.

Every test, and every process a test starts, shares one compilation cache
for the session: the suite compiles the same tiny programs dozens of times,
and reading them back halves its time. Cached programs are the programs
XLA compiled, so no result depends on it.

Tests also ask XLA for its cheapest code generation
(JAX_DISABLE_MOST_OPTIMIZATIONS: LLVM's optimisation level 0). The suite's
tiny programs spend far longer compiling than running. What is cut is LLVM's
work on the machine code, not XLA's graph passes; set the variable to 0 to
test with full optimisation.
"""

import atexit
import os
import shutil
import tempfile

if os.environ.get("ZEBRA_JAX_TEST_GPU") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("XLA_FLAGS",
                        "--xla_force_host_platform_device_count=8")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="zebra_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# Imported only now: jax reads the flags above when it starts.
import pytest  # pylint: disable=g-import-not-at-top,g-bad-import-order

from zebra_jax.configs import demo  # pylint: disable=g-import-not-at-top
from zebra_jax.training import loop  # pylint: disable=g-import-not-at-top


@pytest.fixture(scope="session")
def char_run(tmp_path_factory):
  """(cfg, workdir): demo.py:tiny trained for its 20 steps on a small text
  file, once per session, for the tests that need a char-level workdir.
  Tests only read it: one that varies cfg varies a copy."""
  base = tmp_path_factory.mktemp("char_tiny_20_steps")
  cfg = demo.get_config("tiny")
  cfg.data.source, cfg.data.path = "text", str(base / "story.txt")
  cfg.train.eval_every = 1000  # no mid-run eval: the fixture stays fast
  (base / "story.txt").write_text("".join(
      f"line {i}: the quick brown fox jumps over the lazy dog.\n"
      for i in range(300)))
  workdir = str(base / "run")
  loop.run(cfg, workdir)
  return cfg, workdir


_SKIPPED_LIST = os.environ.get("ZEBRA_JAX_SKIPPED_LIST")


def pytest_runtest_logreport(report):
  """With ZEBRA_JAX_SKIPPED_LIST=FILE, appends each skipped test's node id:
  CI reruns exactly those after installing the optional packages."""
  if _SKIPPED_LIST and report.skipped and report.when in ("setup", "call"):
    with open(_SKIPPED_LIST, "a", encoding="utf-8") as f:
      f.write(report.nodeid + "\n")
