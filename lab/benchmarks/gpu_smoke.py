"""The smoke stage: does the fused stripe kernel build on this GPU, and
through which Pallas GPU backend does this jax lower it?

Tiny Pallas kernels compiled and run before anything else (a 16 x 16 dot in
float32 and bfloat16, then the stripe kernel's forward and backward against
the scan); each row records ok (its error against the reference and the
precision of its lowered tt.dots) or the first error line (Triton, ptxas,
XLA), and the next row runs. Then the stripe kernel is lowered for CUDA and
the custom calls of its StableHLO name the backend that jax chose
(`__gpu$xla.gpu.triton`: Triton; `mosaic_gpu*`: Mosaic GPU), with the
deprecation warning jax gave, if any: the backend actually used, not the
one the code asks for.
"""

import contextlib
import inspect
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from lab.benchmarks.gpu_results import Results, first_error_line
from zebra_jax.model.recurrence import pallas as pallas_recurrence
from zebra_jax.model.recurrence import scan as recurrence


@contextlib.contextmanager
def triton_ir():
  """Collects the Triton IR text of every Pallas kernel lowered inside the
  block (jax's own lowering function, wrapped; the list stays empty on a
  jax that lowers elsewhere)."""
  texts = []
  try:
    from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=g-import-not-at-top
    lower = reg.lowering.lower_jaxpr_to_triton_module
  except (ImportError, AttributeError):
    yield texts
    return

  def spy(*args, **kwargs):
    result = lower(*args, **kwargs)
    texts.append(result.module.operation.get_asm())
    return result

  reg.lowering.lower_jaxpr_to_triton_module = spy
  try:
    yield texts
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = lower


def dot_precisions(text: str) -> list[str]:
  """The inputPrecision of every tt.dot in Triton IR text: ieee where the
  attribute is absent (Triton's default, not printed)."""
  found = []
  for line in text.splitlines():
    if re.search(r"\btt\.dot\b", line):
      named = re.search(r"inputPrecision = (\w+)", line)
      found.append(named.group(1) if named else "ieee")
  return found


