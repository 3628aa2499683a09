"""PyTorch nn.LSTM steps of the benchmark shapes: the reference JAX rows are
compared with, in the same process and timed the same way.
"""

import contextlib
import functools
import os

import jax
import numpy as np

from lab.benchmarks.shapes import word_shape
from lab.benchmarks.steps import random_tokens
from lab.benchmarks.timing import peak_shapes, shape_reps
from zebra_jax.model import cpu_bf16_head
from zebra_jax.model.recurrence import native_check

TORCH_GROUPS = ("core", "lm", "head", "eval", "word", "word_adaptive",
                "head_adaptive")


def _cpu_has_bf16() -> bool:
  """Whether this CPU multiplies bf16 in hardware (AVX512-BF16)."""
  return cpu_bf16_head.FEATURE in native_check.cpu_flags()


def autocast_note() -> str:
  """How torch.autocast(bfloat16) runs on this CPU (see torch_autocast)."""
  return ("float32 weights under torch.autocast(bfloat16), oneDNN's bf16 "
          "kernels " + ("on" if _cpu_has_bf16() else "off (no AVX512-BF16)"))


def torch_autocast(torch, device: str, dtype):
  """torch.autocast to `dtype` (None: off). oneDNN's CPU LSTM has no
  bfloat16 kernel on CPUs without AVX512-BF16 and raises when autocast
  hands it one, so on those CPUs autocast runs without oneDNN; where the
  CPU has it, oneDNN's bf16 kernels are torch's fastest bf16 path (about
  3x its path without them on a Zen 4 core) and stay on."""
  stack = contextlib.ExitStack()
  if dtype is not None:
    stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
    if device == "cpu" and not _cpu_has_bf16():
      stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
  return stack


class TorchTrainer:
  """One torch train step: float32 parameters and float32 Adam state, the
  forward and backward under torch.autocast when autocast_dtype is set,
  which is what JAX's bfloat16 steps do (float32 parameters cast for the
  matmuls)."""

  timing = "torch"  # device_timing reads CUDA events on a GPU

  def __init__(self, torch, params, loss_fn, device, autocast_dtype, sync,
               optimizer=True):
    self.params = list(params)
    self.opt = torch.optim.Adam(self.params, 1e-3) if optimizer else None
    self.loss_fn, self.sync, self.device = loss_fn, sync, device
    self.autocast = functools.partial(torch_autocast, torch, device,
                                      autocast_dtype)

  def __call__(self):
    self.dispatch()
    self.wait()

  def dispatch(self):
    """One step enqueued on the device, not waited for."""
    for p in self.params:
      p.grad = None
    with self.autocast():
      loss = self.loss_fn("mean")
    loss.backward()
    if self.opt is not None:
      self.opt.step()

  def wait(self):
    self.sync()


def _cores() -> int:
  """The cores this process may run on."""
  return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
          else os.cpu_count())


def torch_steps(shape, groups=TORCH_GROUPS, device="cpu",
                autocast_bf16=False) -> dict:
  """{group: step} of nn.LSTM rows of the same shape (torch imported).

  Modules are float32 everywhere; in bfloat16 (or with autocast_bf16) they
  run under torch.autocast (TorchTrainer). The core rows' input does not
  require grad, so autograd skips the first layer's input gradient, as JAX
  does.
  """
  import torch  # pylint: disable=g-import-not-at-top
  autocast_dtype = (torch.bfloat16 if shape["dtype"] == "bfloat16"
                    or autocast_bf16 else None)
  cuda = device == "cuda"
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  torch.manual_seed(0)

  def lm_loss(shape, head="full"):
    """(parameters, loss_fn(reduction)) of embedding -> nn.LSTM -> tied full
    head or nn.AdaptiveLogSoftmaxWithLoss (same cutoffs and div_val,
    untied)."""
    h, v = shape["hidden"], shape["vocab"]
    lstm = torch.nn.LSTM(h, h, shape["layers"], batch_first=True).to(device)
    embed = torch.nn.Embedding(v, h).to(device)
    tokens = torch.tensor(np.asarray(random_tokens(shape)), dtype=torch.long,
                          device=device)
    targets = tokens[:, 1:].reshape(-1)
    if head == "full":
      head_b = torch.nn.Parameter(torch.zeros(v, device=device))
      extra = [head_b]

      def loss_fn(reduction):
        y, _ = lstm(embed(tokens[:, :-1]))
        logits = (y @ embed.weight.T + head_b).float()  # tied head
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, v), targets, reduction=reduction)
    else:
      cutoffs = [c for c in shape["cutoffs"] if c < v]
      adaptive = torch.nn.AdaptiveLogSoftmaxWithLoss(
          h, v, cutoffs, div_value=float(shape["div_val"])).to(device)
      extra = list(adaptive.parameters())

      def loss_fn(reduction):
        y, _ = lstm(embed(tokens[:, :-1]))
        loss = adaptive(y.reshape(-1, h), targets).loss  # mean
        return loss * targets.numel() if reduction == "sum" else loss
    return [*lstm.parameters(), *embed.parameters(), *extra], loss_fn

  def head_loss(shape, head="full"):
    """(parameters, loss_fn(reduction)) of the head alone on fixed hidden
    states [batch x window, hidden] that need their gradient: a tied
    embedding's [V, H] matrix, a bias and cross-entropy, or
    nn.AdaptiveLogSoftmaxWithLoss (same cutoffs and div_val)."""
    h, v = shape["hidden"], shape["vocab"]
    n = shape["batch"] * shape["seq_len"]
    hidden = torch.nn.Parameter(torch.randn(n, h, device=device) * 0.1)
    targets = torch.tensor(np.asarray(random_tokens(shape)[:, 1:]),
                           dtype=torch.long, device=device).reshape(-1)
    if head == "full":
      weight = torch.nn.Parameter(torch.rand(v, h, device=device) * 0.2 - 0.1)
      bias = torch.nn.Parameter(torch.zeros(v, device=device))

      def loss_fn(reduction):
        logits = (hidden @ weight.T + bias).float()
        return torch.nn.functional.cross_entropy(logits, targets,
                                                 reduction=reduction)
      return [hidden, weight, bias], loss_fn
    adaptive = torch.nn.AdaptiveLogSoftmaxWithLoss(
        h, v, [c for c in shape["cutoffs"] if c < v],
        div_value=float(shape["div_val"])).to(device)

    def adaptive_loss(reduction):
      loss = adaptive(hidden, targets).loss  # mean
      return loss * targets.numel() if reduction == "sum" else loss
    return [hidden, *adaptive.parameters()], adaptive_loss

  def core_loss():
    b, t, h = shape["batch"], shape["seq_len"], shape["hidden"]
    lstm = torch.nn.LSTM(h, h, shape["layers"], batch_first=True).to(device)
    x = torch.randn(b, t, h, device=device)  # needs no grad

    def loss_fn(reduction):
      del reduction  # a mean, as core_runner's loss
      y, _ = lstm(x)
      return y.float().square().mean()
    return lstm.parameters(), loss_fn

  def trainer(params_and_loss):
    return TorchTrainer(torch, *params_and_loss, device, autocast_dtype, sync)

  def evaluator(params_and_loss):
    _, loss_fn = params_and_loss
    autocast = functools.partial(torch_autocast, torch, device,
                                 autocast_dtype)

    def ev():
      with torch.no_grad(), autocast():
        loss_fn("sum")
      sync()
    return ev

  def backward(params_and_loss):  # the head alone: no optimizer step
    return TorchTrainer(torch, *params_and_loss, device, autocast_dtype, sync,
                        optimizer=False)

  build = {"core": lambda: trainer(core_loss()),
           "lm": lambda: trainer(lm_loss(shape)),
           "head": lambda: backward(head_loss(shape)),
           "head_adaptive": lambda: backward(head_loss(word_shape(shape),
                                                       "adaptive")),
           "eval": lambda: evaluator(lm_loss(shape)),
           "word": lambda: trainer(lm_loss(word_shape(shape))),
           "word_adaptive": lambda: trainer(lm_loss(word_shape(shape),
                                                    "adaptive"))}
  return {group: build[group]() for group in groups}


