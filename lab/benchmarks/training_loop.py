"""End to end: the real training loop against a PyTorch loop of the same recipe.

Run by `python -m lab.train_bench`.

What a user compares: tokens per second of a whole training run, data
pipeline, optimizer and logging included, not of an isolated step.

Shapes (2 layers, batch 32, window 64, float32, embedded corpus):
  A     hidden 512, characters (the corpus's own vocabulary, ~100 symbols)
  word  hidden 256, words, the 16,384 most frequent (the rest <unk>)

JAX side: `training.loop.run`, the code `--mode=train` runs, on the base config
(or --config) with the shape's fields set, for warmup + steps steps. No
evaluation, sample or checkpoint happens before the last step (the loop's
closing evaluation and save come after it). Each log line writes a
metrics.jsonl record after fetching the window's metrics from the device, so
the record's clock is a synchronised point. The time between the records at
step `warmup` and at step `warmup + steps` is the timed part: exactly `steps`
steps of the loop (batching, the jitted step, the progress bar, the log
lines) and no compilation. The log interval divides both counts and puts two
log lines in the warm-up: the first step compiles the step.

PyTorch side: embedding, nn.LSTM, the full softmax head tied to the embedding
(or not, as the config says) with a bias, the same dropouts, cross-entropy,
global-norm clipping and Adam (or AdamW/SGD) with the JAX run's learning rate
for every step (linear warm-up, cosine decay). Truncated BPTT: the carried
(h, c) is detached after each window and reset where the loop resets it. The
batches come from the same batcher over the same token ids (each row reports
a hash of the train ids it read), and the loop fetches the mean loss at the
same log steps (the JAX loop also writes metrics.jsonl and TensorBoard
there). It runs warmup + steps steps; the timed part is the same `steps`
steps after the same warm-up. On CPU it runs once on 1 thread and once on
every core, and the faster is the reference (on small shared machines one
thread often wins). nn.LSTM is the classic LSTM, so every stripe setting is
compared with the same torch rows.

Each row reports the 1-minute load average before and after it: a loaded
machine slows every row, so compare ratios from one run.
"""

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from typing import Sequence

import jax
import ml_collections
import numpy as np

from lab.benchmarks.table import (load_column, print_and_save, print_rows,
                                 speed_columns)
from zebra_jax.data import pipeline
from zebra_jax.errors import UserError

SHAPES = {
    "A": dict(tokenizer="char", hidden=512, layers=2, batch=32, seq_len=64,
              steps=60, warmup=20),
    "word": dict(tokenizer="word", max_vocab_size=16384, hidden=256,
                 layers=2, batch=32, seq_len=64, steps=60, warmup=20),
    "quick": dict(tokenizer="char", hidden=32, layers=2, batch=8, seq_len=16,
                  steps=6, warmup=4),
}


