"""The full softmax head's matmuls in bfloat16 on a CPU's bf16 units.

Why: the head is most of a CPU's LM step (the tied 8,192-word head's three
products, logits = h Eᵀ, d_h = d_logits E and d_E = d_logitsᵀ h), and
XLA's CPU dot runs them in float32 whatever the operands' dtype. CPUs with
AVX512_BF16 have an instruction (vdpbf16ps) that does two bf16 products a
float32 lane where the float32 FMA does one; the native library
(`recurrence/native_cc/bf16_matmul.h`) runs the three products on it: the
operands rounded to bf16, the sums in float32, the result float32, as the
GPU's bf16 steps do.

`model.cpu_bf16_head`: "off" (default) keeps the float32 products, the
same program as before the option; "auto" runs them in bf16 where the
native library is built with AVX512_BF16 and this CPU has it, and in float32
elsewhere (another CPU, another -march build, no library, a GPU).
`model.cpu_bf16_projections` asks the same of a layer's window products
(`recurrence/scan.py`), `model.cpu_bf16_recurrence` of its time loops'
recurrent products (`recurrence/native_cc/lstm.h`); both are decided here
too: the same units, the same library.
"""

import functools

import jax
import jax.numpy as jnp

from zebra_jax.model.recurrence import native, native_check

SETTINGS = ("off", "auto")
FEATURE = "avx512_bf16"


def unavailable() -> str:
  """Why the bf16 products cannot run here ("" when they can)."""
  if jax.default_backend() != "cpu":
    return f"it runs on CPUs, not {jax.default_backend()}"
  why = native.unavailable(jnp.float32)
  if why:
    return why
  if FEATURE not in native_check.cpu_flags():
    return f"this CPU has no {FEATURE}"
  if not native.built_with(FEATURE):
    return (f"the native library is built for {native.vector_isa()} "
            f"without {FEATURE}")
  return ""


def chosen(setting: str, field: str = "cpu_bf16_head") -> bool:
  """Whether model.<field>=setting (cpu_bf16_head, cpu_bf16_projections or
  cpu_bf16_recurrence) runs the bf16 products here."""
  if setting not in SETTINGS:
    raise ValueError(f"{field}: {setting!r} is not one of {SETTINGS}")
  return setting == "auto" and not unavailable()


# Rows of hidden states at or above which a call runs the bf16 products:
# each call rounds and packs the head's whole matrix, a pass over it that a
# window's rows repay and a sampling step's few rows (which read the matrix
# once anyway) do not (native.BF16_MIN_ROWS, the layers' rule too).
MIN_ROWS = native.BF16_MIN_ROWS


def runs_for(rows: int) -> bool:
  """Whether a head call over this many rows takes the bf16 products (once
  `chosen`)."""
  return rows >= MIN_ROWS


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logits(x, w, tied: bool):
  """x [N, H] times the head's matrix: w [V, H] (tied: the embedding,
  contracted on H as it is stored) or [H, V]; [N, V] float32."""
  return native.bf16_product(x, w, False, tied)


def _forward(x, w, tied):
  return logits(x, w, tied), (x, w)


def _backward(tied, residuals, g):
  x, w = residuals
  d_x = native.bf16_product(g, w, False, not tied)  # g [N, V], w as [V, H]
  # d_w: xᵀ g [H, V] (tied: transposed back to [V, H]): the kernel packs g
  # by rows, its fast way, rather than transposing it.
  d_w = native.bf16_product(x, g, True, False)
  if tied:
    d_w = d_w.T
  return d_x.astype(x.dtype), d_w.astype(w.dtype)


logits.defvjp(_forward, _backward)
