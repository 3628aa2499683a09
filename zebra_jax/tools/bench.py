"""Speed and memory benchmark: ZebraLSTM next to PyTorch nn.LSTM, one process.

  python -m zebra_jax.tools.bench                      # shape A, CPU or GPU (minutes)
  python -m zebra_jax.tools.bench --shape=gpu          # bf16, hidden 1024, batch 64
  python -m zebra_jax.tools.bench --quick --json=/tmp/bench.json   # tiny, seconds

Rows (tokens/s, ms/step, ratio to torch, model GFLOP/s and fraction of the
best matmul measured in this run, XLA's planned bytes per step):
  core_S{s}   stacked ZebraLSTMLayers + Adam, sum-of-squares loss on outputs
  core_S1_remat  core_S1 with model.remat (the gates recomputed), beside it
  core_S{s}_autodiff  the same with JAX's autodiff of the scan instead of the
              hand-written backward pass (recurrence.py)
  lm_S{s}     embedding -> layers -> tied head -> cross-entropy, + Adam
  eval_S{s}   the LM forward with carry (evaluate.eval_step)
  gen_S{s}_b{b}  sampling.generate: one token at a time in a jitted scan
  *_S{s}_grouped  the same with model.stripe_input=grouped: every matmul of
              a layer split in S blocks, stripes shuffled between layers
  word_S{s}[_grouped][_adaptive]  the LM train step at the word-level shape
              (hidden 256, 16,384 words, Zipf-distributed tokens), full or
              adaptive head: where the softmax, not the recurrence, costs
  torch_*_{n}t  nn.LSTM (+ nn.Embedding and a tied head, or
              nn.AdaptiveLogSoftmaxWithLoss) of the same shape on n threads;
              ratios are against the faster thread count; float32 weights
              and Adam state, under torch.autocast in bfloat16 (as JAX
              keeps float32 parameters and computes in bfloat16)
Every timed function runs once untimed, then all run interleaved, round after
round, and each row reports its median: the machine's noise (other jobs) hits
every row alike, so on shared CPUs compare ratios, not absolute times. Memory: one fresh process per window
(peak RSS on CPU, peak_bytes_in_use on GPU) and XLA's buffer plan.

FLOPs are the matmuls each step runs, counted analytically per token: input
projection 2*in*4H (grouped: /S), recurrence 2*H*4H/S, head 2*H*V (adaptive:
the shortlist, and each tail for the share of tokens it holds). A train step
runs each three times (forward, weight gradient, input gradient), except the
first layer's input gradient where nothing needs it: the core rows' inputs
are data (JAX never computes it; torch's autograd skips it too, the input not
requiring grad); the LM rows need it for the embedding. Remat's recomputed
matmuls are not counted (model FLOPs). The peak is the best measured matmul
of several shapes in the compute dtype, the steps' own among them, each call
at least 10 ms of work even at the datasheet's rate, shown beside the
datasheet's dense bf16 figure where the device is known; a row above 100% of
it would mean the peak is wrong, and the output says so.
"""

import contextlib
import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from zebra_jax.inference import sampling
from zebra_jax.model import adaptive_softmax as asm
from zebra_jax.model import lm, metrics
from zebra_jax.runtime import profiling
from zebra_jax.training import evaluate

_QUICK = flags.DEFINE_bool("quick", False,
                           "Tiny shapes: a smoke test in seconds.")
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")
_SHAPE = flags.DEFINE_enum("shape", "A", ["A", "gpu"], "A: hidden 512, batch "
                           "32, fp32. gpu: hidden 1024, batch 64, bf16.")
_ROUNDS = flags.DEFINE_integer("rounds", 0, "Timing rounds (0 = default).")
_MEMORY = flags.DEFINE_bool("memory", True, "Run the memory-per-window rows.")
_TRACE = flags.DEFINE_string("trace_dir", None, "jax.profiler trace of one "
                             "step of every JAX row, for TensorBoard/xprof, "
                             "and a table of its device time by kind of op.")
_MEMORY_ROW = flags.DEFINE_string("memory_row", None, "Internal: one "
                                  "'seq_len,remat' row in a fresh process.")

# Every process that shares a GPU with another: XLA reserves 75% of GPU
# memory at start by default, leaving a child process the rest.
NO_PREALLOCATE = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}

