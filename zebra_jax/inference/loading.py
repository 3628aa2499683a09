"""A trained model read back from a workdir: config, tokenizer, data, params.

Inference restores the parameters alone: the optimizer moments (twice the
parameters again under Adam), the training carry and the loss scale stay on
disk, so a model loads in a third of the memory and from any batch size.
"""

import dataclasses
from typing import Any

import jax
import ml_collections
import numpy as np

from zebra_jax.data import pipeline
from zebra_jax.errors import UserError
from zebra_jax.model import lm
from zebra_jax.runtime import checkpoint, distributed, parallel, rundir


@dataclasses.dataclass
class Loaded:
  """A trained model and its data, as read back from a workdir."""
  cfg: ml_collections.ConfigDict
  tokenizer: Any
  splits: dict[str, np.ndarray]
  graphdef: Any
  params: Any
  step: int


def load_for_inference(cfg: ml_collections.ConfigDict, workdir: str,
                       step: int | None = None) -> Loaded:
  """Reads config.json, the tokenizer, data and the best (or given) checkpoint.

  Args:
    cfg: the caller's config; its eval/sample settings and compute dtype win.
    workdir: a trained run directory.
    step: a checkpoint step; None picks the best by validation loss.
  """
  merged = rundir.load_config(cfg, workdir)
  ckpt = checkpoint.Checkpointer(workdir, create=False)
  if step is None:
    step = ckpt.best_step()
  if step is None:
    raise UserError(f"workdir {workdir} has no checkpoint in "
                    f"{ckpt.directory}: train first with --mode=train")
  tokenizer, splits = distributed.process_zero_first(
      lambda: pipeline.load_eval_data(merged, workdir), "loading the data")
  graphdef, abstract_params = lm.abstract(merged.model)
  params = ckpt.restore_params(
      step, parallel.replicated_like(parallel.make_mesh(), abstract_params))
  ckpt.close()
  return Loaded(merged, tokenizer, splits, graphdef, params, step)


def local_replica(params: Any) -> Any:
  """This process's copy of replicated params, on its first local device.

  A multi-process run restores params on the global mesh, where no process
  holds every device's copy (device_put and device_get refuse such arrays);
  each process then takes a copy it holds. Single-device work (sampling,
  scoring, export) needs nothing more.
  """
  def local(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = x.addressable_data(0)  # replicated: any local copy is the whole
    return jax.device_put(x, jax.local_devices()[0])
  return jax.tree.map(local, params)
