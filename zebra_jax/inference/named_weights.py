"""The parameters as named arrays: model.safetensors and model.json.

params.npz serves the exported functions (flat leaves in tree order); these
files serve a reader with no zebra_jax: every array under a name that says
what it is, and the architecture beside it (docs/python-api.md loads them
with jax alone, and S = 1 layers into torch.nn.LSTM).

  embed               [V, E]            token embedding (head=full, or an
                                        untied adaptive head)
  layers.N.w_x        dense [in, S, 4G] every stripe reads the whole input;
                      grouped [S, in/S, 4G]  stripe s its own slice
  layers.N.u          [S, G, 4G]        stripe s's recurrent block
  layers.N.bias       [S, 4G]           one bias (PyTorch's two, summed)
  head.w              [H, V]            absent when tied to embed
  head.bias           [V]
  adaptive.*          head=adaptive: tables.i [n_i, d_i], projs.j [H, d_j],
                      biases.i [n_i], cluster_w [tails, d_0], cluster_b

Gates are ordered [i | f | g | o] inside each stripe's 4G, as in PyTorch;
G = hidden_size / S.
"""

import os
import re
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from zebra_jax import strict_json
from zebra_jax.model.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE_FILE = "model.json"

# (pattern of the parameter tree's dotted path, the name written)
_RENAMES = ((r"^layers\.(\d+)\.w_h$", r"layers.\1.u"),
            (r"^layers\.(\d+)\.b$", r"layers.\1.bias"),
            (r"^head_w$", "head.w"), (r"^head_b$", "head.bias"),
            (r"^adaptive_softmax\.weights\.", "adaptive."),
            (r"^adaptive_(softmax|input)\.", "adaptive."))


def name_of(path) -> str:
  """A parameter's written name, from its tree path (keys, indices, and
  nnx's trailing `.value`)."""
  keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
          for k in path]
  if keys and keys[-1] == "value":
    keys = keys[:-1]
  dotted = ".".join(keys)
  for pattern, replacement in _RENAMES:
    dotted = re.sub(pattern, replacement, dotted)
  return dotted


def named(params: Any) -> dict[str, np.ndarray]:
  """{name: float32 numpy array} for every parameter."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = name_of(path)
    if name in out:
      raise ValueError(f"two parameters are both named {name!r}")
    out[name] = np.ascontiguousarray(jax.device_get(leaf))
  return out


def from_named(arrays: dict[str, np.ndarray], like: Any) -> Any:
  """The parameter tree `like` (shapes, or arrays) filled from `arrays`."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  return jax.tree.unflatten(treedef, [arrays[name_of(p)] for p, _ in paths])


def architecture(model_cfg) -> dict:
  """What a reader needs to run the arrays: the config's model section,
  and the facts the layers derive from it."""
  m = ModelConfig.of(model_cfg)
  grouped = m.stripe_input == "grouped"
  sizes = [m.embed_size] + [m.hidden_size] * (m.num_layers - 1)
  return {
      "format": 1,
      "vocab_size": m.vocab_size, "embed_size": m.embed_size,
      "hidden_size": m.hidden_size, "num_layers": m.num_layers,
      "num_stripes": m.num_stripes, "stripe_width": m.stripe_width,
      "stripe_input": m.stripe_input,
      # Which layers read their input in stripes (w_x [S, in/S, 4G]); the
      # first reads the embedding densely when S does not divide it.
      "grouped_layers": [grouped and n % m.num_stripes == 0 for n in sizes],
      # Grouped, S > 1: layers after the first read the previous one's
      # outputs shuffled, unit g of stripe s at position g * S + s.
      "shuffle_stripes": grouped and m.num_stripes > 1,
      "gate_order": "ifgo",
      "head": m.head,
      "tied_embeddings": (m.head == "full" and m.tie_embeddings
                          and m.embed_size == m.hidden_size),
      "outputs": "log-probabilities" if m.head == "adaptive" else "logits",
      "model": {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in vars(m).items()},
  }


def write(folder: str, params: Any, model_cfg) -> dict[str, np.ndarray]:
  """Writes model.safetensors and model.json into `folder`; returns the
  arrays written."""
  arrays = named(params)
  save_file(arrays, os.path.join(folder, WEIGHTS_FILE),
            metadata={"format": "zebra_jax", "architecture": ARCHITECTURE_FILE})
  with open(os.path.join(folder, ARCHITECTURE_FILE), "w") as f:
    strict_json.dump(architecture(model_cfg), f, indent=2)
  return arrays