def torch_runners(shape, groups=TORCH_GROUPS,
                  autocast_bf16=False) -> tuple[dict, str | None]:
  """({group: {threads: step}}, note) of `torch_steps`; ({}, note) when torch
  is missing. autocast_bf16: the float32 shape's steps under
  torch.autocast(bfloat16), the reference of JAX rows that multiply in
  bf16 on a CPU.

  On CPU torch runs with 1 thread and with every core, because on small
  shared machines one thread is often faster (its OpenMP threads spin and
  lose more than XLA's pool to other load).
  """
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}, "torch not installed (pip install torch): torch rows skipped"
  cuda = torch.cuda.is_available() and jax.devices()[0].platform == "gpu"
  threads = _cores()
  torch.set_num_threads(threads)
  steps = torch_steps(shape, groups, "cuda" if cuda else "cpu",
                      autocast_bf16)

  def with_threads(fn, n):
    def run():
      torch.set_num_threads(n)
      fn()
    return run

  fns = {group: {n: with_threads(fn, n)
                 for n in ([threads] if cuda else sorted({1, threads}))}
         for group, fn in steps.items()}
  where = (f"cuDNN {torch.backends.cudnn.version()}" if cuda
           else f"CPU, 1 and {threads} threads, the faster kept")
  note = f"torch {torch.__version__} ({where})"
  if autocast_bf16:
    note = f"torch {torch.__version__} bf16 rows: {autocast_note()}"
  elif shape["dtype"] == "bfloat16":
    note += ("; float32 weights and Adam state under torch.autocast(bfloat16)"
             " as JAX keeps float32 parameters and computes in bfloat16"
             + ("; autocast runs cuDNN's LSTM in float16 (same tensor-core "
                "rate)" if cuda else ""))
  return fns, note


def torch_matmuls(shape) -> dict:
  """{shape name: (call, FLOPs a call)}: torch's batched matmul of each of
  `timing.peak_shapes` in the compute dtype, on every core (GPU: cuBLAS),
  the peak's rows beside XLA's (`timing.matmul_peak`); {} when torch is
  missing. A call runs what XLA's loop runs, `reps` times: the product
  added to an accumulator (one `baddbmm`) and the left operand negated,
  so that both sides pay for the same memory traffic besides the
  matmul."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}
  cuda = torch.cuda.is_available() and jax.devices()[0].platform == "gpu"
  device = "cuda" if cuda else "cpu"
  dtype = torch.bfloat16 if shape["dtype"] == "bfloat16" else torch.float32
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  threads = _cores()
  calls = {}
  for name, (s, m, k, n) in peak_shapes(shape).items():
    flops = 2.0 * s * m * k * n
    reps = shape_reps(shape, flops)
    a = torch.full((s, m, k), 0.01, dtype=dtype, device=device)
    w = torch.full((s, k, n), 0.01, dtype=dtype, device=device)
    acc = torch.zeros((s, m, n), dtype=dtype, device=device)

    def call(a=a, w=w, acc=acc, reps=reps):
      torch.set_num_threads(threads)
      for _ in range(reps):
        torch.baddbmm(acc, a, w, out=acc)
        a.neg_()
      sync()
    calls[name] = (call, flops * reps)
  return calls
