"""FlashRNN (pip flashrnn: fused LSTM kernels for block-diagonal recurrent
weights, in Triton and in CUDA) as a baseline of the kernel rows, with
heads = the stripe count: its heads are our stripes, each head's recurrent
matrix a stripe's U_s.

The input projection is torch's, as FlashRNN takes the projected inputs:
dense at S = 1, block-diagonal (each head reading its own slice of the
input, as the grouped layer does) at S > 1. FlashRNN runs on CUDA only and
is not a dependency of the project: `missing()` says why a row cannot run,
and the kernel stage turns any other failure into an error row.
"""

import importlib.util

from lab.benchmarks.torch_reference import TorchTrainer

BACKENDS = {"triton": "triton_fused", "cuda": "cuda_fused"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# FlashRNN's Triton kernels hold a head's recurrent matrix in shared
# memory: documented for heads of at most this many units (wider ones ran
# out of shared memory or failed to compile on an H100).
TRITON_MAX_HEAD = 64
# What every CUDA GPU since compute capability 5.0 has, where torch's
# device properties lack the field.
_MAX_THREADS_PER_BLOCK, _REGS_PER_SM = 1024, 65536


def device_query(props) -> dict:
  """FlashRNN's four device figures from torch's device properties.

  Its own query is a compiled extension that reads cudaDeviceProp fields
  CUDA 13 removed (clockRate and others), so it does not build there; its
  CUDA kernels read only these four."""
  return {"maxThreadsPerBlock": getattr(props, "max_threads_per_block",
                                        _MAX_THREADS_PER_BLOCK),
          "regsPerMultiprocessor": getattr(props, "regs_per_multiprocessor",
                                           _REGS_PER_SM),
          "multiProcessorCount": props.multi_processor_count,
          "sharedMemPerBlockOptin": props.shared_memory_per_block_optin}


def use_torch_device_query() -> None:
  """FlashRNN's CUDA backend asks `device_query` instead of its extension."""
  import importlib  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  module = importlib.import_module("flashrnn.flashrnn.flashrnn")
  module.get_gpu_info = lambda device_id: device_query(
      torch.cuda.get_device_properties(device_id))


def unsupported(hidden: int, stripes: int, backend: str) -> str:
  """Why FlashRNN's backend cannot take heads of hidden / stripes units,
  or ''."""
  head = hidden // stripes
  if backend == "triton" and head > TRITON_MAX_HEAD:
    return (f"FlashRNN's Triton kernels take heads of at most "
            f"{TRITON_MAX_HEAD} units: {head} here")
  return ""


def missing() -> str:
  """'' when FlashRNN can run here, else why not (one line)."""
  if importlib.util.find_spec("flashrnn") is None:
    return ("flashrnn not installed: carry its wheel (bash "
            "launch/gpu_wheels.sh)")
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return "flashrnn needs torch, which is not installed"
  if not torch.cuda.is_available():
    return "flashrnn runs on CUDA only: torch sees no CUDA device"
  return ""


def train_step(shape, stripes: int, precision: str, backend: str):
  """A torch train step of `layers` FlashRNN LSTM layers of S heads over
  random inputs, loss the mean square of the outputs; Adam at 1e-3."""
  from flashrnn import flashrnn  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  if backend == "cuda":
    use_torch_device_query()
  b, t, h = shape["batch"], shape["seq_len"], shape["hidden"]
  d = h // stripes
  dtype = DTYPES[precision]
  torch.manual_seed(0)

  def param(*size, scale=0.1):
    return torch.nn.Parameter(scale * torch.randn(*size, device="cuda"))
  layers = [(param(stripes, d, 4, d), param(4, stripes, d, d),
             param(4, stripes, d, scale=0.0))
            for _ in range(shape["layers"])]
  params = [p for layer in layers for p in layer]
  x = torch.randn(b, t, h, device="cuda")
  wanted = getattr(torch, dtype)

  def step():
    y = x
    for w, r, bias in layers:
      # [B, T, S, d] @ [S, d, 4, d] -> [B, T, 4, S, d]: head s reads slice s
      # (S = 1: the dense projection)
      wx = torch.einsum("btsi,sigo->btgso",
                        y.reshape(b, t, stripes, d).to(wanted),
                        w.to(wanted))
      out, _ = flashrnn(wx, r.to(wanted), bias.to(wanted), function="lstm",
                        backend=BACKENDS[backend], dtype=dtype)
      y = out[0].reshape(b, t, h)  # states [S=h, c, ...]: h, [B, T, S, d]
    return y.float().square().mean()

  return TorchTrainer(torch, params, lambda reduction: step(), "cuda", None,
                      torch.cuda.synchronize)