# The word-level shape of the word_* rows: a small LSTM under a large
# vocabulary, tokens drawn from a Zipf law (ids sorted by frequency).
_WORD = dict(hidden=256, vocab=16384, cutoffs=(2048, 8192), div_val=4)
SHAPES = {  # hidden = embed (tied head); vocab 8192 for the LM rows.
    "A": dict(hidden=512, layers=2, batch=32, seq_len=64, vocab=8192,
              dtype="float32", stripes=(1, 2, 4, 8), lm_stripes=(1, 8),
              grouped_stripes=(2, 4, 8), word=_WORD,
              gen_tokens=256, windows=(64, 256, 1024), budget_gb=8.0),
    "gpu": dict(hidden=1024, layers=2, batch=64, seq_len=64, vocab=8192,
                dtype="bfloat16", stripes=(1, 2, 4, 8), lm_stripes=(1, 8),
                grouped_stripes=(2, 4, 8), word=_WORD,
                gen_tokens=256, windows=(64, 256, 1024), budget_gb=40.0),
    "quick": dict(hidden=32, layers=2, batch=4, seq_len=8, vocab=64,
                  dtype="float32", stripes=(1, 4), lm_stripes=(1,),
                  grouped_stripes=(4,),
                  word=dict(hidden=32, vocab=512, cutoffs=(64, 256),
                            div_val=4),
                  gen_tokens=8, windows=(8, 16), budget_gb=1.0),
}


def word_shape(shape: dict) -> dict:
  """The shape with the word-level hidden size, vocabulary and head."""
  return {**shape, **shape["word"], "zipf": True}


def model_config(shape: dict, stripes: int, grouped=False, head="full",
                 **overrides):
  c = dict(vocab_size=shape["vocab"], embed_size=shape["hidden"],
           hidden_size=shape["hidden"], num_layers=shape["layers"],
           num_stripes=stripes,
           stripe_input="grouped" if grouped else "dense", dropout_embed=0.0,
           dropout_hidden=0.0, dropout_output=0.0, tie_embeddings=True,
           dtype=shape["dtype"], unroll=1, remat=False, head=head,
           recurrence="scan",
           adaptive_cutoffs=tuple(shape.get("cutoffs", ())),
           adaptive_div_val=shape.get("div_val", 1), adaptive_tie=True,
           adaptive_chunk_rows=1024)
  c.update(overrides)
  return ml_collections.ConfigDict(c)


def zipf_probs(vocab: int) -> np.ndarray:
  """p(id) proportional to 1 / (id + 1): word frequencies, ids by rank."""
  p = 1.0 / np.arange(1, vocab + 1)
  return p / p.sum()


def head_flops(shape: dict, head: str, adaptive_input: bool = True) -> float:
  """Forward FLOPs per token of the output head (and, adaptive, of the
  adaptive input's projections), tokens drawn by `zipf_probs`."""
  h, v = shape["hidden"], shape["vocab"]
  if head == "full":
    return 2.0 * h * v
  bounds = asm.cluster_bounds(v, shape["cutoffs"])
  widths = asm.cluster_widths(h, len(bounds), shape["div_val"])
  p = zipf_probs(v)
  flops = 2.0 * h * (bounds[0][1] + len(bounds) - 1)  # shortlist + clusters
  for (start, stop), d in zip(bounds[1:], widths[1:]):
    share = p[start:stop].sum()
    per_row = 2.0 * h * d + 2.0 * d * (stop - start)  # down-projection, logits
    per_row += 2.0 * h * d if adaptive_input else 0.0  # input up-projection
    flops += share * per_row
  return flops


def step_flops(shape: dict, stripes: int, *, grouped: bool = False,
               head: str | None = None, train: bool = True,
               input_grad: bool = True, adaptive_input: bool = True) -> float:
  """FLOPs per token of the matmuls one step runs (see the module docstring).

  head None: no head (core rows). input_grad: whether the first layer's
  input gradient is computed (an embedding needs it; data does not).
  """
  h, n = shape["hidden"], 3 if train else 1
  flops = 0.0
  for layer in range(shape["layers"]):
    split = stripes if grouped and h % stripes == 0 else 1
    projection = 2.0 * h * 4 * h / split
    recurrence = 2.0 * h * 4 * h / stripes
    skipped = train and layer == 0 and not input_grad
    flops += projection * (n - 1 if skipped else n) + recurrence * n
  if head is not None:
    flops += n * head_flops(shape, head, adaptive_input)
  return flops


# ------------------------------------------------------------- JAX steps


def _adam_step(loss_fn, tx):
  """(params, opt_state, *args) -> (params, opt_state, loss); donates state."""
  def step(params, opt_state, *args):
    loss, grads = jax.value_and_grad(loss_fn)(params, *args)
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1))


def _random_split(build):
  """(graphdef, params) of build(), params drawn uniformly in +-0.1.

  Speed does not depend on the values, and the real initializers (orthogonal
  blocks need a QR) take seconds to compile per shape.
  """
  graphdef, shapes = nnx.split(nnx.eval_shape(build))
  leaves, treedef = jax.tree.flatten(shapes)

  @jax.jit
  def draw(key):
    keys = jax.random.split(key, len(leaves))
    return [jax.random.uniform(k, x.shape, x.dtype, -0.1, 0.1)
            for k, x in zip(keys, leaves)]
  return graphdef, jax.tree.unflatten(treedef, draw(jax.random.key(0)))


