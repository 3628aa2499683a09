"""PyTorch's examples/word_language_model, its defaults, under a time budget.

Written here from the example's data.py, model.py and main.py with its
defaults: --model LSTM --emsize 200 --nhid 200 --nlayers 2 --lr 20 --clip
0.25 --batch_size 20 --bptt 35 --dropout 0.2 --tied, evaluation batch 10.
What it does, as the example does it:
  data    Corpus: each line's whitespace words + <eos>, a dictionary over the
          three files; batchify into `bsz` contiguous columns
  model   Embedding -> Dropout -> nn.LSTM(dropout between layers) ->
          Dropout -> Linear tied to the embedding -> log_softmax, NLLLoss;
          the embedding and decoder uniform(-0.1, 0.1), decoder bias 0
  train   per window: repackage (detach) the hidden state, zero_grad,
          backward, clip_grad_norm_(0.25), p -= lr * grad (no torch.optim)
  epochs  evaluate valid after each; lr /= 4 when it did not improve

The budget: `seconds` of training, clocked around the training windows
only. The epoch-end evaluations that drive the lr rule run outside it (the
zebra_jax side has none inside its budget), so the reference pays nothing
for its schedule. Training stops at the first window past the budget; then
valid is scored once more with the final weights.
"""

import os
import time

import numpy as np

from lab.benchmarks.torch_reference import torch_autocast

EOS = "<eos>"
DEFAULTS = dict(emsize=200, nhid=200, nlayers=2, lr=20.0, clip=0.25,
                batch_size=20, bptt=35, dropout=0.2, eval_batch_size=10)


class Corpus:
  """The example's data.Corpus: one dictionary over train, valid, test."""

  def __init__(self, folder: str, files: dict[str, str]):
    self.word2idx: dict[str, int] = {}
    self.ids = {split: self._tokenize(os.path.join(folder, file))
                for split, file in files.items()}

  def _tokenize(self, path: str) -> np.ndarray:
    ids = []
    with open(path, encoding="utf8") as f:
      for line in f:
        for word in line.split() + [EOS]:
          ids.append(self.word2idx.setdefault(word, len(self.word2idx)))
    return np.asarray(ids, np.int64)


def batchify(torch, ids: np.ndarray, bsz: int):
  """[n] -> [n // bsz, bsz]: column j is the j-th contiguous stream."""
  nbatch = len(ids) // bsz
  return torch.from_numpy(ids[:nbatch * bsz]).view(bsz, -1).t().contiguous()


def get_batch(source, i: int, bptt: int):
  seq_len = min(bptt, len(source) - 1 - i)
  return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def make_model(torch, ntoken: int, p: dict):
  nn = torch.nn

  class RNNModel(nn.Module):
    """The example's RNNModel, LSTM and tied."""

    def __init__(self):
      super().__init__()
      self.drop = nn.Dropout(p["dropout"])
      self.encoder = nn.Embedding(ntoken, p["emsize"])
      self.rnn = nn.LSTM(p["emsize"], p["nhid"], p["nlayers"],
                         dropout=p["dropout"])
      self.decoder = nn.Linear(p["nhid"], ntoken)
      self.decoder.weight = self.encoder.weight
      nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
      nn.init.zeros_(self.decoder.bias)
      nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens, hidden):
      emb = self.drop(self.encoder(tokens))
      output, hidden = self.rnn(emb, hidden)
      decoded = self.decoder(self.drop(output)).view(-1, ntoken)
      return torch.nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
      w = next(self.parameters())
      return (w.new_zeros(p["nlayers"], bsz, p["nhid"]),
              w.new_zeros(p["nlayers"], bsz, p["nhid"]))

  return RNNModel()


def evaluate(torch, model, source, p: dict) -> float:
  """The example's evaluate(): mean NLL over every target of source."""
  model.eval()
  criterion = torch.nn.NLLLoss()
  total = 0.0
  hidden = model.init_hidden(source.size(1))
  with torch.no_grad():
    for i in range(0, source.size(0) - 1, p["bptt"]):
      data, targets = get_batch(source, i, p["bptt"])
      output, hidden = model(data, hidden)
      total += len(data) * criterion(output, targets).item()
  return total / (len(source) - 1)


def train_for(torch, corpus: Corpus, seconds: float, threads: int,
              seed: int = 0, p: dict | None = None,
              autocast_bf16: bool = False) -> dict:
  """The example's main loop until `seconds` of training have run.
  autocast_bf16: its forward and loss under torch.autocast(bfloat16)
  (float32 weights and updates; evaluation in float32), torch's own way to
  multiply in bf16 on a CPU."""
  p = {**DEFAULTS, **(p or {})}
  torch.set_num_threads(threads)
  torch.manual_seed(seed)
  ntoken = len(corpus.word2idx)
  train = batchify(torch, corpus.ids["train"], p["batch_size"])
  valid = batchify(torch, corpus.ids["valid"], p["eval_batch_size"])
  model = make_model(torch, ntoken, p)
  criterion = torch.nn.NLLLoss()
  lr, best, anneals, epochs = p["lr"], None, [], 0
  trained, steps, tokens = 0.0, 0, 0
  load_before = os.getloadavg()[0]
  while trained < seconds:
    model.train()
    hidden = model.init_hidden(p["batch_size"])
    for i in range(0, train.size(0) - 1, p["bptt"]):
      start = time.perf_counter()
      data, targets = get_batch(train, i, p["bptt"])
      model.zero_grad()
      hidden = tuple(h.detach() for h in hidden)  # repackage_hidden
      with torch_autocast(torch, "cpu",
                          torch.bfloat16 if autocast_bf16 else None):
        output, hidden = model(data, hidden)
        loss = criterion(output.float(), targets)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), p["clip"])
      for param in model.parameters():
        param.data.add_(param.grad, alpha=-lr)
      trained += time.perf_counter() - start
      steps, tokens = steps + 1, tokens + targets.numel()
      if trained >= seconds:
        break
    else:  # a whole epoch: the example's lr rule
      epochs += 1
      val_loss = evaluate(torch, model, valid, p)
      if best is None or val_loss < best:
        best = val_loss
      else:
        lr /= 4.0
        anneals.append(epochs)
  load_after = os.getloadavg()[0]
  valid_loss = evaluate(torch, model, valid, p)
  return {"name": "torch_example", "side": "torch",
          "autocast_bf16": autocast_bf16, "seconds": trained,
          "steps": steps, "tokens": tokens, "tokens_per_s": tokens / trained,
          "valid_loss": valid_loss, "valid_ppl": float(np.exp(valid_loss)),
          "epochs": steps / -(-(train.size(0) - 1) // p["bptt"]),
          "lr_final": lr, "anneal_epochs": anneals, "threads": threads,
          "load_before": load_before, "load_after": load_after,
          "vocab_size": ntoken}
