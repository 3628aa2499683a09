"""Building and loading the native time loops, and what happens when it
cannot be done: no compiler, a failed build, no home directory, a cache
that cannot be written, a library built elsewhere; the kernels' own checks
of the buffers XLA hands them.

These run on every machine: the no-compiler tests simulate a machine
without one (CXX pointing nowhere, or a PATH without c++ and g++), and the
build tests skip only where there is no compiler at all.
"""

import fnmatch
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.model.recurrence import native as native_recurrence
from zebra_jax.model.recurrence import native_build
from zebra_jax.model.recurrence import native_check
from zebra_jax.model.recurrence import scan as recurrence
from tests.helpers import (NATIVE_SHAPES, fallback_lines, native_layer_args,
                           needs_compiler, runs_the_scan)


def test_no_compiler_runs_the_scan_and_says_why(tmp_path):
  """A machine whose $CXX does not exist (and nothing cached): in a fresh
  process, one warning line on stderr, and the scan's results."""
  code = (
      "import jax.numpy as jnp, numpy as np\n"
      "from zebra_jax.model.recurrence import native as n, scan\n"
      f"args = [jnp.ones(s, jnp.float32) * 0.1 for s in {NATIVE_SHAPES}]\n"
      "got = n.zebra_layer(*args, 1, False)\n"
      "want = scan.zebra_layer(*args, 1, False)\n"
      "assert all(np.array_equal(g, w) for g, w in zip(got, want))\n")
  env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
         "XDG_CACHE_HOME": str(tmp_path)}
  env.pop(native_build.LIB_ENV, None)
  result = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  lines = [l for l in result.stderr.splitlines() if "running the scan" in l]
  assert len(lines) == 1, result.stderr
  assert "no usable C++ compiler" in lines[0], lines
  assert "no-such-compiler" in lines[0], lines


def test_no_compiler_on_the_path_says_how_to_get_one(clean_env, monkeypatch,
                                                     caplog):
  monkeypatch.delenv("CXX", raising=False)
  monkeypatch.setenv("PATH", str(clean_env))  # no c++, no g++
  line = runs_the_scan(caplog)
  assert "no C++ compiler found" in line
  assert native_build.LIB_ENV in line  # ... or a prebuilt library


def _logging_compiler(folder: pathlib.Path) -> tuple[str, pathlib.Path]:
  """$CXX for a compiler that records each command, then runs the real
  one."""
  log, script = folder / "commands.log", folder / "cxx.sh"
  real = shutil.which(native_build.compiler().split()[0])
  script.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{real}" "$@"\n')
  script.chmod(0o755)
  return str(script), log


def _compiles(log: pathlib.Path) -> int:
  lines = log.read_text().splitlines() if log.exists() else []
  return sum("--version" not in l for l in lines)


@needs_compiler
def test_failed_build_shows_the_first_error_and_is_remembered(
    clean_env, monkeypatch, caplog):
  """A target the compiler rejects: the warning shows the compiler's first
  `error:` line (not the source excerpt after it), the scan runs, and the
  next build of the same source, compiler and flags (another process)
  fails at once instead of compiling again."""
  cxx, log = _logging_compiler(clean_env)
  monkeypatch.setenv("CXX", cxx)
  monkeypatch.setenv(native_build.MARCH_ENV, "no-such-cpu")
  line = runs_the_scan(caplog)
  assert "compiling native.cc for -march=no-such-cpu failed:" in line
  assert "error:" in line and "no-such-cpu" in line.split("failed:")[1]
  assert _compiles(log) == 1
  with pytest.raises(native_build.BuildError, match="an earlier build"):
    native_build.build(cxx, "no-such-cpu")
  assert _compiles(log) == 1
  # Another target is another build.
  with pytest.raises(native_build.BuildError, match="error:"):
    native_build.build(cxx, "no-such-cpu-either")
  assert _compiles(log) == 2


