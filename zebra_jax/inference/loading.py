"""A trained model read back from a workdir: config, tokenizer, params.

Inference needs the workdir alone: config.json, the tokenizer the model was
trained with (workdir/tokenizer/) and a checkpoint. The corpus is read only
by eval and training, which ask for `Loaded.splits` (read on first use), so
a workdir copied to a machine without its corpus samples, scores, serves and
exports.

Inference restores the parameters alone: the optimizer moments (twice the
parameters again under Adam), the training carry and the loss scale stay on
disk, so a model loads in a third of the memory and from any batch size.
"""

import dataclasses
import os
from typing import Any

import jax
from absl import logging
import ml_collections
import numpy as np

from zebra_jax.data import pipeline, tokenizers
from zebra_jax.errors import UserError
from zebra_jax.model import lm
from zebra_jax.runtime import checkpoint, distributed, parallel, rundir


@dataclasses.dataclass
class Loaded:
  """A trained model, as read back from a workdir."""
  cfg: ml_collections.ConfigDict
  tokenizer: Any
  graphdef: Any
  params: Any
  step: int
  workdir: str | None = None
  _splits: dict[str, np.ndarray] | None = None

  @property
  def splits(self) -> dict[str, np.ndarray]:
    """The corpus' token ids per split, for eval: read (through the data
    pipeline, which needs the corpus or its cache) on first use only."""
    if self._splits is None:
      if self.workdir is None:
        raise ValueError("this model was not loaded from a workdir: no data")
      _, self._splits = distributed.process_zero_first(
          lambda: pipeline.load_eval_data(self.cfg, self.workdir),
          "loading the data")
    return self._splits


def load_tokenizer(workdir: str):
  """The tokenizer saved in workdir/tokenizer/ by training."""
  folder = os.path.join(workdir, "tokenizer")
  if not tokenizers.has_saved(folder):
    raise UserError(f"workdir {workdir!r} has no tokenizer ({folder} holds "
                    "none): train first with --mode=train and this "
                    "--workdir")
  return tokenizers.load(folder)


def load_for_inference(cfg: ml_collections.ConfigDict, workdir: str,
                       step: int | None = None) -> Loaded:
  """Reads config.json, the tokenizer and the best (or given) checkpoint;
  never the corpus (see `Loaded.splits`).

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
  tokenizer = load_tokenizer(workdir)
  graphdef, abstract_params = lm.abstract(merged.model)
  params = ckpt.restore_params(
      step, parallel.replicated_like(parallel.make_mesh(), abstract_params))
  ckpt.close()
  return Loaded(merged, tokenizer, graphdef, params, step, workdir)


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


@dataclasses.dataclass
class Placement:
  """Where inference runs a loaded model: its params, placed, and the
  mesh every model function takes (`mesh=`; None: one device)."""
  params: Any
  mesh: Any
  devices: int


def placement(loaded: Loaded) -> Placement:
  """The run's layout for sampling, scoring and serving.

  parallel.stripe_devices = N > 1: the model's layers run split over N of
  this process's devices (a 1 x N mesh, so any batch size fits), each
  device holding its stripes' parameters, as in training: a model trained
  split over N GPUs because it did not fit one is served the same way.
  Otherwise, or with fewer local devices than N (a laptop), one device runs
  it: replicated params would repeat every step on every device.
  """
  params = local_replica(loaded.params)
  n = int(loaded.cfg.parallel.stripe_devices)
  if n > 1 and len(jax.local_devices()) < n:
    logging.warning("parallel.stripe_devices=%d but this process has %d "
                    "device(s): the model runs on one device", n,
                    len(jax.local_devices()))
  if n <= 1 or len(jax.local_devices()) < n:
    return Placement(params, None, 1)
  mesh = parallel.make_mesh(jax.local_devices()[:n], stripe_devices=n)
  params = jax.device_put(params, parallel.param_shardings(mesh, params))
  return Placement(params, mesh, n)
