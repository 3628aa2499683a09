"""Orbax checkpoints in workdir/checkpoints: save, verify, find and restore.

Each step directory holds two items: `state` (params, optimizer state, loss
scale, step, RNG and the LSTM carry, as arrays) and `meta` (JSON: data
position, best validation loss, and a CRC32 digest of every array).
Preservation keeps the latest `keep_latest` steps plus the best `keep_best` by
validation loss (orbax's legacy `max_to_keep` with `best_fn` would delete the
latest step and break resuming).

Orbax writes to a temporary directory and renames it when complete, so a
killed save leaves no half-written step; but it cannot tell a flipped byte in
an array file from data. The digests can: `restore_latest` verifies them and
falls back to the newest step that restores intact, moving corrupt steps aside
(`<step>.corrupt`) instead of deleting anything.
"""

import contextlib
import logging
import os
import time
import zlib
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from zebra_jax.errors import UserError

_policies = ocp.checkpoint_managers


class _QuietOrbax(logging.Filter):
  """Drops orbax log records that this module reports better itself.

  Saves between evaluations carry no metrics by design (orbax warns each
  time), and every failed save or restore is raised again by `save`, `wait`
  or `restore` and reported in one line, so orbax's own error logs (with
  background-thread tracebacks) only repeat it.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if "did not provide metrics" in message:
      return False
    return not ("/orbax/" in record.pathname and record.levelno >= logging.ERROR)


logging.getLogger("absl").addFilter(_QuietOrbax())


class CorruptCheckpoint(Exception):
  """A restored array does not match the digest written with it."""


def _valid_loss(metrics: dict[str, Any]) -> float:
  return metrics["valid_loss"]


def digests(state: Any) -> dict[str, str]:
  """CRC32 of every array this process holds in full, keyed by its tree path."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      continue  # another host holds part of it; orbax checks its shape
    array = np.ascontiguousarray(jax.device_get(leaf))
    out[jax.tree_util.keystr(path)] = (
        f"{array.dtype}{list(array.shape)}:{zlib.crc32(array.data):08x}")
  return out


def verify(state: Any, expected: dict[str, str]) -> None:
  """Raises CorruptCheckpoint naming the first array whose digest differs."""
  for key, digest in digests(state).items():
    if key in expected and expected[key] != digest:
      raise CorruptCheckpoint(f"array {key} does not match its digest")


class Checkpointer:
  """A thin wrapper over `ocp.CheckpointManager` for the train state + metadata."""

  def __init__(self, workdir: str, keep_latest: int = 2, keep_best: int = 1,
               *, create: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    options = ocp.CheckpointManagerOptions(
        preservation_policy=_policies.AnyPreservationPolicy([
            _policies.LatestN(keep_latest),
            _policies.BestN(get_metric_fn=_valid_loss, reverse=True,
                            n=keep_best,
                            keep_checkpoints_without_metrics=False),
        ]),
        best_fn=_valid_loss, best_mode="min",  # only so best_step() works
        cleanup_tmp_directories=True,  # leftovers of killed saves
        create=create)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "meta"))
    self._pending_step = None

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def best_step(self) -> int | None:
    """The step with the lowest validation loss, else the latest step."""
    try:
      best = self._manager.best_step()
    except Exception:  # Checkpoints saved without metrics (e.g. preemption).
      best = None
    return best if best is not None else self.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any],
           valid_loss: float | None = None) -> None:
    """Starts an async save; arrays are copied off the devices before it returns.

    A failed write (a full disk, say) raises UserError; the previous
    checkpoint is untouched because orbax only renames complete steps.
    """
    metrics = {"valid_loss": float(valid_loss)} if valid_loss is not None else None
    meta = dict(meta, digests=digests(state))
    with self._reporting_write_errors(self._pending_step):
      self._manager.check_for_errors()  # did the previous async save fail?
    with self._reporting_write_errors(step):
      self._manager.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        meta=ocp.args.JsonSave(meta)),
          metrics=metrics, force=True)
    self._pending_step = step

  def restore(self, step: int, target_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores into target_state's shapes/dtypes/shardings and verifies it."""
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target_state),
                                      meta=ocp.args.JsonRestore()))
    meta = dict(restored.meta)
    verify(restored.state, meta.get("digests", {}))
    return restored.state, meta

  def restore_params(self, step: int, target_params: Any) -> Any:
    """Restores only the `params` field of a saved state, verified.

    Reads none of the optimizer state or carry: what inference needs, in a
    third of the memory of a full restore under Adam.
    """
    target = {"params": target_params}
    restored = self._manager.restore(
        step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target, partial_restore=True,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target)),
            meta=ocp.args.JsonRestore()))
    params = restored.state["params"]
    expected = dict(restored.meta).get("digests", {})
    verify(params, {k[len(".params"):]: v for k, v in expected.items()
                    if k.startswith(".params")})
    return params

  def restore_latest(self, target_state: Any,
                     log: Callable[[str], None] = print):
    """(step, state, meta) from the newest intact step, or None if none exist.

    A step that fails to read or verify is reported in one line and skipped;
    once an older step restores, the broken newer ones are moved aside so that
    new saves can reuse their step numbers. If no step restores, the first
    error is raised as a UserError (the checkpoints stay where they are).
    """
    broken, first_error = [], None
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(step, target_state)
      except Exception as e:  # truncated files, bad digests, wrong structure
        reason = str(e).strip().splitlines()[0][:200] if str(e) else type(e).__name__
        log(f"checkpoint at step {step} is unusable ({reason}); trying an "
            f"older one")
        broken.append(step)
        first_error = first_error or reason
        continue
      for bad in broken:
        self._quarantine(bad, log)
      return step, state, meta
    if broken:
      raise UserError(
          f"no checkpoint in {self.directory} could be restored ({first_error}):"
          f" resume with the config that wrote them, or use a new --workdir")
    return None

  def _quarantine(self, step: int, log: Callable[[str], None]) -> None:
    if jax.process_index() != 0:
      return
    src = os.path.join(self.directory, str(step))
    dst = f"{src}.corrupt-{int(time.time())}"
    os.rename(src, dst)
    self._manager.reload()
    log(f"moved the unusable checkpoint to {dst}")

  def wait(self) -> None:
    with self._reporting_write_errors(self._pending_step):
      self._manager.wait_until_finished()

  def close(self) -> None:
    self.wait()
    self._manager.close()

  def abandon(self) -> None:
    """On the way out after an error: finish in-flight saves, ignore their errors."""
    try:  # not close(): after a failed write its teardown only adds noise
      self._manager.wait_until_finished()
    except Exception:  # the error being raised already says what went wrong
      pass

  @contextlib.contextmanager
  def _reporting_write_errors(self, step):
    """Turns a failed write into one line that says what survived."""
    try:
      yield
    except (OSError, ValueError, RuntimeError) as e:
      reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
      previous = [s for s in self.all_steps() if s != step]
      kept = (f"the previous checkpoint (step {previous[-1]}) is intact"
              if previous else "no earlier checkpoint exists")
      raise UserError(
          f"could not write checkpoint step {step} to {self.directory} "
          f"({reason}): "
          f"free disk space or point --workdir elsewhere, then rerun to "
          f"resume; {kept}") from e