def log_interval(warmup: int, steps: int) -> int:
  """The longest log interval dividing warmup and steps with two log lines
  in the warm-up (see the module docstring)."""
  common = math.gcd(warmup, steps)
  fits = [d for d in range(1, common + 1)
          if common % d == 0 and warmup // d >= 2]
  if not fits:
    raise UserError(f"--warmup={warmup} is too short: the warm-up needs at "
                    "least 2 steps (compilation, then the first log line)")
  return max(fits)


def train_config(base: ml_collections.ConfigDict, shape: dict, stripes: int,
                 stripe_input: str, steps: int,
                 warmup: int) -> ml_collections.ConfigDict:
  """`base` with the shape's data and model, and a schedule that keeps
  evaluation, samples and checkpoints after the last timed step."""
  cfg = ml_collections.ConfigDict(base.to_dict())
  num_steps = warmup + steps
  cfg.data.update(source="embedded", tokenizer=shape["tokenizer"],
                  batching="streams", batch_size=shape["batch"],
                  seq_len=shape["seq_len"])
  if "max_vocab_size" in shape:
    cfg.data.update(max_vocab_size=shape["max_vocab_size"], min_freq=1)
  cfg.model.update(vocab_size=0, embed_size=shape["hidden"],
                   hidden_size=shape["hidden"], num_layers=shape["layers"],
                   num_stripes=stripes, head="full")
  cfg.model.stripe_input = stripe_input
  cfg.train.update(num_steps=num_steps, time_budget_minutes=0.0,
                   log_every=log_interval(warmup, steps),
                   eval_every=num_steps + 1, eval_max_batches=1,
                   sample_at_eval=False, grad_accum_steps=1)
  cfg.checkpoint.every_steps = num_steps + 1
  cfg.profile.num_steps = 0
  return cfg


def ids_fingerprint(ids: np.ndarray) -> str:
  """A short hash of a token id array: equal on both sides = same data."""
  return hashlib.sha1(np.ascontiguousarray(ids, np.int32).tobytes()).hexdigest(
  )[:16]


def _row(name: str, side: str, seconds: float, steps: int, tokens: int,
         load_before: float, load_after: float, **extra) -> dict:
  return {"name": name, "side": side, "tokens_per_s": tokens / seconds,
          "ms_per_step": 1e3 * seconds / steps, "seconds": seconds,
          "steps": steps, "tokens": tokens, "ratio_to_torch": None,
          "load_before": load_before, "load_after": load_after, **extra}


# ------------------------------------------------------------- JAX side


def _train_records(workdir: str) -> dict[int, dict]:
  """step -> the train record of WORKDIR/metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r for r in records if r["kind"] == "train"}


def time_jax_loop(cfg: ml_collections.ConfigDict, warmup: int,
                  steps: int) -> dict:
  """One `loop.run` in a scratch workdir; its timed part, as a row."""
  from zebra_jax.training import loop  # pylint: disable=g-import-not-at-top
  name = (f"jax_S{cfg.model.num_stripes}_"
          f"{cfg.model.stripe_input}")
  with tempfile.TemporaryDirectory(prefix="train_bench_") as workdir:
    load_before = os.getloadavg()[0]
    loop.run(cfg, workdir)
    load_after = os.getloadavg()[0]
    records = _train_records(workdir)
    data = ids_fingerprint(pipeline.prepare_data(cfg, workdir)[1]["train"])
  start, stop = records.get(warmup), records.get(warmup + steps)
  if start is None or stop is None:
    raise RuntimeError(f"no train records at steps {warmup} and "
                       f"{warmup + steps}: logged {sorted(records)}")
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  timed = [r for s, r in records.items() if warmup < s <= warmup + steps]
  counted = stop["step"] - start["step"]
  return _row(name, "jax", stop["time"] - start["time"], counted,
              counted * tokens_per_step, load_before, load_after,
              stripes=cfg.model.num_stripes, train_ids_sha1=data,
              logged_tok_per_s=[r["tok_per_s"] for r in timed],
              final_loss=stop["loss"])


# ----------------------------------------------------------- torch side


def _torch_model(torch, cfg: ml_collections.ConfigDict):
  """Embedding -> nn.LSTM -> (tied) head, with the config's dropouts."""
  m = cfg.model
  nn = torch.nn

  class LM(nn.Module):

    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(m.vocab_size, m.embed_size)
      nn.init.uniform_(self.embed.weight, -0.1, 0.1)
      self.drop_embed = nn.Dropout(m.dropout_embed)
      self.lstm = nn.LSTM(m.embed_size, m.hidden_size, m.num_layers,
                          batch_first=True,
                          dropout=m.dropout_hidden if m.num_layers > 1 else 0)
      self.drop_out = nn.Dropout(m.dropout_output)
      self.tied = m.tie_embeddings and m.embed_size == m.hidden_size
      if not self.tied:
        self.head_w = nn.Parameter(torch.empty(m.vocab_size, m.hidden_size))
        nn.init.uniform_(self.head_w, -m.hidden_size ** -0.5,
                         m.hidden_size ** -0.5)
      self.head_b = nn.Parameter(torch.zeros(m.vocab_size))

    def forward(self, tokens, state):
      # tokens [B, T] -> logits [B, T, V], (h, c) each [L, B, H]
      y, state = self.lstm(self.drop_embed(self.embed(tokens)), state)
      w = self.embed.weight if self.tied else self.head_w
      return self.drop_out(y) @ w.T + self.head_b, state

  return LM()


def _torch_optimizer(torch, params, optim: ml_collections.ConfigDict):
  if optim.name == "adam":
    return torch.optim.Adam(params, optim.learning_rate,
                            betas=(optim.b1, optim.b2), eps=optim.eps)
  if optim.name == "adamw":
    return torch.optim.AdamW(params, optim.learning_rate,
                             betas=(optim.b1, optim.b2), eps=optim.eps,
                             weight_decay=optim.weight_decay)
  if optim.name == "sgd":
    return torch.optim.SGD(params, optim.learning_rate,
                           momentum=optim.momentum)
  raise UserError(f"optim.name={optim.name!r} has no PyTorch counterpart "
                  "here: use --config.optim.name=adam")


def time_torch_loop(torch, cfg: ml_collections.ConfigDict, ids: np.ndarray,
                    warmup: int, steps: int, threads: int | None) -> dict:
  """The PyTorch loop over the train ids; its timed part, as a row.

  threads None: the GPU (cuDNN); else the CPU with this many threads.
  """
  from zebra_jax.training import optim  # pylint: disable=g-import-not-at-top
  device = "cpu" if threads else "cuda"
  dtype = {"float32": None, "bfloat16": torch.bfloat16,
           "float16": torch.float16}[cfg.model.dtype]
  torch.manual_seed(cfg.seed)
  model = _torch_model(torch, cfg).to(device).train()
  params = list(model.parameters())
  opt = _torch_optimizer(torch, params, cfg.optim)
  num_steps = warmup + steps
  lr_at = optim.learning_rate_schedule(cfg.optim, cfg.train.num_steps)
  lrs = np.asarray(lr_at(np.arange(num_steps)), np.float64).tolist()
  batcher = pipeline.make_batcher(cfg.data, ids, cfg.seed)
  random_windows = cfg.data.batching == "random"
  log_every, clip = cfg.train.log_every, cfg.optim.clip_norm
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  position, state, window, logged = pipeline.DataPosition(), None, [], []
  tokens = 0
  start = load_before = None
  for step in range(num_steps):
    if step == warmup:
      sync()
      load_before, start, tokens = os.getloadavg()[0], time.perf_counter(), 0
    inputs, targets = batcher.get(position.index, position.epoch)
    x = torch.from_numpy(inputs).to(device, torch.long)
    y = torch.from_numpy(targets).to(device, torch.long)
    if random_windows or position.index == 0:
      state = None  # zero (h, c) at the start of the streams
    for group in opt.param_groups:
      group["lr"] = lrs[step]
    with (torch.autocast(device, dtype) if dtype else
          contextlib.nullcontext()):
      logits, state = model(x, state)
    loss = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip > 0:
      torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    state = tuple(s.detach() for s in state)  # truncated BPTT
    window.append(loss.detach())
    tokens += y.numel()
    position = position.advance(batcher.batches_per_epoch)
    if (step + 1) % log_every == 0:  # what the loop's log line fetches
      logged.append(torch.stack(window).mean().item())
      window = []
  sync()
  seconds = time.perf_counter() - start
  name = f"torch_{threads}t" if threads else "torch_cuda"
  return _row(name, "torch", seconds, steps, tokens, load_before,
              os.getloadavg()[0], threads=threads, final_loss=logged[-1],
              train_ids_sha1=ids_fingerprint(ids))


def train_ids(cfg: ml_collections.ConfigDict) -> tuple[int, np.ndarray]:
  """(vocab size, train split ids): what the loop's data pipeline reads."""
  with tempfile.TemporaryDirectory(prefix="train_bench_") as workdir:
    tokenizer, splits = pipeline.prepare_data(cfg, workdir)
    return tokenizer.vocab_size, np.array(splits["train"])


def torch_rows(cfg: ml_collections.ConfigDict, vocab_size: int,
               ids: np.ndarray, warmup: int, steps: int,
               one_thread: bool = False):
  """([rows], note): one row per thread count, or ([], why) without torch.

  one_thread: only the 1-thread row (a smoke test: with other load, every
  core's threads can spin for seconds per step)."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return [], "torch not installed (pip install torch): torch rows missing"
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.model.vocab_size = vocab_size
  cuda = torch.cuda.is_available() and jax.devices()[0].platform == "gpu"
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count())
  counts = [None] if cuda else [1] if one_thread else sorted({1, cores})
  before = torch.get_num_threads()
  rows = []
  try:
    for threads in counts:
      if threads:
        torch.set_num_threads(threads)
      rows.append(time_torch_loop(torch, cfg, ids, warmup, steps, threads))
  finally:
    torch.set_num_threads(before)
  where = ("cuDNN" if cuda else "CPU, 1 thread" if one_thread else
           f"CPU, 1 and {cores} threads, the faster kept")
  return rows, f"torch {torch.__version__} ({where})"


# ---------------------------------------------------------------- driver


def run(base: ml_collections.ConfigDict, shape_name: str = "A",
        stripes: Sequence[int] = (1, 8), stripe_input: str = "dense",
        steps: int = 0, warmup: int = 0, json_path: str | None = None) -> dict:
  """Every JAX row, then the torch rows; prints the table, returns it."""
  shape = SHAPES[shape_name]
  steps, warmup = steps or shape["steps"], warmup or shape["warmup"]
  if steps < 1:
    raise UserError(f"--steps={steps}: time at least 1 step")
  configs = [train_config(base, shape, s, stripe_input, steps, warmup)
             for s in stripes]
  vocab_size, ids = train_ids(configs[0])
  with contextlib.redirect_stdout(sys.stderr):  # the loop's log: stderr
    rows = [time_jax_loop(cfg, warmup, steps) for cfg in configs]
  torch_side, note = torch_rows(configs[0], vocab_size, ids, warmup, steps,
                                one_thread=shape_name == "quick")
  notes = [note]
  if torch_side:
    best = min(r["seconds"] for r in torch_side)
    for r in rows + torch_side:
      r["ratio_to_torch"] = best / r["seconds"]
  if base.model.dtype != "float32":
    notes.append(f"model.dtype={base.model.dtype}: float32 parameters on both "
                 "sides, torch under autocast")
  result = {
      "device": f"{jax.devices()[0].device_kind} x{jax.device_count()} "
                f"({os.cpu_count()} CPU cores visible)",
      "shape": shape_name, "config": {**shape, "steps": steps,
                                      "warmup": warmup,
                                      "stripe_input": stripe_input},
      "vocab_size": vocab_size, "rows": rows + torch_side,
      "torch": note if torch_side else None, "notes": notes}
  return print_and_save(result, print_table, json_path)


def print_table(result: dict) -> None:
  c = result["config"]
  print(f"\ntraining loop, end to end | {result['device']} | shape "
        f"{result['shape']}: {c['tokenizer']} vocab {result['vocab_size']:,}, "
        f"hidden {c['hidden']} x {c['layers']} layers, batch {c['batch']}, "
        f"window {c['seq_len']} | {c['steps']} steps timed after "
        f"{c['warmup']} warm-up")
  print_rows(result["rows"], speed_columns(18, 10) + [
      ("tokens", 10, lambda r: f"{r['tokens']:,}"), load_column()])
  for note in result["notes"]:
    print(f"note: {note}")
