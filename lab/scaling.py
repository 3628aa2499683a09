"""The scaling model: bytes, seconds and memory per device.

lab/notes/scaling-model.md gives its tables and reads them.

Arithmetic on paper, not a measurement. Parameter counts come from the model
itself (`lm.abstract`, no memory allocated); everything else is the formula
beside it, its assumptions named in lab/notes/scaling-model.md.
`python -m lab.scaling` prints the tables of that page.
"""

import argparse
import functools

import jax

from zebra_jax.model import lm
from zebra_jax.model.config import ModelConfig

NVLINK = 450e9      # bytes/s one way per H100 (900 GB/s both ways together)
INFINIBAND = 50e9   # bytes/s one way: one 400 Gb/s port per GPU
GPU_FLOPS = 300e12  # matmul FLOP/s reached: ~30% of the H100's 989 bf16
RECURRENCE_S = 0.010  # the step's sequential time loops, whatever the GPU count
GPU_MEMORY = 80e9
PER_NODE = 8        # GPUs per node: the stripe axis stays inside one


def wt103_model(hidden: int = 2048, stripe_input: str | None = None,
                **fields) -> ModelConfig:
  """The WikiText-103 recipe's model, at another hidden size if asked."""
  from zebra_jax.configs import wt103  # pylint: disable=g-import-not-at-top
  cfg = wt103.get_config()
  cfg.model.update(vocab_size=267_735, hidden_size=hidden, embed_size=hidden,
                   **fields)
  if stripe_input:
    cfg.model.stripe_input = stripe_input
  return ModelConfig.of(cfg.model)


@functools.lru_cache(maxsize=None)
def param_counts(model: ModelConfig) -> tuple[int, int]:
  """(ZebraLSTM layers' parameters, all others: embedding and head)."""
  _, params = lm.abstract(model)
  size = lambda t: sum(x.size for x in jax.tree.leaves(t))
  layers = size(params["layers"])
  return layers, size(params) - layers


def flops_per_token(model: ModelConfig) -> tuple[float, float]:
  """(LSTM, head) matmul FLOPs per trained token, forward x 3 for backward.

  The adaptive head counts its shortlist (first cluster + cluster logits)
  for every token; the tail clusters, run only for rare words, are left out.
  """
  h, s = model.hidden_size, model.num_stripes
  g = h // s
  grouped = model.stripe_input == "grouped"
  layer = 2 * h * 4 * h / (s if grouped else 1) + 2 * g * 4 * h
  shortlist = model.adaptive_cutoffs[0] + len(model.adaptive_cutoffs)
  head = 2 * h * (shortlist if model.head == "adaptive" else model.vocab_size)
  return 3 * model.num_layers * layer, 3 * head


def _ring(n: int, nbytes: float, reduce: bool) -> float:
  """Bytes one device sends in a ring all-gather / reduce-scatter (reduce=
  False) or all-reduce (True) of an array of `nbytes`."""
  return (2 if reduce else 1) * (n - 1) / n * nbytes


