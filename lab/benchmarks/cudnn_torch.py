"""torch nn.LSTM (cuDNN on a GPU) as a baseline of the kernel rows: at
S = 1 one nn.LSTM of width H, at S > 1 S independent nn.LSTMs of width H/S,
stripe s reading its own slice of the input (what a torch user would write
to get stripes from cuDNN).

Precisions: bf16 trains float32 weights and Adam state under
torch.autocast(bfloat16), as JAX keeps float32 parameters and computes in
bfloat16; fp32 turns cuDNN's TF32 off (torch allows it by default), tf32
turns it on.
"""

import contextlib

from lab.benchmarks.torch_reference import TorchTrainer


def train_step(shape, stripes: int, precision: str):
  """A torch train step (TorchTrainer) of S independent nn.LSTMs over
  random inputs that need no gradient, loss the mean square of the
  outputs, as the kernel rows' JAX steps."""
  import torch  # pylint: disable=g-import-not-at-top
  device = "cuda" if torch.cuda.is_available() else "cpu"
  b, t, h = shape["batch"], shape["seq_len"], shape["hidden"]
  g = h // stripes
  torch.manual_seed(0)
  lstms = torch.nn.ModuleList(
      torch.nn.LSTM(g, g, shape["layers"], batch_first=True)
      for _ in range(stripes)).to(device)
  x = torch.randn(b, t, h, device=device)
  tf32 = precision == "tf32"

  def loss_fn(reduction):
    del reduction  # a mean, as the JAX rows' loss
    flags = (torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32)
             if device == "cuda" else contextlib.nullcontext())
    with flags:
      y = torch.cat([lstm(part)[0] for lstm, part in
                     zip(lstms, torch.split(x, g, dim=2))], dim=2)
    return y.float().square().mean()

  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  return TorchTrainer(torch, lstms.parameters(), loss_fn, device,
                      torch.bfloat16 if precision == "bf16" else None, sync)