def _create(cfg):
  return _random_split(lambda: lm.ZebraLM(cfg, rngs=nnx.Rngs(0)))


class _Runner:
  """A compiled step and its live arguments; calling it runs one step.

  feedback maps output positions to the argument they replace next call (the
  donated train state, or the eval carry).
  """

  def __init__(self, jitted, args, feedback: dict[int, int]):
    self.compiled = jitted.lower(*args).compile()
    self.args, self.feedback = list(args), feedback

  def __call__(self):
    out = self.compiled(*self.args)
    for out_index, arg_index in self.feedback.items():
      self.args[arg_index] = out[out_index]
    jax.block_until_ready(out)


def core_runner(shape, stripes, *, seq_len=None, remat=False, custom_vjp=True,
                grouped=False):
  """Stacked ZebraLSTMLayers (no embedding/softmax) + Adam on random inputs.

  custom_vjp=False differentiates the scan with plain autodiff: the row that
  shows what the hand-written backward pass (recurrence.py) buys. grouped:
  block-diagonal input projections, the stripes shuffled between layers as
  the LM does."""
  b, t, h = shape["batch"], seq_len or shape["seq_len"], shape["hidden"]
  dt = lm.compute_dtype(shape["dtype"])
  graphdef, params = _random_split(lambda: nnx.List([
      lm.ZebraLSTMLayer(h, h, stripes, rngs=nnx.Rngs(i), dtype=dt,
                        remat=remat, custom_vjp=custom_vjp, grouped=grouped)
      for i in range(shape["layers"])]))
  x = jax.random.normal(jax.random.key(0), (b, t, h), dt)
  zeros = jnp.zeros((b, h), jnp.float32)

  def loss_fn(params, x):
    y = x
    for i, layer in enumerate(nnx.merge(graphdef, params)):
      with jax.named_scope(f"zebra_lstm_{i}"):
        if i > 0 and grouped:
          y = lm.stripe_shuffle(y, stripes)
        y, _ = layer(y, (zeros, zeros))
    return jnp.sum(jnp.square(y.astype(jnp.float32))) / y.size

  tx = optax.adam(1e-3)
  return _Runner(_adam_step(loss_fn, tx), (params, tx.init(params), x),
                 {0: 0, 1: 1})


def _tokens(shape, seq_len=None, seed=0):
  t = seq_len or shape["seq_len"]
  if shape.get("zipf"):  # the word-level shape: Zipf-distributed ids
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.choice(shape["vocab"], (shape["batch"], t + 1),
                                  p=zipf_probs(shape["vocab"])), jnp.int32)
  return jax.random.randint(jax.random.key(seed), (shape["batch"], t + 1), 0,
                            shape["vocab"])


def word_runner(shape, stripes, *, grouped=False, head="full"):
  """The LM train step at the word-level shape (word_shape), full or
  adaptive head, through lm.token_sums as the training loop runs it."""
  cfg = model_config(shape, stripes, grouped, head)
  graphdef, params = _create(cfg)
  carry = lm.init_carry(cfg, shape["batch"])

  def loss_fn(params, tokens, carry):
    sums, _ = lm.token_sums(graphdef, params, tokens[:, :-1], tokens[:, 1:],
                            carry, with_accuracy=False)
    return sums["loss_sum"] / sums["count"]

  tx = optax.adam(1e-3)
  return _Runner(_adam_step(loss_fn, tx),
                 (params, tx.init(params), _tokens(shape), carry),
                 {0: 0, 1: 1})


def lm_runner(shape, stripes, *, seq_len=None, remat=False, grouped=False):
  """The full LM train step: embedding, layers, tied head, mean CE, Adam."""
  cfg = model_config(shape, stripes, grouped, remat=remat)
  graphdef, params = _create(cfg)
  carry = lm.init_carry(cfg, shape["batch"])
  tokens = _tokens(shape, seq_len)

  def loss_fn(params, tokens, carry):
    logits, _ = lm.apply(graphdef, params, tokens[:, :-1], carry)
    with jax.named_scope("loss"):
      sums = metrics.token_sums(logits, tokens[:, 1:])
    return sums["loss_sum"] / sums["count"]

  tx = optax.adam(1e-3)
  return _Runner(_adam_step(loss_fn, tx),
                 (params, tx.init(params), tokens, carry), {0: 0, 1: 1})


def eval_runner(shape, stripes, grouped=False):
  cfg = model_config(shape, stripes, grouped)
  graphdef, params = _create(cfg)
  tokens = _tokens(shape)
  step = jax.jit(functools.partial(evaluate.eval_step, graphdef=graphdef),
                 donate_argnums=1)
  return _Runner(step, (params, lm.init_carry(cfg, shape["batch"]),
                        tokens[:, :-1], tokens[:, 1:]), {0: 1})


