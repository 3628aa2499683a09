"""A ZebraLSTM layer's time loops as compiled C++ on a CPU (XLA FFI calls).

Why: on a CPU, XLA runs every time step of `scan.py`'s scans as
separate ops (the step's matmul, a gate fusion, one write per output
window) one after another on one thread, so the time loops take a large
share of a grouped layer's step while the second core idles.
`native_cc/native.cc` runs each loop as one call:
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

The library is built (once, then cached), or found prebuilt through
$ZEBRA_JAX_NATIVE_LIB, and checked before it is loaded by `native_build.py`;
ahead of time, on a machine with a compiler:

  python3 -m zebra_jax.model.recurrence.native --build [--march=M] [--out=F]

This module loads it, registers its FFI targets and is the JAX side of the
calls. Where the kernels cannot run (not a CPU, a compute dtype other than
float32, no compiler, a failed build, a refused library), the layer runs the
scan instead, with one warning line saying why (a failed build: the
compiler's first error line). Where they run, one line says which build.
"""

import ctypes
import functools
import hashlib
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax.model.recurrence import native_build, native_check, scan

_FORWARD, _BACKWARD = "zebra_native_forward", "zebra_native_backward"
_BACKWARD_GRADS = "zebra_native_backward_grads"
_FORWARD_PROJECTED = "zebra_native_forward_projected"
BF16_MATMUL = "zebra_bf16_matmul"  # bf16_product's
FUSED_XENT = "zebra_fused_xent"  # the tied head's loss (model/cpu_fused_head.py)


@functools.cache
def _load(target: str, prebuilt: str | None, cxx: str | None
          ) -> tuple[str, str]:
  """Builds (or finds), checks, loads and registers one library once per
  process: ("", its FFI target suffix) when ready, else (why not, "")."""
  del target, prebuilt, cxx  # the cache key: library_path() reads them
  try:
    path, origin = native_build.library_path()
  except (native_build.BuildError, OSError, UserError) as e:
    return str(e), ""
  try:
    data = path.read_bytes()
  except OSError as e:
    return f"loading {path} failed: {e.strerror or e}", ""
  if why := native_build.refusal(path, origin, data):
    return why, ""
  try:
    library = ctypes.CDLL(str(path))
    handlers = {_FORWARD: library.ZebraForward,
                _BACKWARD: library.ZebraBackward,
                _BACKWARD_GRADS: library.ZebraBackwardGrads,
                _FORWARD_PROJECTED: library.ZebraForwardProjected,
                BF16_MATMUL: library.ZebraBf16Matmul,
                FUSED_XENT: library.ZebraFusedXent}
  except (OSError, AttributeError) as e:
    return f"loading {path} failed: {e}", ""
  # One set of FFI targets per library: tests load several (-march) side
  # by side in one process.
  suffix = "_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
  for name, handler in handlers.items():
    jax.ffi.register_ffi_target(name + suffix, jax.ffi.pycapsule(handler),
                                platform="cpu")
  _, _TARGETS[suffix], _NEEDS[suffix] = native_check.build_info(data)
  # The one line that says which loops run (the CLI shows warnings only).
  logging.warning("model.recurrence=native: the C++ time loops, %s build "
                  "(%s: %s)", _TARGETS[suffix], origin, path)
  return "", suffix


_TARGETS = {}  # FFI target suffix -> the vector ISA its library was built for
_NEEDS = {}  # FFI target suffix -> the CPU features its library was built for


def _loaded() -> tuple[str, str]:
  return _load(native_build.march(), os.environ.get(native_build.LIB_ENV),
               native_build.compiler())


def vector_isa() -> str:
  """The vector instructions the library in use was compiled for (avx512f,
  avx2, avx, sse2, neon or generic); "" when none is loaded."""
  why, suffix = _loaded()
  return "" if why else _TARGETS[suffix]


def target_suffix() -> str:
  """The loaded library's FFI target suffix ("" when none is loaded)."""
  return _loaded()[1]


