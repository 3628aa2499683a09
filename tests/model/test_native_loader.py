"""The native library at the edges a cluster brings: a cached library cut
short, a prebuilt one for another CPU, damaged or not a zebra_jax library
at all, a relative ZEBRA_JAX_NATIVE_LIB, a compiler killed half way. Each
may slow a run down (the scan runs, with one line saying why), never crash
it; and a run that uses the library says which build it is.

Compiles are what these tests would spend their time on, so all but one
use a stand-in compiler that copies one real build (this CPU's, cached as
test_native.py's is); the crash that a damaged library would cause runs in
a child process with a timeout.
"""

import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model.recurrence import native as native_recurrence
from zebra_jax.model.recurrence import native_build
from zebra_jax.model.recurrence import native_check
from zebra_jax.model.recurrence import scan as recurrence
from tests.helpers import (NATIVE_SHAPES as SHAPES, fallback_lines,
                           needs_compiler, runs_the_scan)

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def good_library() -> pathlib.Path:
  """This CPU's build, from the user's cache (built there once)."""
  path = native_build.build(native_build.compiler(), "native")
  assert not native_check.damage(path.read_bytes(),
                                 native_check.read_record(path))
  return path


def _stand_in_compiler(folder: pathlib.Path, good: pathlib.Path,
                       how: str = "copy") -> tuple[str, pathlib.Path]:
  """$CXX that answers --version and, per compile, logs a line and then:
  copy: writes `good` to its -o path; killed: prints what g++ prints when
  the OOM killer ends cc1plus and exits 1; sigkill: dies of SIGKILL."""
  log, script = folder / "compiles.log", folder / f"cxx-{how}.sh"
  act = {
      "copy": f'cp "{good}" "$out"',
      "killed": ('echo "g++: fatal error: Killed signal terminated program '
                 'cc1plus" >&2; exit 1'),
      "sigkill": "kill -9 $$",
  }[how]
  script.write_text(
      "#!/bin/sh\n"
      'if [ "$1" = --version ]; then echo "stand-in 1.0"; exit 0; fi\n'
      f'echo compile >> "{log}"\n'
      'out=""; prev=""\n'
      'for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done\n'
      f"{act}\n")
  script.chmod(0o755)
  return str(script), log


def _compiles(log: pathlib.Path) -> int:
  return len(log.read_text().splitlines()) if log.exists() else 0


def _whole(path: pathlib.Path) -> bool:
  return not native_check.damage(path.read_bytes(),
                                 native_check.read_record(path))


@pytest.mark.parametrize("size", [0, 64, 4096, 60_000])
def test_a_truncated_cached_library_is_compiled_again(clean_env, good_library,
                                                      size, caplog):
  """A build or copy cut short at any length: the next build finds the
  library unlike its record and compiles it again (a library of 4,096 or
  60,000 bytes had died of SIGBUS when loaded; 0 or 64 bytes made every
  later run use the scan)."""
  cxx, log = _stand_in_compiler(clean_env, good_library)
  path = native_build.build(cxx, "native")
  assert _compiles(log) == 1 and _whole(path)
  with open(path, "r+b") as f:
    f.truncate(size)
  with caplog.at_level(logging.WARNING):
    assert native_build.build(cxx, "native") == path
  assert _compiles(log) == 2 and _whole(path)
  assert any("damaged" in r.getMessage() for r in caplog.records)


def test_an_edit_to_any_source_file_is_another_build(clean_env, good_library,
                                                    monkeypatch):
  """The sources are native.cc and the headers it includes: an edit to a
  header alone changes the digest and the cache key, so the next build
  compiles again rather than load a library of the old code."""
  sources = clean_env / "native_cc"
  shutil.copytree(native_build.SOURCE.parent, sources)
  monkeypatch.setattr(native_build, "SOURCE", sources / "native.cc")
  cxx, log = _stand_in_compiler(clean_env, good_library)
  digest, first = native_build.source_digest(), native_build.build(cxx, "native")
  assert native_build.build(cxx, "native") == first and _compiles(log) == 1
  header = sources / "simd.h"
  header.write_text(header.read_text() + "// an edit\n")
  assert native_build.source_digest() != digest
  assert native_build.build(cxx, "native") != first and _compiles(log) == 2