def gen_runner(shape, stripes, batch, grouped=False):
  cfg = model_config(shape, stripes, grouped)
  graphdef, params = _create(cfg)
  step_fn = functools.partial(lm.decode_step, graphdef=graphdef)
  carry = lm.init_carry(cfg, batch)
  logits = jnp.zeros((batch, shape["vocab"]), jnp.float32)
  run = functools.partial(
      sampling.generate, step_fn, params, carry, logits, jax.random.key(0),
      num_new_tokens=shape["gen_tokens"], temperature=1.0)
  jax.block_until_ready(run())  # compiles
  return lambda: jax.block_until_ready(run())


# ----------------------------------------------------------- torch steps

TORCH_GROUPS = ("core", "lm", "eval", "word", "word_adaptive")


def _torch_autocast(torch, device: str, dtype):
  """torch.autocast to `dtype` (None: off). oneDNN's CPU LSTM has no
  bfloat16 kernel on CPUs without AVX512-BF16 and raises when autocast
  hands it one, so on CPUs autocast runs without oneDNN."""
  stack = contextlib.ExitStack()
  if dtype is not None:
    stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
    if device == "cpu":
      stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
  return stack


class TorchTrainer:
  """One torch train step: float32 parameters and float32 Adam state, the
  forward and backward under torch.autocast when autocast_dtype is set,
  which is what JAX's bfloat16 steps do (float32 parameters cast for the
  matmuls)."""

  def __init__(self, torch, params, loss_fn, device, autocast_dtype, sync):
    self.params = list(params)
    self.opt = torch.optim.Adam(self.params, 1e-3)
    self.loss_fn, self.sync = loss_fn, sync
    self.autocast = functools.partial(_torch_autocast, torch, device,
                                      autocast_dtype)

  def __call__(self):
    self.opt.zero_grad(set_to_none=True)
    with self.autocast():
      loss = self.loss_fn("mean")
    loss.backward()
    self.opt.step()
    self.sync()


def torch_steps(shape, groups=TORCH_GROUPS, device="cpu") -> dict:
  """{group: step} of nn.LSTM rows of the same shape (torch imported).

  Modules are float32 everywhere; in bfloat16 they run under
  torch.autocast (TorchTrainer). The core rows' input does not require
  grad, so autograd skips the first layer's input gradient, as JAX does.
  """
  import torch  # pylint: disable=g-import-not-at-top
  autocast_dtype = torch.bfloat16 if shape["dtype"] == "bfloat16" else None
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
    tokens = torch.tensor(np.asarray(_tokens(shape)), dtype=torch.long,
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
    autocast = functools.partial(_torch_autocast, torch, device,
                                 autocast_dtype)

    def ev():
      with torch.no_grad(), autocast():
        loss_fn("sum")
      sync()
    return ev

  build = {"core": lambda: trainer(core_loss()),
           "lm": lambda: trainer(lm_loss(shape)),
           "eval": lambda: evaluator(lm_loss(shape)),
           "word": lambda: trainer(lm_loss(word_shape(shape))),
           "word_adaptive": lambda: trainer(lm_loss(word_shape(shape),
                                                    "adaptive"))}
  return {group: build[group]() for group in groups}


def torch_runners(shape, groups=TORCH_GROUPS) -> tuple[dict, str | None]:
  """({group: {threads: step}}, note) of `torch_steps`; ({}, note) when torch
  is missing.

  On CPU torch runs with 1 thread and with every core, because on small
  shared machines one thread is often faster (its OpenMP threads spin and
  lose more than XLA's pool to other load).
  """
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}, "torch not installed (pip install torch): torch rows skipped"
  cuda = torch.cuda.is_available() and jax.devices()[0].platform == "gpu"
  threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
      else os.cpu_count()
  torch.set_num_threads(threads)
  steps = torch_steps(shape, groups, "cuda" if cuda else "cpu")

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
  if shape["dtype"] == "bfloat16":
    note += ("; float32 weights and Adam state under torch.autocast(bfloat16)"
             " as JAX keeps float32 parameters and computes in bfloat16"
             + ("; autocast runs cuDNN's LSTM in float16 (same tensor-core "
                "rate)" if cuda else ""))
  return fns, note


# ---------------------------------------------------------------- timing


def time_interleaved(fns: dict, rounds: int, calls: int = 1) -> dict:
  """Median seconds per call of each function, rounds interleaved so that
  load from other processes spreads over every row alike. Each function
  runs once untimed first: a first call pays for allocation, autotuning and
  lazy initialisation (cuDNN plans, XLA's GPU autotuner)."""
  for fn in fns.values():
    fn()
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      for _ in range(calls):
        fn()
      times[name].append((time.perf_counter() - start) / calls)
  return {name: float(np.median(t)) for name, t in times.items()}