def built_with(feature: str) -> bool:
  """Whether the library in use was compiled for this CPU feature
  (/proc/cpuinfo's name, e.g. avx512_bf16)."""
  why, suffix = _loaded()
  return not why and feature in _NEEDS[suffix]


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


# Multiply-adds of a loop's matmuls per thread, at least: enough of one
# core's work to outweigh waking one of XLA's pool threads for it.
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


# Rows at or above which a bf16 product is worth its call (model.
# cpu_bf16_head's rows of hidden states, model.cpu_bf16_projections' T x B
# of a window): each call rounds and packs its weights whole, which a
# window's rows repay and a sampling step's few rows do not.
BF16_MIN_ROWS = 64


def bf16_product(a, b, a_transposed: bool, b_transposed: bool):
  """op(a) op(b) [m, n] float32 of two matrices through the library's bf16
  matmul (native_cc/bf16_matmul.h: operands rounded to bf16, float32
  sums), each operand read in place, transposed or not. The products of
  model.cpu_bf16_head and model.cpu_bf16_projections, where
  `cpu_bf16_head.unavailable()` says they can run."""
  m = a.shape[1 if a_transposed else 0]
  n = b.shape[0 if b_transposed else 1]
  k = a.shape[0 if a_transposed else 1]
  return jax.ffi.ffi_call(
      BF16_MATMUL + target_suffix(),
      jax.ShapeDtypeStruct((m, n), jnp.float32),
      vmap_method="sequential")(
          a.astype(jnp.float32), b.astype(jnp.float32),
          a_transposed=np.bool_(a_transposed),
          b_transposed=np.bool_(b_transposed),
          threads=np.int64(threads(2 * m * n * k)))


# FLOPs of one time step's recurrent matmul per thread at or above which a
# stripe's hidden units split over the threads (in step: a wait every
# time step, which a step's share of this much work outweighs) instead of
# its batch rows (each thread then reads the stripe's whole W_h every step;
# at batch 1 one thread reads it all).
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
# window of steps repays and one step does not: chained single steps ran
# slower as calls than as the scan's step, dense and grouped, at small and
# large batches alike. Tests set this to run the kernel's one-step path.
SINGLE_STEPS_NATIVE = False


def _forward(x_proj, h0, c0, w_h, keep, bf16=False):
  """x_proj [S, T, B, 4G] -> ys [S, T, B, G], h, c [S, B, G], and () /
  (cs,) / (cs, gates) for keep None / "states" / "gates". The gates are
  written over x_proj's buffer. bf16: the recurrent products with bf16
  operands and float32 sums (model.cpu_bf16_recurrence)."""
  s, t, b, g4 = x_proj.shape
  if keep is None and t == 1 and not SINGLE_STEPS_NATIVE:
    # pylint: disable-next=protected-access
    return scan._forward(x_proj, h0, c0, w_h, 1, None)
  f32 = jnp.float32
  ys, h, c, cs, gates = jax.ffi.ffi_call(
      _FORWARD + _loaded()[1], _forward_results(s, t, b, g4 // 4, keep),
      input_output_aliases={0: 4}, vmap_method="sequential")(
          x_proj, h0.astype(f32), c0.astype(f32), w_h,
          bf16=np.bool_(bf16), **_split(s, t, b, g4))
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


def _backward(d_ys, gates, cs, c0, w_h, d_h, d_c, grads=(), bf16=False):
  """-> dz [S, T, B, 4G] (written over the gates' buffer), dh0, dc0; with
  grads = (inputs, ys, h0), the window's d_w_h, d_w_x and d_bias after
  them. W_h goes in transposed ([S, 4G, G]): XLA's transpose, once per
  call. bf16: dh_{t-1} = dz_t W_hᵀ with bf16 operands and float32 sums,
  as `_forward`'s."""
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
          jnp.swapaxes(w_h, 1, 2), d_h, d_c, *grads, bf16=np.bool_(bf16),
          **_split(s, t, b, g4, width))