def test_a_library_without_its_build_record_is_compiled_again(
    clean_env, good_library):
  """A cached library whose record is missing (a build killed between the
  two renames, or a copied cache) is not trusted either."""
  cxx, log = _stand_in_compiler(clean_env, good_library)
  path = native_build.build(cxx, "native")
  native_check.record_path(path).unlink()
  native_build.build(cxx, "native")
  assert _compiles(log) == 2 and _whole(path)


def test_a_truncated_cached_library_does_not_crash_a_run(clean_env,
                                                         good_library):
  """The whole path in a fresh process: the cached library cut to 4,096
  bytes is compiled again and the native loops run (the process had died
  of SIGBUS, exit 135); the run says it compiled and which build runs."""
  cxx, log = _stand_in_compiler(clean_env, good_library)
  env = {**os.environ, "CXX": cxx, "XDG_CACHE_HOME": str(clean_env / "cache")}
  env.pop(native_build.LIB_ENV, None)
  env.pop(native_build.MARCH_ENV, None)
  path = native_build.build(cxx, "native")
  with open(path, "r+b") as f:
    f.truncate(4096)
  code = (
      "import jax.numpy as jnp\n"
      "from zebra_jax.model.recurrence import native as n\n"
      f"args = [jnp.ones(s, jnp.float32) * 0.1 for s in {SHAPES}]\n"
      "assert n.unavailable(jnp.float32) == '', n.unavailable(jnp.float32)\n"
      "n.zebra_layer(*args, 1, False)[0].block_until_ready()\n")
  result = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
  assert _compiles(log) == 2
  assert "compiling native.cc for -march=native (once" in result.stderr
  lines = [l for l in result.stderr.splitlines()
           if "model.recurrence=native" in l]
  assert len(lines) == 1 and "C++ time loops" in lines[0], result.stderr
  assert "compiled now" in lines[0] and str(path) in lines[0]


def test_a_run_says_it_compiles_and_which_loops_run(clean_env, good_library,
                                                    monkeypatch, caplog):
  """Both lines at WARNING, the level the command line shows: the first
  run's compile (about 10 s of silence otherwise) and the build that
  runs."""
  cxx, _ = _stand_in_compiler(clean_env, good_library)
  monkeypatch.setenv("CXX", cxx)
  with caplog.at_level(logging.WARNING):
    assert native_recurrence.unavailable(jnp.float32) == ""
  lines = [r.getMessage() for r in caplog.records
           if r.levelno >= logging.WARNING]
  assert any(l.startswith("compiling native.cc for -march=native (once")
             for l in lines), lines
  isa = native_check.build_info(good_library.read_bytes())[1]
  assert any(l.startswith("model.recurrence=native: the C++ time loops, "
                          f"{isa} build (compiled now: ") for l in lines), lines


@pytest.mark.parametrize("how", ["killed", "sigkill"])
def test_a_killed_compiler_is_not_remembered(clean_env, good_library, how):
  """The OOM killer ends cc1plus (g++ then exits 1 and says so) or the
  driver itself: the build fails, and the next one tries again (a
  remembered failure had sent every later run to the scan)."""
  cxx, log = _stand_in_compiler(clean_env, good_library, how)
  for _ in range(2):
    with pytest.raises(native_build.BuildError, match="failed"):
      native_build.build(cxx, "native")
  assert _compiles(log) == 2
  assert not list((clean_env / "cache").rglob("*.failed"))


def test_killed_is_told_from_refused():
  killed = native_build.killed
  assert killed(-signal.SIGKILL, "")
  assert killed(137, "")
  assert killed(1, "g++: fatal error: Killed signal terminated program cc1plus")
  assert killed(4, "internal compiler error: Killed (program cc1plus)")
  assert killed(1, "clang++: error: unable to execute command: Killed")
  assert not killed(1, "native.cc:9:1: error: 'x' was not declared")


def _prebuilt(folder: pathlib.Path, good: pathlib.Path, name="lib.so"
              ) -> pathlib.Path:
  """A copy of the library and its record, as --build --out writes them."""
  (folder / "lib").mkdir(exist_ok=True)
  copy = folder / "lib" / name
  shutil.copyfile(good, copy)
  if native_check.record_path(good).exists():
    shutil.copyfile(native_check.record_path(good),
                    native_check.record_path(copy))
  return copy