def _tiny_dot(dtype, interpret: bool):
  """x @ w + 1 as one Pallas program of 16 x 16 tiles, Precision.HIGHEST:
  IEEE float32 products, checked against float64 at float32's error."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...],
                         precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32) + 1.0

  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    params = pltriton.CompilerParams(num_warps=4, num_stages=1)
  rng = np.random.default_rng(0)
  x, w = (jnp.asarray(rng.standard_normal((16, 16)), dtype)
          for _ in range(2))
  fn = jax.jit(pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
      interpret=interpret, compiler_params=params, name="zebra_smoke_dot"))
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + 1.0
  return lambda: float(np.max(np.abs(np.asarray(fn(x, w)) - want)))


def _tiny_stripes(dtype, interpret: bool):
  """The stripe kernel's forward and backward at one 16-row block (S=2,
  T=3, G=16) against the scan: the largest difference of the loss and
  every gradient."""
  s, t, b, g, n = 2, 3, 16, 16, 32
  rng = np.random.default_rng(0)

  def arr(shape, scale, dt=jnp.float32):
    return jnp.asarray(scale * rng.standard_normal(shape), dt)
  args = (arr((t, b, n), 1.0, dtype), arr((n, s, 4 * g), 0.3, dtype),
          arr((s, 4 * g), 0.2), arr((s, b, g), 0.5), arr((s, b, g), 0.5),
          arr((s, g, 4 * g), 0.2, dtype))

  def loss(layer):
    def fn(*a):
      ys, h, c = layer(*a)
      return jnp.sum(ys.astype(jnp.float32) ** 2) + jnp.sum(h) + jnp.sum(c)
    return jax.jit(jax.value_and_grad(fn, argnums=tuple(range(6))))

  kernel = loss(lambda *a: pallas_recurrence.zebra_layer(
      *a, 1, False, interpret=interpret))
  scan = loss(lambda *a: recurrence.zebra_layer(*a, 1, False))

  def run():
    got, want = kernel(*args), scan(*args)
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32)
                                     - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  return run


SMOKE_ROWS = (("tiny_dot_float32", _tiny_dot, jnp.float32),
              ("tiny_dot_bfloat16", _tiny_dot, jnp.bfloat16),
              ("stripe_kernel_float32", _tiny_stripes, jnp.float32),
              ("stripe_kernel_bfloat16", _tiny_stripes, jnp.bfloat16))


def stage_smoke(results: Results) -> None:
  """The backend first (lowering only: seconds), then the tiny kernels run
  on this device: a 16 x 16 dot in float32 and bfloat16, then the stripe
  kernel's forward and backward against the scan. Each row records ok
  (with its error against the reference and the precision of its lowered
  tt.dots) or the first error line (Triton, ptxas, XLA), and the next row
  runs."""
  interpret = jax.devices()[0].platform != "gpu"
  lowered = kernel_backend()
  results.update("smoke", {
      "backend": "interpret" if interpret else lowered["backend"],
      "lowered_for_cuda": lowered,
      "triton_missing": pallas_recurrence.triton_missing() or None})
  for name, make, dtype in SMOKE_ROWS:
    start = time.perf_counter()
    row = {"name": name}
    try:
      with triton_ir() as texts:
        err = make(dtype, interpret)()
      row.update(status="ok", max_abs_err=err, dot_precision=[
          p for text in texts for p in dot_precisions(text)])
    except Exception as e:  # pylint: disable=broad-except
      row.update(status="error", error=first_error_line(e))
    row["seconds"] = time.perf_counter() - start
    results.append("smoke", "rows", [row])


def cuda_target():
  """jax >= 0.11 lowers GPU kernels without a GPU only for a named abstract
  GPU; jax 0.10 lowers for a default one; on a GPU, nothing is needed."""
  params = inspect.signature(jax.sharding.AbstractMesh).parameters
  if jax.devices()[0].platform == "gpu" or "abstract_device" not in params:
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100",
                                       num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=device))


def custom_calls(stablehlo: str) -> list[str]:
  """The custom-call targets a lowered program names, sorted."""
  return sorted(set(re.findall(r"custom_call @([\w$.]+)", stablehlo)))


def backend_of(stablehlo: str) -> str:
  """The Pallas GPU backend a lowered program calls: triton, mosaic_gpu,
  both, or none (no Pallas GPU kernel in it)."""
  targets = custom_calls(stablehlo)
  found = [name for name, key in (("triton", "triton"),
                                  ("mosaic_gpu", "mosaic_gpu"))
           if any(key in t for t in targets)]
  return "+".join(found) or "none"


def kernel_backend() -> dict:
  """The stripe kernel's forward and backward (S=2, T=2, 16 rows, G=16)
  lowered for CUDA: {backend, custom_calls, warning, jax}; an error line
  in place of the backend when jax cannot lower it."""
  f32, sds = jnp.float32, jax.ShapeDtypeStruct
  s, t, b, g, n = 2, 2, 16, 16, 32
  specs = (sds((t, b, n), f32), sds((n, s, 4 * g), f32), sds((s, 4 * g), f32),
           sds((s, b, g), f32), sds((s, b, g), f32), sds((s, g, 4 * g), f32))

  def loss(*a):
    ys, h, c = pallas_recurrence.zebra_layer(*a, 1, False, interpret=False)
    return jnp.sum(ys) + jnp.sum(h) + jnp.sum(c)

  info = {"jax": jax.__version__, "warning": None, "custom_calls": []}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      with cuda_target():
        text = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)))
                       ).trace(*specs).lower(
                           lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # pylint: disable=broad-except
      info["backend"] = f"error: {first_error_line(e)}"
      return info
  info["backend"] = backend_of(text)
  info["custom_calls"] = custom_calls(text)
  pallas_warnings = [str(w.message) for w in caught
                     if "pallas" in str(w.message).lower()]
  info["warning"] = pallas_warnings[0] if pallas_warnings else None
  return info
