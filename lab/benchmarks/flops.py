"""Model FLOPs per token, counted analytically from a shape.

The matmuls each step runs: input projection 2*in*4H (grouped: /S),
recurrence 2*H*4H/S, head 2*H*V (adaptive: the shortlist, and each tail for
the share of tokens it holds). A train step runs each three times (forward,
weight gradient, input gradient), except the first layer's input gradient
where nothing needs it. Remat's recomputed matmuls are not counted.
"""

from lab.benchmarks.shapes import word_shape, zipf_probs
from zebra_jax.model import adaptive_softmax as asm

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
  """FLOPs per token of the matmuls one step runs (see this module's docstring).

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


def torch_flops(shape) -> dict:
  """FLOPs per token of each torch group: nn.LSTM is the S = 1 dense model."""
  word = word_shape(shape)
  return {"core": step_flops(shape, 1, input_grad=False),
          "lm": step_flops(shape, 1, head="full"),
          "eval": step_flops(shape, 1, head="full", train=False),
          "word": step_flops(word, 1, head="full"),
          "word_adaptive": step_flops(word, 1, head="adaptive",
                                      adaptive_input=False),
          "head": head_step_flops(shape, "full"),
          "head_adaptive": head_step_flops(word, "adaptive")}


def head_step_flops(shape: dict, head: str) -> float:
  """FLOPs per token of the head alone, forward and backward (its input's
  gradient included); the adaptive input's projections are not counted."""
  return 3 * head_flops(shape, head, adaptive_input=False)