def sent_per_step(model: ModelConfig, batch: int, window: int, data: int,
                  stripe: int, act_bytes: int = 2) -> dict[str, float]:
  """Bytes one device sends per step, as the compiled step moves them
  (tests/runtime/test_stripe_parallel.py reads the same collectives):

    stripe  activations inside a data group: the embedded window gathered
            for the first layer, the layer exchanges, the last window
            re-laid out by rows for the head; each forward and transposed;
    data    the layers' gradient, this device's share, over "data";
    mesh    the embedding's and head's gradient, summed once over every
            device (they run data-parallel over the whole mesh).
  """
  lstm, other = param_counts(model)
  rows = batch // data  # one data group's rows: what its stripe devices share
  window_bytes = rows * window * model.hidden_size * act_bytes
  embedded = rows * window * model.embed_size * 4  # float32 lookups
  p = stripe
  grouped = model.stripe_input == "grouped"
  # forward + backward: all-to-all (each device's share), or all-gather and
  # reduce-scatter (the whole window)
  both = lambda nbytes, a2a: 2 * _ring(p, nbytes / p if a2a else nbytes, False)
  boundary = both(window_bytes, grouped and
                  (model.hidden_size // model.num_stripes) % p == 0)
  first = both(embedded, grouped and model.embed_size % model.num_stripes == 0)
  stripe_bytes = ((model.num_layers - 1) * boundary + first
                  + both(window_bytes, True)) if p > 1 else 0.0
  # Gradients in float32.
  data_bytes = _ring(data, 4 * lstm / p, True) if data > 1 else 0.0
  mesh_bytes = _ring(data * p, 4 * other, True)
  return {"data": data_bytes, "stripe": stripe_bytes, "mesh": mesh_bytes}


def _all_reduce_seconds(sent: float, devices: int, per_node: int) -> float:
  """An all-reduce over `devices` that sends `sent` bytes per device in one
  ring: on NVLink inside a node; across nodes hierarchical (NCCL): inside
  the node on NVLink, then each GPU's 1/per_node across nodes on its own
  InfiniBand port."""
  if sent == 0 or devices <= per_node:
    return sent / NVLINK
  full = sent / (2 * (devices - 1) / devices)  # the array's bytes
  nodes = devices // per_node
  return (_ring(per_node, full, True) / NVLINK
          + _ring(nodes, full / per_node, True) / INFINIBAND)


def comm_seconds(sent: dict[str, float], data: int, stripe: int) -> float:
  """The stripe axis stays inside a node (NVLink). The data axis holds
  PER_NODE / stripe devices a node; the head's all-reduce spans the mesh."""
  in_node = max(1, PER_NODE // stripe)
  return (sent["stripe"] / NVLINK
          + _all_reduce_seconds(sent["data"], data, in_node)
          + _all_reduce_seconds(sent["mesh"], data * stripe, PER_NODE))


def step_seconds(model, batch, window, data, stripe,
                 recurrence: float = RECURRENCE_S,
                 overlap: bool = False) -> dict[str, float]:
  """Compute (the LSTM and the head both spread over every device), the
  recurrence's fixed latency, and communication: not overlapped (an upper
  bound), or with overlap=True hidden behind compute as far as compute
  lasts (a lower bound: the layer exchanges cannot hide, the next layer
  waits for them; the gradient all-reduces can, under XLA's GPU scheduler)."""
  lstm, head = flops_per_token(model)
  compute = batch * window * (lstm + head) / (data * stripe) / GPU_FLOPS
  comm = comm_seconds(sent_per_step(model, batch, window, data, stripe),
                      data, stripe)
  exposed = max(0.0, comm - compute) if overlap else comm
  return {"compute": compute, "recurrence": recurrence, "comm": comm,
          "exposed_comm": exposed, "total": compute + recurrence + exposed}


def efficiency(model, batch, window, data, stripe,
               recurrence: float = RECURRENCE_S, overlap: bool = False
               ) -> float:
  """Strong-scaling efficiency: one GPU's step time over (GPUs x this
  mesh's), at the same global batch."""
  one = step_seconds(model, batch, window, 1, 1, recurrence, overlap)["total"]
  many = step_seconds(model, batch, window, data, stripe, recurrence, overlap)
  return one / (data * stripe * many["total"])


def recurrence_for(target: float, model, batch, window, data, stripe,
                   overlap: bool = False) -> float | None:
  """The longest recurrence latency (seconds) at which the mesh still
  reaches `target` efficiency; None if not even zero does. The latency adds
  to both step times: (one + r) / (n (many + r)) >= target, solved for r."""
  one = step_seconds(model, batch, window, 1, 1, 0.0, overlap)["total"]
  many = step_seconds(model, batch, window, data, stripe, 0.0,
                      overlap)["total"]
  k = target * data * stripe
  r = (one - k * many) / (k - 1)
  return r if r >= 0 else None


def dependent_steps(model, window: int) -> int:
  """Time steps that must run one after another in a train step: each
  layer's forward scan and its reverse scan (remat recomputes the gates for
  the whole window at once, outside any scan)."""
  return 2 * model.num_layers * window


def memory_bytes(model: ModelConfig, rows: int, window: int, stripe: int,
                 remat: bool, act_bytes: int = 2) -> float:
  """One device's training memory: float32 parameters, gradients and Adam's
  two moments (16 bytes a parameter), its stripes' share of the LSTM's, plus
  what the backward pass keeps per layer, row and step (recurrence.py:
  gates, c_t and h_{t-1} in float32, 2G with remat, 6G without; the layer's
  input and output in the compute dtype). The head's activations (chunked)
  and XLA's temporaries are left out."""
  lstm, other = param_counts(model)
  h = model.hidden_size
  kept = (2 if remat else 6) * h / stripe * 4 + (h + h / stripe) * act_bytes
  acts = model.num_layers * rows * window * kept
  return 16 * (lstm / stripe + other) + acts


def largest_hidden(rows: int, window: int, stripe: int, remat: bool,
                   step: int = 256) -> int:
  """The largest hidden size (a multiple of `step`, 8 stripes) whose
  training memory fits one GPU."""
  h = step
  while memory_bytes(wt103_model(h + step), rows, window, stripe,
                     remat) <= GPU_MEMORY:
    h += step
  return h


MESHES = ((1, 1), (8, 1), (1, 8), (64, 1), (8, 8))  # (data, stripe)


def main(argv=None):
  """Prints the tables; takes no arguments but --help (what it prints)."""
  argparse.ArgumentParser(
      prog="python -m lab.scaling",
      description=__doc__.split("\n\n")[0] + ": prints the tables of "
      "lab/notes/scaling-model.md.").parse_args(argv)
  gb, ms = 1e9, 1e3
  print("| model (LSTM + embedding/head params) | data x stripe | sent "
        "(data, stripe, mesh) | comm | compute | step | efficiency |")
  print("|---|---|---|---|---|---|---|")
  for hidden in (2048, 4096, 8192):
    for si in ("dense", "grouped"):
      m = wt103_model(hidden, si)
      lstm, other = param_counts(m)
      name = f"{hidden} {si} ({lstm / 1e6:.0f}M + {other / 1e6:.0f}M)"
      for data, stripe in MESHES:
        sent = sent_per_step(m, 128, 128, data, stripe)
        t = step_seconds(m, 128, 128, data, stripe)
        print(f"| {name} | {data}x{stripe} | {sent['data'] / gb:.3f}, "
              f"{sent['stripe'] / gb:.3f}, {sent['mesh'] / gb:.3f} | "
              f"{t['comm'] * ms:.2f} | {t['compute'] * ms:.2f} | "
              f"{t['total'] * ms:.1f} | "
              f"{efficiency(m, 128, 128, data, stripe):.0%} |")
        name = ""
  m = wt103_model()
  print("recipe at 8 GPUs: efficiency by recurrence latency (ms)")
  for r in (0.010, 0.0025, 0.0):
    print(f"  {r * ms:g} ms: data 8x1 {efficiency(m, 128, 128, 8, 1, r):.0%},"
          f" stripe 1x8 {efficiency(m, 128, 128, 1, 8, r):.0%}")
  steps = dependent_steps(m, 128)
  for overlap in (False, True):
    print("communication " + ("hidden behind compute" if overlap
                              else "not overlapped") +
          f" ({steps} dependent time steps a train step):")
    for data, stripe in ((8, 1), (1, 8)):
      for target in (0.9, 0.5):
        r = recurrence_for(target, m, 128, 128, data, stripe, overlap)
        print(f"  {data}x{stripe} reaches {target:.0%} with a recurrence of "
              + ("no length: not even 0 ms" if r is None
                 else f"at most {r * ms:.2f} ms "
                 f"({r / steps * 1e6:.2f} us a dependent step)"))
  for remat in (False, True):
    for stripe in (1, 8):
      h = largest_hidden(16, 128, stripe, remat)
      lstm, other = param_counts(wt103_model(h))
      print(f"remat={remat} stripe over {stripe}: hidden {h}, "
            f"{(lstm + other) / 1e9:.2f}B parameters, "
            f"{memory_bytes(wt103_model(h), 16, 128, stripe, remat) / gb:.1f}"
            f" GB")


if __name__ == "__main__":
  main()