def test_first_error_line():
  output = ("recurrence.cc: In function 'void f()':\n"
            "recurrence.cc:90:7: error: impossible constraint in 'asm'\n"
            "   90 |       asm(\"\" : \"+v\"(wk));\n"
            "      |       ^~~\n"
            "recurrence.cc:99:1: error: a later error\n")
  assert native_build.first_error(output) == (
      "recurrence.cc:90:7: error: impossible constraint in 'asm'")
  assert native_build.first_error("ld: cannot find -lx\n\n") == (
      "ld: cannot find -lx")


def test_no_home_directory_caches_in_a_private_temporary_folder(
    monkeypatch, tmp_path):
  """HOME unset and a uid without a passwd entry, where Path.home()
  raises: the cache is a folder of the temporary directory that only this
  user can write."""
  monkeypatch.delenv("HOME", raising=False)
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

  def no_home():
    raise RuntimeError("Could not determine home directory.")
  monkeypatch.setattr(pathlib.Path, "home", staticmethod(no_home))
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
  folder = native_build.cache_dir()
  assert folder == tmp_path / f"zebra_jax-{os.getuid()}" / "kernels"
  assert folder.is_dir()
  assert (folder.parent.stat().st_mode & 0o077) == 0


def test_unwritable_cache_falls_back_to_a_temporary_folder(monkeypatch,
                                                           tmp_path):
  blocker = tmp_path / "a-file"  # no folder can be made below a file
  blocker.write_text("")
  monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  folder = native_build.cache_dir()
  assert folder == tmp_path / "tmp" / f"zebra_jax-{os.getuid()}" / "kernels"