# Datasheet dense bfloat16 tensor-core FLOP/s by device kind (substrings of
# jax's device_kind, first match wins), shown beside the measured peak.
DATASHEET_BF16 = (("H100 PCIe", 756e12, "H100 PCIe"),
                  ("H100", 989e12, "H100 SXM"), ("H200", 989e12, "H200"),
                  ("A100", 312e12, "A100"))
# FLOP/s no device of the platform reaches: sizes the peak's calls where the
# datasheet does not know the device.
_FLOPS_CEILING = {"gpu": 2.5e15, "cpu": 1e12}
PEAK_CALL_SECONDS = 0.01


def datasheet(device_kind: str) -> tuple[float | None, str]:
  """(dense bf16 FLOP/s, name) from DATASHEET_BF16, (None, "unknown")."""
  for key, flops, name in DATASHEET_BF16:
    if key in device_kind:
      return flops, name
  return None, "unknown"


def peak_reps(flops_per_matmul: float, device_flops: float,
              seconds: float = PEAK_CALL_SECONDS) -> int:
  """Matmuls per timed call so that a call lasts at least `seconds` on a
  device doing `device_flops` (an upper bound: the datasheet), so that
  launch and dispatch costs vanish beside the work."""
  return max(1, int(np.ceil(seconds * device_flops / flops_per_matmul)))


