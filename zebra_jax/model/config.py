"""The model's settings as one frozen, typed record, and the values they allow.

`ModelConfig.of` is the one place a config's model section (a ConfigDict, a
dict read from config.json) becomes the typed record the model is built from.
The allowed values live here, beside the code that reads them, so config
validation and the model cannot disagree about them.
"""

import dataclasses
from typing import Any, Mapping

DTYPES = ("float32", "bfloat16", "float16")   # compute dtypes; parameters stay float32
HEADS = ("full", "adaptive")                  # softmax heads
STRIPE_INPUTS = ("dense", "grouped")          # how a stripe reads its layer's input
RECURRENCES = ("auto", "scan", "pallas", "pallas_stream",
               "native")                      # the layer's time loop
HEAD_LOGITS_DTYPES = ("float32", "compute")   # the adaptive loss's logits
CPU_BF16_HEADS = ("off", "auto")              # the full head's matmuls on a CPU
CPU_BF16_PROJECTIONS = ("off", "auto")        # a layer's window matmuls on a CPU
CPU_BF16_RECURRENCE = ("off", "auto")         # its time loops' matmuls on a CPU
CPU_FUSED_HEADS = ("off", "auto", "on")       # the tied head's loss on a CPU


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """What builds a ZebraLM; the meaning of every field is in config/base.py."""
  vocab_size: int
  embed_size: int
  hidden_size: int
  num_layers: int
  num_stripes: int
  stripe_input: str
  dropout_embed: float
  dropout_hidden: float
  dropout_output: float
  tie_embeddings: bool
  head: str
  adaptive_cutoffs: tuple[int, ...]
  adaptive_div_val: int
  adaptive_tie: bool
  adaptive_chunk_rows: int
  head_logits_dtype: str
  head_fused_xent: bool
  adaptive_tile: int
  dtype: str
  unroll: int
  remat: bool
  recurrence: str
  cpu_bf16_head: str
  cpu_bf16_projections: str
  cpu_bf16_recurrence: str
  cpu_fused_head: str

  @classmethod
  def of(cls, model: "ModelConfig | Mapping[str, Any]") -> "ModelConfig":
    """The record for a model section; a ModelConfig comes back unchanged.

    Every field must be present: configs start from config/base.py, and a
    workdir's older config.json is completed when it is loaded.
    """
    if isinstance(model, cls):
      return model
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in model]
    if missing:
      raise ValueError(f"model config lacks {', '.join(missing)}: start from "
                       "zebra_jax.config.base.get_config().model")
    values = {n: model[n] for n in names}
    values["adaptive_cutoffs"] = tuple(values["adaptive_cutoffs"])  # JSON: list
    return cls(**values)

  @property
  def stripe_width(self) -> int:
    """Hidden units per stripe."""
    return self.hidden_size // self.num_stripes