def test_a_shared_temporary_folder_is_not_trusted(monkeypatch, tmp_path):
  """The fallback folder exists but others may write it (created by
  someone else): no cache rather than another user's library."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file" / "x"))
  (tmp_path / "a-file").write_text("")
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
  shared = tmp_path / f"zebra_jax-{os.getuid()}"
  shared.mkdir()
  shared.chmod(0o777)
  with pytest.raises(OSError, match="no writable cache"):
    native_build.cache_dir()


@needs_compiler
@pytest.mark.slow
def test_build_without_a_home_then_load(clean_env, monkeypatch):
  """The whole build with no home: compiled into the temporary folder."""
  monkeypatch.delenv("HOME", raising=False)
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  monkeypatch.setattr(pathlib.Path, "home", staticmethod(
      lambda: (_ for _ in ()).throw(RuntimeError("no home"))))
  monkeypatch.setattr("tempfile.tempdir", str(clean_env))
  path = native_build.build(native_build.compiler(), "x86-64-v3"
                                 if _x86() else "native")
  assert path.parent == clean_env / f"zebra_jax-{os.getuid()}" / "kernels"
  assert path.stat().st_size > 0


def _x86() -> bool:
  return os.uname().machine in ("x86_64", "AMD64")


@needs_compiler
@pytest.mark.slow
def test_prebuilt_library_on_a_node_without_a_compiler(clean_env, monkeypatch,
                                                       capsys, caplog):
  """Built ahead of time with the command (for an AVX2 target on x86-64),
  then loaded through ZEBRA_JAX_NATIVE_LIB where $CXX does not exist: the
  native results, no warning."""
  out = clean_env / "lib" / "zebra_native.so"
  target = "x86-64-v3" if _x86() else "native"
  assert native_build.main(
      ["--build", f"--march={target}", f"--out={out}"]) == 0
  printed = capsys.readouterr()
  assert printed.out.strip() == str(out)
  assert f"{native_build.LIB_ENV}={out}" in printed.err
  monkeypatch.setenv("CXX", str(clean_env / "no-such-compiler"))
  monkeypatch.setenv(native_build.LIB_ENV, str(out))
  assert native_recurrence.unavailable(jnp.float32) == ""
  if _x86():
    assert native_recurrence.vector_isa() == "avx2"
  args = native_layer_args()
  with caplog.at_level(logging.WARNING):
    got = jax.jit(lambda *a: native_recurrence.zebra_layer(*a, 1, False))(
        *args)
  assert not fallback_lines(caplog)
  want = recurrence.zebra_layer(*args, 1, False)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                               atol=1e-6)


def test_a_missing_prebuilt_libraryruns_the_scan(clean_env, monkeypatch,
                                                  caplog):
  monkeypatch.setenv(native_build.LIB_ENV, str(clean_env / "none.so"))
  line = runs_the_scan(caplog)
  assert f"loading {clean_env / 'none.so'} failed" in line


@pytest.mark.parametrize("march,message", [
    ("x86 64; rm", "is not a -march value"),
    ("no-such-cpu", "failed: .*error:"),
])
def test_build_command_errors_are_one_line(clean_env, capsys, march,
                                           message):
  if native_build.compiler() is None and march == "no-such-cpu":
    pytest.skip("no C++ compiler on this machine")
  assert native_build.main(["--build", f"--march={march}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: "), err
  assert re.search(message, err), err


def test_the_wheel_ships_every_source_file():
  """pyproject's package data names every file of the one compile (a
  header left out builds in a checkout and fails in an installed wheel)."""
  project = pathlib.Path(__file__).parents[2] / "pyproject.toml"
  data = tomllib.loads(project.read_text())["tool"]["setuptools"][
      "package-data"]["zebra_jax.model.recurrence"]
  package = pathlib.Path(native_recurrence.__file__).parent
  files = [p.relative_to(package).as_posix() for p in native_build.sources()]
  assert "native_cc/native.cc" in files and len(files) > 1, files
  assert [f for f in files
          if not any(fnmatch.fnmatch(f, pattern) for pattern in data)] == []


# (compiler, -march, the ISA the build must report, a CPU feature it needs)
OTHER_CPUS = [("aarch64-linux-gnu-g++", "armv8-a", "neon", "asimd"),
              ("c++", "sandybridge", "avx", "avx")]  # AVX, no AVX2: not sse2


@pytest.mark.parametrize("compiler,march,isa,needs", OTHER_CPUS)
@pytest.mark.slow
def test_compiles_for_other_cpus(tmp_path, compiler, march, isa, needs):
  """The source compiles for a CPU this machine is not, and its build
  record says what that CPU must have: aarch64 (NEON only) with a cross
  compiler where one is installed (Debian: g++-aarch64-linux-gnu, which
  .ci/run installs), and an x86-64 with AVX but not AVX2. The other x86-64
  targets are built and run by test_native.py."""
  if shutil.which(compiler) is None:
    pytest.skip(f"{compiler} not installed")
  if march == "sandybridge" and not _x86():
    pytest.skip("an x86-64 target")
  out = tmp_path / "lib.so"
  try:
    native_build.build(compiler, march, out)
  except native_build.BuildError as e:
    pytest.fail(str(e))
  data = out.read_bytes()
  assert native_check.damage(data, native_check.read_record(out)) == ""
  source, built_isa, built_needs = native_check.build_info(data)
  assert source == native_build.source_digest()
  assert built_isa == isa and needs in built_needs, (built_isa, built_needs)


def test_ci_installs_the_cross_compiler():
  """CI runs the aarch64 build above instead of skipping it."""
  ci = (pathlib.Path(__file__).parents[2] / ".ci" / "run").read_text()
  assert "g++-aarch64-linux-gnu" in ci
  assert OTHER_CPUS[0][0] == "aarch64-linux-gnu-g++"


# Direct calls into the kernels with buffers of the wrong size: an error
# from XLA, never a read past a buffer or an abort.
G = 8
F32 = jnp.float32


def _forward_shapes(s=2, t=3, b=4):
  """({argument: shape}, [result shapes]) of a forward call."""
  state, window = (s, b, G), (s, t, b, G)
  return ({"x_proj": (s, t, b, 4 * G), "h0": state, "c0": state,
           "w_h": (s, G, 4 * G)},
          [window, state, state, window, (s, t, b, 4 * G)])


def _backward_shapes(s=2, t=3, b=4):
  state = (s, b, G)
  return ({"d_ys": (s, t, b, G), "gates": (s, t, b, 4 * G),
           "cs": (s, t, b, G), "c0": state, "w_h^T": (s, 4 * G, G),
           "dh": state, "dc": state}, [(s, t, b, 4 * G), state, state])


def _backward_grads_shapes(s=2, t=3, b=4, x_width=6, dense=False):
  """A backward call's shapes with the weight gradients': ys, h0 and the
  inputs x besides, d_w_h, d_w_x and d_bias after."""
  args, results = _backward_shapes(s, t, b)
  x = (t, b, x_width) if dense else (s, t, b, x_width)
  d_w_x = (x_width, s, 4 * G) if dense else (s, x_width, 4 * G)
  return ({**args, "ys": (s, t, b, G), "h0": (s, b, G), "x": x},
          results + [(s, G, 4 * G), d_w_x, (s, 4 * G)])


def _call(name, args, results, fill=0.0):
  """The kernel `name` on arrays of these shapes filled with `fill`."""
  _, suffix = native_recurrence._loaded()  # pylint: disable=protected-access
  call = jax.ffi.ffi_call(name + suffix,
                          [jax.ShapeDtypeStruct(r, F32) for r in results])
  attrs = {"threads": np.int64(2)}
  if name in (FORWARD, BACKWARD, BACKWARD_GRADS):
    attrs.update(unit_parts=np.int64(1), bf16=np.bool_(False))
  return jax.block_until_ready(call(
      *[jnp.full(a, fill, F32) for a in args], **attrs))


FORWARD = native_recurrence._FORWARD  # pylint: disable=protected-access
BACKWARD = native_recurrence._BACKWARD  # pylint: disable=protected-access
BACKWARD_GRADS = native_recurrence._BACKWARD_GRADS  # pylint: disable=protected-access
FORWARD_PROJECTED = native_recurrence._FORWARD_PROJECTED  # pylint: disable=protected-access


def _projected_shapes(s=2, t=3, b=4, x_width=6):
  """({argument: shape}, [result shapes]) of a projected forward call."""
  state, window = (s, b, G), (s, t, b, G)
  return ({"x": (s, t, b, x_width), "w_x": (s, x_width, 4 * G),
           "bias": (s, 4 * G), "h0": state, "c0": state,
           "w_h": (s, G, 4 * G)},
          [window, state, state, window, (s, t, b, 4 * G)])


def _needs_library():
  if native_recurrence.unavailable(F32):
    if native_build.compiler() is None:
      pytest.skip("no C++ compiler on this machine")
    pytest.fail(native_recurrence.unavailable(F32))


def _shrunk(shape):
  return (*shape[:-1], shape[-1] - 1)


# Each kernel's shapes for a direct call, and the arguments (checked
# against the window's shape) and results whose sizes it checks.
KERNELS = {
    "forward": (FORWARD, _forward_shapes, ["h0", "c0", "w_h"],
                ["ys", "h", "c", "cs", "gates"]),
    "backward": (BACKWARD, _backward_shapes,
                 ["d_ys", "cs", "c0", "w_h^T", "dh", "dc"],
                 ["dz", "dh0", "dc0"]),
    "backward_grads": (
        BACKWARD_GRADS, _backward_grads_shapes,
        ["d_ys", "cs", "c0", "w_h^T", "dh", "dc", "ys", "h0", "x"],
        ["dz", "dh0", "dc0", "d_w_h", "d_w_x", "d_bias"]),
    "backward_grads_dense": (
        BACKWARD_GRADS, lambda: _backward_grads_shapes(dense=True),
        ["ys", "h0", "x"], ["dz", "dh0", "dc0", "d_w_h", "d_w_x", "d_bias"]),
    "forward_projected": (FORWARD_PROJECTED, _projected_shapes,
                          ["x", "w_x", "bias", "h0", "c0", "w_h"],
                          ["ys", "h", "c", "cs"]),
}


@pytest.mark.parametrize("kernel,name", [
    (kernel, name) for kernel, (_, _, names, _) in KERNELS.items()
    for name in names])
def test_a_kernel_rejects_a_wrong_argument_size(kernel, name):
  _needs_library()
  target, shapes, _, _ = KERNELS[kernel]
  args, results = shapes()
  args[name] = (args[name][0] + 1, *args[name][1:])
  with pytest.raises(Exception, match=rf"{re.escape(name)} is \[.*\], "
                     "expected"):
    _call(target, args.values(), results)


@pytest.mark.parametrize("kernel,index", [
    (kernel, index) for kernel, (_, _, _, names) in KERNELS.items()
    for index in range(len(names))])
def test_a_kernel_rejects_a_wrong_result_size(kernel, index):
  _needs_library()
  target, shapes, _, names = KERNELS[kernel]
  args, results = shapes()
  results[index] = _shrunk(results[index])
  with pytest.raises(Exception, match=rf"{names[index]} is \[.*\], "
                     "expected"):
    _call(target, args.values(), results)


def test_weight_gradients_take_only_a_window_of_inputs():
  _needs_library()
  args, results = _backward_grads_shapes()
  args["x"] = (2, 3, 4, 6, 1)
  with pytest.raises(Exception, match=r"x must be \[T, B, I\]"):
    _call(BACKWARD_GRADS, args.values(), results)


def test_a_window_that_is_not_4g_wide_is_an_error():
  _needs_library()
  args, results = _forward_shapes()
  args["x_proj"] = (2, 3, 4, 4 * G + 1)
  with pytest.raises(Exception, match=r"must be \[S, T, B, 4G\]"):
    _call(FORWARD, args.values(), results)


@pytest.mark.parametrize("s,t,b", [(0, 3, 4), (2, 3, 0), (2, 0, 4)])
def test_empty_windows_are_safe(s, t, b):
  """S = 0, B = 0 or T = 0: nothing to run; the carry passes through."""
  _needs_library()
  args, results = _forward_shapes(s, t, b)
  ys, h, c, _, _ = _call(FORWARD, args.values(), results, fill=0.5)
  assert ys.shape == (s, t, b, G)
  np.testing.assert_array_equal(h, np.full((s, b, G), 0.5))
  np.testing.assert_array_equal(c, np.full((s, b, G), 0.5))
  args, results = _backward_shapes(s, t, b)
  dz, dh, dc = _call(BACKWARD, args.values(), results, fill=0.25)
  assert dz.shape == (s, t, b, 4 * G)
  np.testing.assert_array_equal(dh, np.full((s, b, G), 0.25))
  np.testing.assert_array_equal(dc, np.full((s, b, G), 0.25))
  args, results = _projected_shapes(s, t, b)
  ys, h, c, _, _ = _call(FORWARD_PROJECTED, args.values(), results,
                         fill=0.5)
  assert ys.shape == (s, t, b, G)
  np.testing.assert_array_equal(h, np.full((s, b, G), 0.5))
  np.testing.assert_array_equal(c, np.full((s, b, G), 0.5))
  # No rows: zero weight gradients (the results' buffers are not zeroed).
  for dense in (False, True):
    args, results = _backward_grads_shapes(s, t, b, dense=dense)
    got = _call(BACKWARD_GRADS, args.values(), results, fill=0.25)
    np.testing.assert_array_equal(got[1], np.full((s, b, G), 0.25))
    for grad, shape in zip(got[3:], results[3:]):
      assert grad.shape == shape
      np.testing.assert_array_equal(grad, np.zeros(shape))