def test_a_prebuilt_library_for_a_cpu_with_more_features_is_refused(
    clean_env, good_library, monkeypatch, caplog):
  """ZEBRA_JAX_NATIVE_LIB built for features this CPU lacks (by its own
  flags, not its name): one line naming them and the fix, then the scan
  (loading it had died of SIGILL, exit 132)."""
  monkeypatch.setenv(native_build.LIB_ENV,
                     str(_prebuilt(clean_env, good_library)))
  monkeypatch.setattr(native_check, "cpu_flags",
                      lambda: frozenset({"fpu", "sse", "fp"}))
  line = runs_the_scan(caplog)
  needs = native_check.build_info(good_library.read_bytes())[2]
  assert "built for CPU features this CPU lacks" in line
  assert all(f in line for f in needs), line
  assert "--march=" in line  # the fix


def test_a_prebuilt_library_from_another_source_is_refused(
    clean_env, good_library, monkeypatch, caplog):
  monkeypatch.setenv(native_build.LIB_ENV,
                     str(_prebuilt(clean_env, good_library)))
  monkeypatch.setattr(native_build, "source_digest", lambda: "0" * 16)
  assert "another version of native.cc" in runs_the_scan(caplog)


@pytest.mark.parametrize("size,record", [(4096, True), (4096, False),
                                         (0, False)])
def test_a_damaged_prebuilt_library_is_refused(clean_env, good_library,
                                               monkeypatch, caplog, size,
                                               record):
  """Cut short, with its record beside it or without (then its own ELF
  headers show it): one line, then the scan."""
  copy = _prebuilt(clean_env, good_library)
  if not record:
    native_check.record_path(copy).unlink()
  with open(copy, "r+b") as f:
    f.truncate(size)
  monkeypatch.setenv(native_build.LIB_ENV, str(copy))
  line = runs_the_scan(caplog)
  assert f"{native_build.LIB_ENV}={copy} is damaged" in line
  assert "copy it again" in line


def test_a_library_without_the_entry_points_is_refused(clean_env,
                                                       monkeypatch, caplog):
  """Any other shared library: one line, then the scan (it had raised an
  uncaught AttributeError)."""
  source, lib = clean_env / "other.cc", clean_env / "other.so"
  source.write_text('extern "C" int zebra_unrelated() { return 1; }\n')
  subprocess.run([*native_build.compiler().split(), "-shared", "-fPIC",
                  str(source), "-o", str(lib)], check=True, timeout=120)
  monkeypatch.setenv(native_build.LIB_ENV, str(lib))
  assert "not a zebra_jax native library" in runs_the_scan(caplog)


def test_a_relative_prebuilt_path_loads(clean_env, good_library, monkeypatch,
                                        caplog):
  """ZEBRA_JAX_NATIVE_LIB=lib.so in the working directory (dlopen alone
  would search the system's library paths for it)."""
  _prebuilt(clean_env, good_library, "zebra_relative.so")
  monkeypatch.chdir(clean_env / "lib")
  monkeypatch.setenv(native_build.LIB_ENV, "zebra_relative.so")
  with caplog.at_level(logging.WARNING):
    assert native_recurrence.unavailable(jnp.float32) == ""
    args = [jnp.full(s, 0.1, jnp.float32) for s in SHAPES]
    got = native_recurrence.zebra_layer(*args, 1, False)
  assert not fallback_lines(caplog)
  for g, w in zip(got, recurrence.zebra_layer(*args, 1, False)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)


def test_the_build_record_lists_what_the_compiler_may_use(good_library):
  """This CPU's build needs only flags this CPU has, and says its ISA."""
  source, isa, needs = native_check.build_info(good_library.read_bytes())
  assert source == native_build.source_digest()
  assert isa in ("avx512f", "avx2", "avx", "sse2", "neon", "generic")
  flags = native_check.cpu_flags()
  assert needs and needs <= flags, needs - flags
  assert not native_check.unfit(good_library.read_bytes(), source, flags)


def test_damage_is_read_from_the_elf_headers(good_library):
  data = good_library.read_bytes()
  assert native_check.damage(data, None) == ""
  for size in (0, 64, 4096, len(data) // 2, len(data) - 1):
    assert native_check.damage(data[:size], None), size
  assert "no ELF header" in native_check.damage(b"not a library" * 10, None)
