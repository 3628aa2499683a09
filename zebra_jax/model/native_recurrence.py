"""A ZebraLSTM layer's time loops as compiled C++ on a CPU (XLA FFI calls).

Why: on a CPU, XLA runs every time step of `recurrence.py`'s scans as
separate ops (the step's matmul, a gate fusion, one write per output
window) one after another on one thread, so the time loops take about half
of a grouped layer's step while the second core idles
(docs/performance.md). `native/recurrence.cc` runs each loop as one call:
a step is one pass over its rows (the recurrent matmul accumulated onto the
projected inputs in registers, the gate math on the rows just written), and
each thread runs whole windows of its own stripes, or of its own batch rows
when there are fewer stripes than cores, with no synchronisation per step.
None of the libraries XLA calls has a kernel for a block-diagonal LSTM step.

Same function, conventions and residuals as `recurrence.zebra_layer` and
the Pallas kernel: the input projection, the gates' recomputation under
remat and the window gradients are `recurrence.py`'s large matmuls; only the
two time loops are C++.

Building: the source is compiled on first use with the machine's C++
compiler ($CXX, else c++ or g++), against the XLA FFI headers that jaxlib
ships, for this CPU (-march=native), and the library is cached under
$XDG_CACHE_HOME/zebra_jax/kernels (default under ~/.cache), keyed by the
source, the compiler, jax's version and the CPU's features. Where it cannot
run (not a CPU, a compute dtype other than float32, no compiler), the layer
runs the scan instead, with one warning line saying why.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.model import recurrence

SOURCE = pathlib.Path(__file__).with_name("native") / "recurrence.cc"
_FORWARD, _BACKWARD = "zebra_native_forward", "zebra_native_backward"
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17",
          "-shared", "-fPIC", "-pthread", "-w")

def compiler() -> str | None:
  """The C++ compiler to build with: $CXX, else c++ or g++ on the PATH."""
  return (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
          or None)


def cache_dir() -> pathlib.Path:
  root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(root) / "zebra_jax" / "kernels"


def _cpu_features() -> str:
  """The CPU's feature flags: -march=native code is only valid on a CPU
  that has them all (a cache shared between machines)."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor()


def _build(cxx: str) -> pathlib.Path:
  """Compiles SOURCE unless a library for this source, compiler, jax and
  CPU is cached; returns its path. Raises OSError or CalledProcessError.
  cxx may hold words ("ccache g++"), as $CXX often does."""
  command = shlex.split(cxx)
  version = subprocess.run([*command, "--version"], capture_output=True,
                           text=True, check=True).stdout
  key = hashlib.sha256("\n".join(
      [SOURCE.read_text(), cxx, version, jax.__version__, " ".join(_FLAGS),
       _cpu_features()]).encode()).hexdigest()[:20]
  path = cache_dir() / f"native_recurrence_{key}.so"
  if path.exists():
    return path
  path.parent.mkdir(parents=True, exist_ok=True)
  # Built beside its final name and renamed: processes that build at the
  # same time each rename a complete library.
  with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
    built = pathlib.Path(tmp) / path.name
    subprocess.run([*command, *_FLAGS, f"-I{jax.ffi.include_dir()}",
                    str(SOURCE), "-o", str(built)], capture_output=True,
                   text=True, check=True)
    os.replace(built, path)
  return path


@functools.cache
def _load() -> str:
  """Builds, loads and registers the kernels once per process: "" when they
  are ready, else why not."""
  cxx = compiler()
  if cxx is None:
    return "no C++ compiler found (install g++, or set CXX)"
  try:
    library = ctypes.cdll.LoadLibrary(str(_build(cxx)))
  except subprocess.CalledProcessError as e:
    last = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["?"]
    return f"compiling {SOURCE.name} failed: {last[0]}"
  except OSError as e:
    return f"building {SOURCE.name} failed: {e}"
  jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(library.ZebraForward),
                              platform="cpu")
  jax.ffi.register_ffi_target(_BACKWARD,
                              jax.ffi.pycapsule(library.ZebraBackward),
                              platform="cpu")
  return ""


def unavailable(dtype, shape=()) -> str:
  """Why the kernels cannot run a layer of this compute dtype and window
  shape here ("" when they can)."""
  if jax.default_backend() != "cpu":
    return f"it runs on CPUs, not {jax.default_backend()}"
  if jnp.dtype(dtype) != jnp.float32:
    return f"it computes in float32, not {jnp.dtype(dtype).name}"
  if not all(isinstance(d, int) for d in shape):
    return "the window's shape is symbolic (jax.export)"
  return _load()


def threads() -> int:
  """Threads per call: the cores this process may run on, shared among its
  CPU devices (each device runs its own calls at the same time)."""
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count() or 1
  return max(1, cores // jax.local_device_count())


def _forward(x_proj, h0, c0, w_h, keep):
  """x_proj [S, T, B, 4G] -> ys [S, T, B, G], h, c [S, B, G], and () /
  (cs,) / (cs, gates) for keep None / "states" / "gates". The gates are
  written over x_proj's buffer."""
  s, t, b, g4 = x_proj.shape
  f32 = jnp.float32
  state = jax.ShapeDtypeStruct((s, b, g4 // 4), f32)
  window = jax.ShapeDtypeStruct((s, t, b, g4 // 4), f32)
  cs = window if keep else jax.ShapeDtypeStruct((0,), f32)
  ys, h, c, cs, gates = jax.ffi.ffi_call(
      _FORWARD, (window, state, state, cs, jax.ShapeDtypeStruct(
          x_proj.shape, f32)), input_output_aliases={0: 4},
      vmap_method="sequential")(
          x_proj, h0.astype(f32), c0.astype(f32), w_h,
          threads=np.int64(threads()))
  saved = {None: (), "states": (cs,), "gates": (cs, gates)}[keep]
  return ys, h, c, saved


def _backward(d_ys, gates, cs, c0, w_h, d_h, d_c):
  """-> dz [S, T, B, 4G] (written over the gates' buffer), dh0, dc0.
  W_h goes in transposed ([S, 4G, G]): XLA's transpose, once per call."""
  s, t, b, g4 = gates.shape
  f32 = jnp.float32
  state = jax.ShapeDtypeStruct((s, b, g4 // 4), f32)
  return jax.ffi.ffi_call(
      _BACKWARD, (jax.ShapeDtypeStruct(gates.shape, f32), state, state),
      input_output_aliases={1: 0}, vmap_method="sequential")(
          d_ys.astype(f32), gates, cs, c0.astype(f32),
          jnp.swapaxes(w_h, 1, 2), d_h, d_c,
          threads=np.int64(threads()))


_native_layer = recurrence.kernel_layer(_forward, _backward)


def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False):
  """`recurrence.zebra_layer` with its time loops in C++: same arguments and
  results. Where the kernels cannot run, the scan runs, with one warning."""
  why = unavailable(w_h.dtype, inputs.shape)
  if why:
    recurrence.warn_once(
        f"model.recurrence=native: {why}; running the scan instead")
    return recurrence.zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll,
                                  remat)
  return _native_layer(inputs, w_x, bias, h0, c0, w_h, remat)