# Small stripes: at most this many floats of one stripe's weights
# ([G + I/S or I, 4G]). Their window's weight gradients are native.cc's
# (StripeGrads, in the backward call), which XLA runs as its own dots well
# below the machine's matmul speed; a grouped layer's input projection
# runs inside its forward loop. Larger stripes keep XLA's window matmuls,
# which win there: the one call's lead over XLA's dots shrinks as a
# stripe's weights grow and turns into a loss once they no longer stay in
# a core's L2 cache while the window's rows pass (256 KB a stripe here).
SMALL_STRIPE_FLOATS = 1 << 16


def _small_stripes(g: int, width: int) -> bool:
  """Whether stripes of width g reading `width` inputs each are small."""
  return (g + width) * 4 * g <= SMALL_STRIPE_FLOATS


def _backward_gradients(d_ys, gates, cs, c0, w_h, d_h, d_c, inputs, ys, h0):
  """`_backward` with the window's weight gradients, one call for small
  stripes: (dz, dh0, dc0, (d_w_x, d_bias, d_w_h)) from the layer's inputs
  (dense [T, B, I], grouped [S, T, B, I/S]), its outputs ys and h0 (h_{t-1}
  of every step) besides. Where each thread runs whole stripes, the sums
  run inside the loop, on each chunk of dz just written, still in cache
  (a second call would read dz back from memory). None for larger
  stripes."""
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
                                  _backward_gradients, bf16_product)


def _bf16_recurrent_product(h_rows, w_h):
  """h_rows [S, N, G] W_h per stripe with bf16 operands and float32 sums:
  what the bf16 loops compute, for remat's recomputed gates."""
  return jnp.stack([bf16_product(h_rows[i], w_h[i], False, False)
                    for i in range(w_h.shape[0])])


# The loops' recurrent products in bf16 (model.cpu_bf16_recurrence): large
# stripes only, where neither the in-loop projection nor the in-loop
# weight gradients run.
_native_layer_bf16_loops = scan.kernel_layer(
    functools.partial(_forward, bf16=True),
    functools.partial(_backward, bf16=True), None, None, bf16_product,
    _bf16_recurrent_product)


def zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll=1, remat=False,
                bf16_projections=False, bf16_recurrence=False):
  """`scan.zebra_layer` with its time loops in C++: same arguments and
  results. Where the kernels cannot run, the scan runs, with one warning.

  bf16_projections: the window's products outside the time loops (the input
  projection, the inputs' and weights' gradients) with bf16 operands and
  float32 sums (`bf16_product`; model.cpu_bf16_projections, the caller's
  choice, made where `cpu_bf16_head.unavailable()` is ""), for large
  stripes only (small ones keep float32 products, their weight gradients
  and a grouped layer's projection run inside the loops) and windows of at
  least BF16_MIN_ROWS rows.

  bf16_recurrence: the time loops' recurrent products (h W_h forward, dz
  W_hᵀ backward) with bf16 operands, h or dz rounded each step, and
  float32 sums (model.cpu_bf16_recurrence, decided as bf16_projections),
  for large stripes only; a single step with nothing kept (sampling) runs
  the scan's float32 step, as ever.
  """
  why = unavailable(w_h.dtype, inputs.shape)
  if why:
    scan.warn_once(
        f"model.recurrence=native: {why}; running the scan instead")
    return scan.zebra_layer(inputs, w_x, bias, h0, c0, w_h, unroll,
                                  remat)
  rows = inputs.shape[-3] * inputs.shape[-2]  # T x B, dense or grouped
  large = not _small_stripes(w_h.shape[1], inputs.shape[-1])
  bf16 = bf16_projections and rows >= BF16_MIN_ROWS and large
  layer = (_native_layer_bf16_loops if bf16_recurrence and large
           else _native_layer)
  return layer(inputs, w_x, bias, h0, c0, w_h, remat, bf16)


if __name__ == "__main__":  # the build command, documented as this module's
  sys.exit(native_build.main())
