"""A ZebraLSTM layer's time loops as compiled C++ on a CPU (XLA FFI calls).

Why: on a CPU, XLA runs every time step of `scan.py`'s scans as
separate ops (the step's matmul, a gate fusion, one write per output
window) one after another on one thread, so the time loops take about half
of a grouped layer's step while the second core idles.
`native.cc` runs each loop as one call:
a step is one pass over its rows (the recurrent matmul accumulated onto the
projected inputs in registers, the gate math on the rows just written), and
each thread runs whole windows of its own stripes, or of its own batch rows
when there are fewer stripes than cores, with no synchronisation per step.
None of the libraries XLA calls has a kernel for a block-diagonal LSTM step.

Same function, conventions and residuals as `scan.zebra_layer` and
the Pallas kernel. The two time loops are C++; the input projection, the
window's weight gradients, the inputs' gradient and the gates'
recomputation under remat are `scan.py`'s large matmuls, but for small
stripes (SMALL_STRIPE_FLOATS), whose weight gradients are C++ too, and
whose grouped input projection runs inside the forward loop.

Building: the source is compiled on first use with the machine's C++
compiler ($CXX, else c++ or g++) against the XLA FFI headers that jaxlib
ships, for this CPU (-march=native; $ZEBRA_JAX_NATIVE_MARCH names another
target, e.g. x86-64-v3 for any AVX2 machine), and the library is cached
under $XDG_CACHE_HOME/zebra_jax/kernels (default ~/.cache; a private
temporary folder where that cannot be written), keyed by the source, the
compiler, jax's version, the flags and, for -march=native, the CPU's
features. A failed build is remembered there under the same key, so other
processes do not retry it (not a compiler killed by a signal: out of
memory is no verdict on the source). Ahead of time, on a machine with a
compiler:

  python3 -m zebra_jax.model.recurrence.native --build [--march=M] [--out=F]

and ZEBRA_JAX_NATIVE_LIB=F on a node without one loads that library. A
build writes a record of the library beside it (F.json: size, SHA-256);
before a library is loaded, `native_check.py` checks it against that record,
its ELF headers and the CPU features it was built for: a damaged cached
library is rebuilt, a damaged or foreign prebuilt one, or one built for
features this CPU lacks, is refused (loading it would kill the process).
Where the kernels cannot run (not a CPU, a compute dtype other than
float32, no compiler, a failed build, a refused library), the layer runs the
scan instead, with one warning line saying why (a failed build: the
compiler's first error line). Where they run, one line says which build.
"""

import argparse
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.model.recurrence import native_check, scan

SOURCE = pathlib.Path(__file__).with_name("native.cc")
MARCH_ENV, LIB_ENV = "ZEBRA_JAX_NATIVE_MARCH", "ZEBRA_JAX_NATIVE_LIB"
_FORWARD, _BACKWARD = "zebra_native_forward", "zebra_native_backward"
_BACKWARD_GRADS = "zebra_native_backward_grads"
_FORWARD_PROJECTED = "zebra_native_forward_projected"
_COMPILE_TIMEOUT_S = 600
_BUILD_COMMAND = "python3 -m zebra_jax.model.recurrence.native --build"


def march() -> str:
  """The -march the library is built for: $ZEBRA_JAX_NATIVE_MARCH, else
  this CPU's (native)."""
  return os.environ.get(MARCH_ENV) or "native"


def source_digest() -> str:
  """The source's digest, compiled into the library: a prebuilt library
  from another version of native.cc (other FFI signatures) is refused."""
  return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def flags(target: str) -> tuple[str, ...]:
  """The compiler's flags for -march=target (checked: it goes into argv)."""
  if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", target):
    raise UserError(f"{MARCH_ENV}={target!r} is not a -march value: use e.g. "
                    "native, x86-64-v3, x86-64 or armv8-a")
  return ("-O3", f"-march={target}", "-ffp-contract=fast", "-std=c++17",
          "-shared", "-fPIC", "-pthread", "-w",
          f'-DZEBRA_NATIVE_SOURCE="{source_digest()}"')


def compiler() -> str | None:
  """The C++ compiler to build with: $CXX, else c++ or g++ on the PATH."""
  return (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
          or None)


def _user_cache() -> pathlib.Path | None:
  """$XDG_CACHE_HOME, else ~/.cache; None without a home (HOME unset and a
  uid with no passwd entry, where Path.home() raises)."""
  if root := os.environ.get("XDG_CACHE_HOME"):
    return pathlib.Path(root)
  home = os.environ.get("HOME")
  if not home:
    try:
      home = str(pathlib.Path.home())
    except (RuntimeError, KeyError, OSError):
      return None
  return pathlib.Path(home) / ".cache"