def peak_shapes(shape: dict) -> dict:
  """Matmul shapes [batch, m, k, n] the peak is measured on: a large square
  one and the steps' own (input projection, recurrence, head, grouped)."""
  b, t, h, v = shape["batch"], shape["seq_len"], shape["hidden"], shape["vocab"]
  n = 256 if shape["hidden"] <= 64 else 2048
  shapes = {f"square {n}": (1, n, n, n),
            "input projection": (1, b * t, h, 4 * h),
            "recurrence S=1": (1, b, h, 4 * h),
            "head": (1, b * t, h, v)}
  for s in sorted({*shape["stripes"], *shape["grouped_stripes"]} - {1}):
    shapes[f"recurrence S={s}"] = (s, b, h // s, 4 * h // s)
  for s in shape["grouped_stripes"]:
    shapes[f"grouped projection S={s}"] = (s, b * t, h // s, 4 * h // s)
  return shapes


def matmul_peak(shape: dict, rounds: int) -> tuple[float, dict]:
  """(FLOP/s, {shape name: GFLOP/s}): the best measured matmul of
  `peak_shapes`, each a batched matmul in the compute dtype with float32
  accumulation (as the steps run them), repeated inside one compiled loop
  so that every timed call lasts at least PEAK_CALL_SECONDS even at the
  datasheet's rate (`peak_reps`)."""
  dt = lm.compute_dtype(shape["dtype"])
  device = jax.devices()[0]
  device_flops = (datasheet(device.device_kind)[0]
                  or _FLOPS_CEILING.get(device.platform, 2.5e15))
  fns, flops = {}, {}
  for name, (s, m, k, n) in peak_shapes(shape).items():
    reps = peak_reps(2.0 * s * m * k * n, device_flops)
    if shape["hidden"] <= 64:  # quick: a smoke test
      reps = min(reps, 4)
    a = jnp.full((s, m, k), 0.01, dt)
    w = jnp.full((s, k, n), 0.01, dt)

    @jax.jit
    def loop(a, w, reps=reps):
      # `a` changes sign every iteration: were it loop-invariant, XLA would
      # hoist the matmul out of the loop and time it once for `reps`.
      def body(_, carry):
        a, acc = carry
        return -a, acc + jnp.einsum("smk,skn->smn", a, w,
                                    preferred_element_type=jnp.float32)
      zeros = jnp.zeros((a.shape[0], a.shape[1], w.shape[2]), jnp.float32)
      return jax.lax.fori_loop(0, reps, body, (a, zeros))[1]
    fns[name] = functools.partial(
        lambda f, a, w: jax.block_until_ready(f(a, w)), loop, a, w)
    flops[name] = 2.0 * s * m * k * n * reps
  sec = time_interleaved(fns, rounds)
  per_shape = {name: flops[name] / sec[name] / 1e9 for name in fns}
  return max(per_shape.values()) * 1e9, per_shape


def _trace_rows(trace_dir, runners) -> dict:
  """One profiled call of every JAX row, each under its own step name;
  returns each row's device time by kind of op (`trace_breakdown`)."""
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  for i, (name, fn) in enumerate(runners.items()):
    with jax.profiler.StepTraceAnnotation(name, step_num=i):
      fn()
  jax.profiler.stop_trace()
  return trace_breakdown(trace_dir, list(runners))


# What the ops of a trace do, from their HLO names: matmuls (XLA's own dot
# ops, or the library calls it fuses them into: YNNPACK/XNNPACK/oneDNN on
# CPUs, cuBLAS/Triton GEMMs on GPUs), moves of data (layout copies, the
# per-time-step writes of a scan into its window buffers, concatenations), and
# the rest (elementwise fusions such as the gate math, reductions).
_MATMUL_OPS = ("dot", "ynn", "xnn", "onednn", "cublas", "gemm", "triton_gemm",
               "convolution")
_DATA_MOVES = ("copy", "dynamic-update-slice", "dynamic-slice", "concatenate",
               "transpose", "slice")


def op_kind(hlo_op: str) -> str | None:
  """"matmul", "data movement" or "elementwise & other" for an HLO op name;
  None for loop ops, whose events span their bodies' ops."""
  words = hlo_op.split(".")[0].split("_")
  if words[0] in ("while", "conditional", "call"):
    return None
  if any(w.startswith(_MATMUL_OPS) for w in words):
    return "matmul"
  if any(w in _DATA_MOVES for w in words):
    return "data movement"
  return "elementwise & other"


def trace_breakdown(trace_dir: str, names: list[str]) -> dict:
  """{row: {kind: ms, "ops": count}} from the perfetto trace of _trace_rows:
  the op events (args.hlo_op) inside each row's step annotation."""
  events = profiling.trace_op_events(trace_dir)
  if events is None:
    return {}
  spans = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
           if e.get("name") in names}
  result = {}
  for name, (start, end) in spans.items():
    kinds = {"matmul": 0.0, "data movement": 0.0, "elementwise & other": 0.0}
    ops = 0
    for e in events:
      op = e.get("args", {}).get("hlo_op")
      kind = op_kind(op) if op else None
      if kind and start <= e["ts"] <= end:
        kinds[kind] += e.get("dur", 0) / 1e3
        ops += 1
    result[name] = {**kinds, "ops": ops}
  return result


def row_specs(shape) -> dict:
  """{group: {row: (build, tokens per call, FLOPs per token)}}: build()
  compiles the row's runner, so that a caller compiles a group's rows just
  before timing them (and can time a few rows first)."""
  b, t = shape["batch"], shape["seq_len"]
  word = word_shape(shape)
  first, last = shape["stripes"][0], shape["stripes"][-1]
  grouped = shape["grouped_stripes"]
  lm_rows = [(s, False) for s in shape["lm_stripes"]] + [
      (s, True) for s in grouped]
  suffix = lambda is_grouped: "_grouped" if is_grouped else ""
  core_flops = lambda s, g=False: step_flops(shape, s, grouped=g,
                                             input_grad=False)
  lm_flops = lambda s, g, train=True: step_flops(shape, s, grouped=g,
                                                 head="full", train=train)
  p = functools.partial
  groups = {
      "core": {
          **{f"core_S{s}": (p(core_runner, shape, s), b * t, core_flops(s))
             for s in shape["stripes"]},
          f"core_S{first}_remat": (p(core_runner, shape, first, remat=True),
                                   b * t, core_flops(first)),
          **{f"core_S{s}_grouped": (p(core_runner, shape, s, grouped=True),
                                    b * t, core_flops(s, True))
             for s in grouped},
          **{f"core_S{s}_autodiff": (p(core_runner, shape, s,
                                       custom_vjp=False),
                                     b * t, core_flops(s))
             for s in (first, last)}},
      "lm": {f"lm_S{s}{suffix(g)}": (p(lm_runner, shape, s, grouped=g),
                                     b * t, lm_flops(s, g))
             for s, g in lm_rows},
      "eval": {f"eval_S{s}{suffix(g)}": (p(eval_runner, shape, s, g), b * t,
                                         lm_flops(s, g, train=False))
               for s, g in lm_rows},
      "gen": {f"gen_S{s}{suffix(g)}_b{gb}": (p(gen_runner, shape, s, gb, g),
                                             gb * shape["gen_tokens"],
                                             lm_flops(s, g, train=False))
              for s, g in lm_rows for gb in (1, b)},
  }
  for head in ("full", "adaptive"):
    name = "word" if head == "full" else "word_adaptive"
    groups[name] = {
        f"word_S{s}{suffix(g)}{'' if head == 'full' else '_adaptive'}": (
            p(word_runner, word, s, grouped=g, head=head), b * t,
            step_flops(word, s, grouped=g, head=head))
        for s, g in ((1, False), (last, True))}
  return groups


def torch_flops(shape) -> dict:
  """FLOPs per token of each torch group: nn.LSTM is the S = 1 dense model."""
  word = word_shape(shape)
  return {"core": step_flops(shape, 1, input_grad=False),
          "lm": step_flops(shape, 1, head="full"),
          "eval": step_flops(shape, 1, head="full", train=False),
          "word": step_flops(word, 1, head="full"),
          "word_adaptive": step_flops(word, 1, head="adaptive",
                                      adaptive_input=False)}


def time_group(shape, group, specs, torch_fns, rounds, peak,
               trace_dir=None) -> tuple[list[dict], dict]:
  """(rows, trace breakdown) of one group: its rows compiled, then timed
  interleaved with torch's rows of the group (ratios are against the
  fastest torch thread count); trace_dir: one profiled step of each JAX row
  afterwards, into trace_dir/group."""
  b, t = shape["batch"], shape["seq_len"]
  runners = {name: build() for name, (build, _, _) in specs.items()}
  fns = dict(runners)
  torch_name = f"torch_{group}"
  for threads, fn in torch_fns.get(group, {}).items():
    fns[f"{torch_name}_{threads}t"] = fn
  sec = time_interleaved(fns, rounds)
  torch_secs = {n: v for n, v in sec.items() if n.startswith(torch_name)}
  base = min(torch_secs.values()) if torch_secs else None
  rows = [_row(name, group, sec[name], tokens, flops, peak, base,
               getattr(runners[name], "compiled", None))
          for name, (_, tokens, flops) in specs.items()]
  rows += [_row(name, group, torch_sec, b * t, torch_flops(shape)[group],
                peak, base) for name, torch_sec in torch_secs.items()]
  breakdown = (_trace_rows(os.path.join(trace_dir, group), runners)
               if trace_dir else {})
  return rows, breakdown


def speed_rows(shape, rounds, trace_dir=None):
  """Every timed row, group after group, each group compiled just before
  it is timed."""
  torch_fns, torch_note = torch_runners(shape)
  peak, peak_by_shape = matmul_peak(shape, rounds)
  rows, breakdown = [], {}
  for group, specs in row_specs(shape).items():
    group_rows, group_breakdown = time_group(shape, group, specs, torch_fns,
                                             rounds, peak, trace_dir)
    rows += group_rows
    breakdown.update(group_breakdown)
  return rows, peak, peak_by_shape, torch_note, breakdown


def _row(name, group, sec, tokens, flops, peak, torch_sec, compiled=None):
  gflops = flops * tokens / sec / 1e9
  return {"name": name, "group": group, "tokens_per_s": tokens / sec,
          "ms_per_step": 1e3 * sec,
          "ratio_to_torch": None if torch_sec is None else torch_sec / sec,
          "gflops": gflops, "frac_of_peak": gflops * 1e9 / peak,
          "xla_bytes": profiling.compiled_bytes(compiled) if compiled else None}


# ---------------------------------------------------------------- memory


def _memory_row(shape, seq_len, remat):
  """One LM train step at S=1 for this window: planned and measured peak."""
  runner = lm_runner(shape, 1, seq_len=seq_len, remat=remat)
  runner()
  peak, source = profiling.peak_memory()
  return {"seq_len": seq_len, "remat": remat, "peak_bytes": peak,
          "peak_source": source,
          "xla_bytes": profiling.compiled_bytes(runner.compiled)}


def memory_rows(shape_name, fresh_processes: bool):
  """Peak memory per window, with and without remat; the largest window that
  fits shape['budget_gb'], extrapolated from XLA's plan (linear in window)."""
  shape, rows = SHAPES[shape_name], []
  for remat in (False, True):
    for seq_len in shape["windows"]:
      if fresh_processes:  # peaks only grow: one process per row
        out = subprocess.run(
            [sys.executable, "-m", "zebra_jax.tools.bench",
             f"--shape={shape_name}", f"--memory_row={seq_len},{int(remat)}"],
            capture_output=True, text=True, check=True,
            env={**os.environ, **NO_PREALLOCATE})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
      else:
        rows.append(_memory_row(shape, seq_len, remat))
  budget = shape["budget_gb"] * 2 ** 30
  fits = {}
  for remat in (False, True):
    pts = [(r["seq_len"], r["xla_bytes"]) for r in rows
           if r["remat"] == remat and r["xla_bytes"]]
    if len(pts) >= 2:
      (t0, b0), (t1, b1) = pts[0], pts[-1]
      per_token = (b1 - b0) / (t1 - t0)
      fits[f"remat={remat}"] = int((budget - b0) / per_token + t0) \
          if per_token > 0 else None
  return rows, {"budget_gb": shape["budget_gb"], "max_seq_len": fits}


# ------------------------------------------------------------ reporting


def _mb(x):
  return "-" if x is None else f"{x / 2 ** 20:,.0f} MB"


def peak_text(result) -> str:
  """The best measured matmul beside the datasheet's figure."""
  sheet = result["datasheet_bf16_tflops"]
  return (f"best measured matmul {result['matmul_peak_gflops']:,.0f} GFLOP/s "
          f"({result['config']['dtype']}); datasheet dense bf16 "
          + (f"{sheet:,.0f} TFLOP/s ({result['datasheet']})" if sheet
             else "unknown"))


def print_table(result) -> None:
  print(f"\n{result['device']} | shape {result['shape']} | "
        f"{peak_text(result)} | {result['torch']}")
  print("matmul GFLOP/s by shape: " + ", ".join(
      f"{k} {v:,.0f}" for k, v in result["matmul_gflops_by_shape"].items()))
  print(f"{'row':<28}{'tok/s':>11}{'ms/step':>10}{'x torch':>9}"
        f"{'model GFLOP/s':>14}{'% peak':>8}{'XLA plan':>11}")
  for r in result["rows"]:
    ratio = "-" if r["ratio_to_torch"] is None else f"{r['ratio_to_torch']:.2f}"
    print(f"{r['name']:<28}{r['tokens_per_s']:>11,.0f}{r['ms_per_step']:>10.1f}"
          f"{ratio:>9}{r['gflops']:>14.1f}{100 * r['frac_of_peak']:>7.0f}%"
          f"{_mb(r['xla_bytes']):>11}")
  if result.get("memory"):
    print(f"\nLM step S=1, batch {result['config']['batch']}: peak memory")
    print(f"{'window':>7}{'remat':>7}{'measured peak':>15}{'XLA plan':>11}")
    for m in result["memory"]:
      print(f"{m['seq_len']:>7}{str(m['remat']):>7}{_mb(m['peak_bytes']):>15}"
            f"{_mb(m['xla_bytes']):>11}   ({m['peak_source']})")
    fit = result["max_window"]
    print(f"largest window in {fit['budget_gb']} GB (XLA plan, linear fit): "
          f"{fit['max_seq_len']}")
  if result.get("trace_breakdown"):
    print(f"\ndevice time of one traced step, ms by kind of op "
          f"(trace in {_TRACE.value or 'the trace folder'})")
    kinds = ("matmul", "data movement", "elementwise & other")
    print(f"{'row':<28}" + "".join(f"{k:>21}" for k in kinds) + f"{'ops':>8}")
    for name, b in result["trace_breakdown"].items():
      print(f"{name:<28}" + "".join(f"{b[k]:>21.1f}" for k in kinds)
            + f"{b['ops']:>8}")
  for note in result["notes"]:
    print(f"note: {note}")


def run(quick: bool = False, shape_name: str = "A", json_path=None,
        rounds: int = 0, memory: bool = True, trace_dir=None) -> dict:
  """Runs every row; prints the table; returns (and optionally writes) it."""
  shape = SHAPES["quick" if quick else shape_name]
  rounds = rounds or (3 if quick else 7)
  rows, peak, peak_by_shape, torch_note, breakdown = speed_rows(
      shape, rounds, trace_dir)
  notes = [torch_note] if torch_note else []
  over = [r["name"] for r in rows if r["frac_of_peak"] > 1.0]
  if over:  # nothing is clamped: the peak, not the row, is wrong
    notes.append(f"{', '.join(over)} above the best measured matmul: the "
                 "peak underestimates this machine (load changed while "
                 "timing, or a faster matmul shape exists)")
  sheet, sheet_name = datasheet(jax.devices()[0].device_kind)
  result = {"device": f"{jax.devices()[0].device_kind} x1 "
                      f"({os.cpu_count()} CPU cores visible)",
            "shape": "quick" if quick else shape_name,
            "config": {k: v for k, v in shape.items()},
            "matmul_peak_gflops": peak / 1e9,
            "datasheet_bf16_tflops": sheet and sheet / 1e12,
            "datasheet": sheet_name,
            "matmul_gflops_by_shape": peak_by_shape,
            "torch": torch_note or "-",
            "rows": rows, "notes": notes}
  if breakdown:
    result["trace_breakdown"] = breakdown
  if memory:
    result["memory"], result["max_window"] = memory_rows(
        result["shape"], fresh_processes=not quick)
    if quick:
      notes.append("quick: memory rows share one process, so their peaks "
                   "are cumulative")
  print_table(result)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(result, f, indent=1)
  return result


def main(argv):
  del argv
  # Before JAX starts its backend: the memory rows' processes need the GPU
  # memory this one would otherwise reserve.
  for key, value in NO_PREALLOCATE.items():
    os.environ.setdefault(key, value)
  if _MEMORY_ROW.value:  # child process of memory_rows
    seq_len, remat = (int(v) for v in _MEMORY_ROW.value.split(","))
    print(json.dumps(_memory_row(SHAPES[_SHAPE.value], seq_len, bool(remat))))
    return
  run(_QUICK.value, _SHAPE.value, _JSON.value, _ROUNDS.value, _MEMORY.value,
      _TRACE.value)


if __name__ == "__main__":
  app.run(main)