def _writable(folder: pathlib.Path, private=False) -> bool:
  """Creates folder if needed; whether this process can write into it (and,
  when private, whether only this uid can: a shared temporary folder must
  not hand us another user's library)."""
  try:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if private:
      info = folder.stat()
      if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP |
                                                       stat.S_IWOTH):
        return False
    with tempfile.TemporaryFile(dir=folder):
      pass
    return True
  except OSError:
    return False


def cache_dir() -> pathlib.Path:
  """Where libraries are cached: the user's cache, else (no home, or not
  writable) a private folder under the temporary directory."""
  user = _user_cache()
  if user is not None and _writable(user / "zebra_jax" / "kernels"):
    return user / "zebra_jax" / "kernels"
  uid = os.getuid() if hasattr(os, "getuid") else 0
  fallback = pathlib.Path(tempfile.gettempdir()) / f"zebra_jax-{uid}"
  if not _writable(fallback, private=True):
    raise OSError(f"no writable cache: {user or '(no home)'} nor {fallback}")
  (fallback / "kernels").mkdir(exist_ok=True)
  return fallback / "kernels"


def _cpu_features() -> str:
  """The CPU's feature flags: -march=native code is only valid on a CPU
  that has them all (a cache shared between machines)."""
  return native_check.cpu_features_line() or platform.processor()


def first_error(output: str) -> str:
  """The compiler's first `error:` line (the cause; later lines are its
  consequences and source excerpts), else its last non-empty line."""
  lines = [l.strip() for l in output.splitlines() if l.strip()]
  errors = [l for l in lines if "error:" in l]
  return (errors or lines[-1:] or ["no output"])[0]


class BuildError(Exception):
  """The library could not be built: the message is one line."""


# What a compiler driver prints when the signal that ended the compile was
# not its own verdict (g++: "Killed signal terminated program cc1plus";
# older g++: "internal compiler error: Killed (program cc1plus)"; clang:
# "unable to execute command: Killed", "... failed due to signal").
_KILLED = re.compile(r"signal terminated program|\(program \w+\)|"
                     r"unable to execute command|due to signal")


def killed(returncode: int, output: str) -> bool:
  """Whether a failed compile was ended by a signal (the OOM killer, a
  timeout) rather than refused by the compiler: not worth remembering."""
  return returncode < 0 or returncode >= 128 or bool(_KILLED.search(output))


def build(cxx: str, target: str, out: pathlib.Path | None = None
          ) -> pathlib.Path:
  """Compiles SOURCE for -march=target unless a library for this source,
  compiler, jax, flags (and, for native, CPU) is cached, or a build of it
  failed before; returns its path (out: build there, no cache). cxx may hold
  words ("ccache g++"), as $CXX often does. Raises BuildError."""
  return _build(cxx, target, out)[0]


def _build(cxx: str, target: str, out: pathlib.Path | None = None
           ) -> tuple[pathlib.Path, bool]:
  """build(), and whether it compiled now (False: the cached library)."""
  command = shlex.split(cxx)
  try:
    version = subprocess.run([*command, "--version"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e:
    raise BuildError(f"no usable C++ compiler ({cxx}: "
                     f"{getattr(e, 'strerror', None) or e})") from e
  build_flags = flags(target)
  key = hashlib.sha256("\n".join(
      [SOURCE.read_text(), cxx, version, jax.__version__, " ".join(build_flags),
       _cpu_features() if target == "native" else ""]).encode()
                       ).hexdigest()[:20]
  folder = cache_dir() if out is None else out.parent
  path = out or folder / f"native_recurrence_{key}.so"
  failed = folder / f"native_recurrence_{key}.failed"
  if out is None and path.exists():
    why = _cached_damage(path)
    if not why:
      return path, False
    logging.warning("the cached %s is damaged (%s): compiling it again",
                    path, why)
  elif out is None and failed.exists():
    raise BuildError(f"{failed.read_text().strip()} (an earlier build; "
                     f"delete {failed} to retry)")
  folder.mkdir(parents=True, exist_ok=True)
  logging.warning("compiling %s for -march=%s (once: about 10 s)",
                  SOURCE.name, target)
  # Built beside its final name and renamed, its record first: processes
  # that build at the same time each rename a complete library, and one cut
  # short leaves only its temporary folder.
  with tempfile.TemporaryDirectory(dir=folder) as tmp:
    built = pathlib.Path(tmp) / path.name
    try:
      subprocess.run([*command, *build_flags, f"-I{jax.ffi.include_dir()}",
                      str(SOURCE), "-o", str(built)], capture_output=True,
                     text=True, check=True, timeout=_COMPILE_TIMEOUT_S)
    except subprocess.CalledProcessError as e:
      output = e.stderr + e.stdout
      why = (f"compiling {SOURCE.name} for -march={target} failed: "
             f"{first_error(output)}")
      # Remembered (atomically, as the library is) where the compiler
      # itself refused; not a compiler killed by a signal (out of memory).
      if out is None and not killed(e.returncode, output):
        note = pathlib.Path(tmp) / failed.name
        note.write_text(why + "\n")
        os.replace(note, failed)
      raise BuildError(why) from e
    except (OSError, subprocess.SubprocessError) as e:
      raise BuildError(f"running {cxx} failed: {e}") from e
    data = built.read_bytes()
    if why := native_check.damage(data, None):
      raise BuildError(f"compiling {SOURCE.name} for -march={target} wrote "
                       f"no usable library: {why}")
    record = pathlib.Path(tmp) / native_check.record_path(path).name
    record.write_text(native_check.record_of(data))
    os.replace(record, native_check.record_path(path))
    os.replace(built, path)
  return path, True


def _cached_damage(path: pathlib.Path) -> str:
  """Why the cached library is not the one its build wrote ("" when it
  is); a library without its build's record counts as damaged."""
  try:
    data = path.read_bytes()
  except OSError as e:
    return e.strerror or str(e)
  record = native_check.read_record(path)
  if record is None:
    return "no record of its build beside it"
  return native_check.damage(data, record)


def library_path() -> tuple[pathlib.Path, str]:
  """The library this process loads, and where it comes from:
  $ZEBRA_JAX_NATIVE_LIB (made absolute), else one built now or cached for
  march(). Raises BuildError."""
  if prebuilt := os.environ.get(LIB_ENV):
    return pathlib.Path(prebuilt).expanduser().resolve(), LIB_ENV
  cxx = compiler()
  if cxx is None:
    raise BuildError("no C++ compiler found (install g++, set CXX, or point "
                     f"{LIB_ENV} at a library built with `{_BUILD_COMMAND}`)")
  path, compiled = _build(cxx, march())
  return path, "compiled now" if compiled else "cached"


def _refusal(path: pathlib.Path, origin: str, data: bytes) -> str:
  """Why this library must not be loaded here, with the fix ("" when it
  may be loaded)."""
  if origin == LIB_ENV:
    name = f"{LIB_ENV}={path}"
    if why := native_check.damage(data, native_check.read_record(path)):
      return (f"{name} is damaged ({why}): copy it again, or rebuild it "
              f"with `{_BUILD_COMMAND} --out=F`")
  else:
    name = f"the library for -march={march()} ({path})"
  why = native_check.unfit(data, source_digest(), native_check.cpu_flags())
  if not why:
    return ""
  if origin == LIB_ENV:
    fix = (f"build one for this CPU with `{_BUILD_COMMAND} --march=M "
           f"--out=F` (M: native, or x86-64-v3 for any AVX2 CPU), or unset "
           f"{LIB_ENV}")
  else:
    fix = f"set {MARCH_ENV} to a target this CPU runs, e.g. native"
  return f"{name}: {why}; {fix}"


@functools.cache
def _load(target: str, prebuilt: str | None, cxx: str | None
          ) -> tuple[str, str]:
  """Builds (or finds), checks, loads and registers one library once per
  process: ("", its FFI target suffix) when ready, else (why not, "")."""
  del target, prebuilt, cxx  # the cache key: library_path() reads them
  try:
    path, origin = library_path()
  except (BuildError, OSError, UserError) as e:
    return str(e), ""
  try:
    data = path.read_bytes()
  except OSError as e:
    return f"loading {path} failed: {e.strerror or e}", ""
  if why := _refusal(path, origin, data):
    return why, ""
  try:
    library = ctypes.CDLL(str(path))
    handlers = {_FORWARD: library.ZebraForward,
                _BACKWARD: library.ZebraBackward,
                _BACKWARD_GRADS: library.ZebraBackwardGrads,
                _FORWARD_PROJECTED: library.ZebraForwardProjected}
  except (OSError, AttributeError) as e:
    return f"loading {path} failed: {e}", ""
  # One set of FFI targets per library: tests load several (-march) side
  # by side in one process.
  suffix = "_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
  for name, handler in handlers.items():
    jax.ffi.register_ffi_target(name + suffix, jax.ffi.pycapsule(handler),
                                platform="cpu")
  _TARGETS[suffix] = native_check.build_info(data)[1]
  # The one line that says which loops run (the CLI shows warnings only).
  logging.warning("model.recurrence=native: the C++ time loops, %s build "
                  "(%s: %s)", _TARGETS[suffix], origin, path)
  return "", suffix


_TARGETS = {}  # FFI target suffix -> the vector ISA its library was built for


def _loaded() -> tuple[str, str]:
  return _load(march(), os.environ.get(LIB_ENV), compiler())


def vector_isa() -> str:
  """The vector instructions the library in use was compiled for (avx512f,
  avx2, avx, sse2, neon or generic); "" when none is loaded."""
  why, suffix = _loaded()
  return "" if why else _TARGETS[suffix]


def _unsupported(dtype, shape=()) -> str:
  """Why the kernels are not made for a layer of this compute dtype and
  window shape on this backend ("" when they are), before any library."""
  if jax.default_backend() != "cpu":
    return f"it runs on CPUs, not {jax.default_backend()}"
  if jnp.dtype(dtype) != jnp.float32:
    return f"it computes in float32, not {jnp.dtype(dtype).name}"
  if not all(isinstance(d, int) for d in shape):
    return "the window's shape is symbolic (jax.export)"
  return ""


def unavailable(dtype, shape=()) -> str:
  """Why the kernels cannot run a layer of this compute dtype and window
  shape here ("" when they can)."""
  return _unsupported(dtype, shape) or _loaded()[0]


def chosen(dtype, shape=()) -> str:
  """model.recurrence=auto's backend for a layer: "native" where its loops
  run (a CPU, float32, a concrete window, the library built or loaded),
  else "scan", the same math on every backend. Only a library that would
  not build or load warns (once): the other cases are what auto is for."""
  if _unsupported(dtype, shape):
    return "scan"
  why = _loaded()[0]
  if why:
    scan.warn_once(f"model.recurrence=auto: the native time loops are "
                   f"unavailable ({why}); running the scan")
    return "scan"
  return "native"


# Multiply-adds of a loop's matmuls per thread, at least: about 50 us of
# one core's work, where waking one of XLA's pool threads costs 10-20 us.
MIN_FLOPS_PER_THREAD = 1 << 20


def threads(flops: int) -> int:
  """Threads for a call of this many matmul FLOPs: the cores this process
  may run on, shared among its CPU devices (each device runs its own calls
  at the same time), but no more than the work is worth: a sampling step
  runs on the calling thread alone."""
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count() or 1
  return max(1, min(cores // jax.local_device_count(),
                    flops // MIN_FLOPS_PER_THREAD))


# FLOPs of one time step's recurrent matmul per thread at or above which a
# stripe's hidden units split over the threads (in step: a wait a time
# step, about 1 us; 10 us of one core's work) instead of its batch rows
# (each thread then reads the stripe's whole W_h every step; at batch 1 one
# thread reads it all).
MIN_UNIT_SPLIT_FLOPS = 1 << 20


def unit_parts(s: int, b: int, g: int, threads: int) -> int:
  """Parts each stripe's hidden units split into: the threads a stripe
  gets, where a time step's share of the matmul is worth a wait; else 1
  (whole stripes, or batch rows, a thread)."""
  parts = threads // max(s, 1)
  if parts < 2 or 2 * b * 4 * g * g // parts < MIN_UNIT_SPLIT_FLOPS:
    return 1
  return parts


def _split(s: int, t: int, b: int, g4: int, width: int = 0) -> dict:
  """A call's `threads` and `unit_parts` attributes for a [S, T, B, 4G]
  window; with `width` (the inputs a stripe reads), for its weight
  gradients too."""
  g = g4 // 4
  flops = 2 * s * t * b * g4 * g  # the recurrent matmul
  if width:  # and the weight gradients, h_prevᵀ dz and xᵀ dz
    flops += 2 * s * t * b * g4 * (g + width)
  n = threads(flops)
  return {"threads": np.int64(n),
          "unit_parts": np.int64(unit_parts(s, b, g, n))}


# A single step with nothing kept for a gradient (sampling, serving's
# decode steps) runs as the scan's one step, which XLA fuses into its
# neighbours. The kernel packs W_h into panels on every call, which a
# window of steps repays and one step does not: chained single steps of
# dense S=1 took 1.45x the scan's time at hidden 512 and batch 1, 2.9x at
# hidden 1,024 and batch 16, 1.6x at batch 64, and grouped S=8 (hidden
# 2,048, batch 64) 1.4x (2-core AMD EPYC with AVX-512); sampling at
# hidden 512 took 1.10x the scan's time on an Intel Xeon (lab.native_bench).
# Tests set this to run the kernel's one-step path.
SINGLE_STEPS_NATIVE = False


def _forward(x_proj, h0, c0, w_h, keep):
  """x_proj [S, T, B, 4G] -> ys [S, T, B, G], h, c [S, B, G], and () /
  (cs,) / (cs, gates) for keep None / "states" / "gates". The gates are
  written over x_proj's buffer."""
  s, t, b, g4 = x_proj.shape
  if keep is None and t == 1 and not SINGLE_STEPS_NATIVE:
    # pylint: disable-next=protected-access
    return scan._forward(x_proj, h0, c0, w_h, 1, None)
  f32 = jnp.float32
  ys, h, c, cs, gates = jax.ffi.ffi_call(
      _FORWARD + _loaded()[1], _forward_results(s, t, b, g4 // 4, keep),
      input_output_aliases={0: 4}, vmap_method="sequential")(
          x_proj, h0.astype(f32), c0.astype(f32), w_h,
          **_split(s, t, b, g4))
  return ys, h, c, _saved(keep, cs, gates)


def _forward_results(s, t, b, g, keep):
  """A forward call's results: ys, h, c, cs (empty unless keep), gates."""
  f32 = jnp.float32
  state = jax.ShapeDtypeStruct((s, b, g), f32)
  window = jax.ShapeDtypeStruct((s, t, b, g), f32)
  cs = window if keep else jax.ShapeDtypeStruct((0,), f32)
  return (window, state, state, cs,
          jax.ShapeDtypeStruct((s, t, b, 4 * g), f32))


def _saved(keep, cs, gates):
  """What the backward pass keeps of a forward call's results."""
  return {None: (), "states": (cs,), "gates": (cs, gates)}[keep]


def _backward(d_ys, gates, cs, c0, w_h, d_h, d_c, grads=()):
  """-> dz [S, T, B, 4G] (written over the gates' buffer), dh0, dc0; with
  grads = (inputs, ys, h0), the window's d_w_h, d_w_x and d_bias after
  them. W_h goes in transposed ([S, 4G, G]): XLA's transpose, once per
  call."""
  s, t, b, g4 = gates.shape
  f32 = jnp.float32
  state = jax.ShapeDtypeStruct((s, b, g4 // 4), f32)
  results = [jax.ShapeDtypeStruct(gates.shape, f32), state, state]
  target, width = _BACKWARD, 0
  if grads:
    inputs, ys, h0 = grads
    width = inputs.shape[-1]
    d_w_x = (width, s, g4) if inputs.ndim == 3 else (s, width, g4)
    results += [jax.ShapeDtypeStruct((s, g4 // 4, g4), f32),
                jax.ShapeDtypeStruct(d_w_x, f32),
                jax.ShapeDtypeStruct((s, g4), f32)]
    target, grads = _BACKWARD_GRADS, (ys, h0.astype(f32), inputs.astype(f32))
  return jax.ffi.ffi_call(
      target + _loaded()[1], tuple(results), input_output_aliases={1: 0},
      vmap_method="sequential")(
          d_ys.astype(f32), gates, cs, c0.astype(f32),
          jnp.swapaxes(w_h, 1, 2), d_h, d_c, *grads,
          **_split(s, t, b, g4, width))


# Small stripes: at most this many floats of one stripe's weights
# ([G + I/S or I, 4G]). Their window's weight gradients are native.cc's
# (StripeGrads, in the backward call), which XLA runs as its own dots well
# below the machine's matmul speed; a grouped layer's input projection
# runs inside its forward loop. Larger stripes keep XLA's window matmuls,
# which win there. The weight gradients alone as one call against XLA's
# dots and sum, a window of T=64, B=32 (2-core AMD EPYC with AVX-512), by
# the floats of a stripe: grouped G=32 (8,192) 1.69x faster, grouped G=64
# (32,768) 1.35x, grouped G=128 (131,072) 1.05x, dense S=8 at G=64
# (147,456) 0.92x, grouped G=256 (524,288) 0.86x, dense S=1 at G=512
# (2,097,152) 0.90x. Up to 256 KB a stripe, which stays in a core's L2
# cache while the window's rows pass.
SMALL_STRIPE_FLOATS = 1 << 16


def _small_stripes(g: int, width: int) -> bool:
  """Whether stripes of width g reading `width` inputs each are small."""
  return (g + width) * 4 * g <= SMALL_STRIPE_FLOATS


def _backward_gradients(d_ys, gates, cs, c0, w_h, d_h, d_c, inputs, ys, h0):
  """`_backward` with the window's weight gradients, one call for small
  stripes: (dz, dh0, dc0, (d_w_x, d_bias, d_w_h)) from the layer's inputs
  (dense [T, B, I], grouped [S, T, B, I/S]), its outputs ys and h0 (h_{t-1}
  of every step) besides. Where each thread runs whole stripes, the sums
  run inside the loop, on each chunk of dz just written (the step 1.03-1.04x
  faster than a second call reading dz back: lab.bench's core grouped S=8,
  2-core AMD EPYC with AVX-512). None for larger stripes."""
  if not _small_stripes(gates.shape[-1] // 4, inputs.shape[-1]):
    return None
  dz, dh0, dc0, d_w_h, d_w_x, d_bias = _backward(
      d_ys, gates, cs, c0, w_h, d_h, d_c, (inputs, ys, h0))
  return dz, dh0, dc0, (d_w_x, d_bias, d_w_h)


def _projected_forward(inputs, w_x, bias, h0, c0, w_h, keep):
  """`_forward` of a grouped layer of small stripes from its inputs: the
  input projection runs inside the loop, each step's gates started from
  bias + x_t W_x (no projected window written and read back). None where
  it does not apply (dense, large stripes, a single step, hidden units
  split over threads)."""
  s, g = w_h.shape[0], w_h.shape[1]
  if inputs.ndim != 4 or not _small_stripes(g, inputs.shape[-1]):
    return None
  _, t, b, width = inputs.shape
  if keep is None and t == 1 and not SINGLE_STEPS_NATIVE:
    return None
  split = _split(s, t, b, 4 * g)
  if split["unit_parts"] > 1:
    return None
  f32 = jnp.float32
  ys, h, c, cs, gates = jax.ffi.ffi_call(
      _FORWARD_PROJECTED + _loaded()[1], _forward_results(s, t, b, g, keep),
      vmap_method="sequential")(
          inputs.astype(f32), w_x.astype(f32), bias.astype(f32),
          h0.astype(f32), c0.astype(f32), w_h.astype(f32),
          threads=split["threads"])
  return ys, h, c, _saved(keep, cs, gates)


_native_layer = scan.kernel_layer(_forward, _backward, _projected_forward,
                                  _backward_gradients)


def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False):
  """`scan.zebra_layer` with its time loops in C++: same arguments and
  results. Where the kernels cannot run, the scan runs, with one warning."""
  why = unavailable(w_h.dtype, inputs.shape)
  if why:
    scan.warn_once(
        f"model.recurrence=native: {why}; running the scan instead")
    return scan.zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll,
                                  remat)
  return _native_layer(inputs, w_x, bias, h0, c0, w_h, remat)


def main(argv=None) -> int:
  """`--build`: compiles the library ahead of time (for a node without a
  compiler: copy it there and set ZEBRA_JAX_NATIVE_LIB)."""
  parser = argparse.ArgumentParser(
      prog="python3 -m zebra_jax.model.recurrence.native",
      description="Build the native CPU time loops ahead of time.")
  parser.add_argument("--build", action="store_true", required=True,
                      help="compile the library (or find it in the cache)")
  parser.add_argument("--march", default=None,
                      help=f"-march target (default ${MARCH_ENV} or native; "
                      "x86-64-v3 runs on any AVX2 x86-64)")
  parser.add_argument("--out", default=None,
                      help="write the library here instead of the cache")
  args = parser.parse_args(argv)
  target = args.march or march()
  try:
    cxx = compiler()
    if cxx is None:
      raise UserError("no C++ compiler found: install g++ or set CXX")
    path = build(cxx, target,
                 pathlib.Path(args.out).resolve() if args.out else None)
  except (BuildError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(path)
  print(f"use it where there is no compiler: {LIB_ENV}={path} (copy "
        f"{native_check.record_path(path).name} with it: the loader checks "
        "the copy against it)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
