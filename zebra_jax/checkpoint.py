"""Orbax checkpoints in workdir/checkpoints: save, find the latest or best, restore.

Each step directory holds two items: `state` (params, optimizer state, step, RNG
and the LSTM carry, as arrays) and `meta` (JSON: data position, validation loss,
wall time). Preservation keeps the latest `keep_latest` steps plus the best
`keep_best` by validation loss (orbax's legacy `max_to_keep` with `best_fn`
would delete the latest step and break resuming).
"""

import logging
import os
from typing import Any

import orbax.checkpoint as ocp

_policies = ocp.checkpoint_managers


class _QuietMissingMetrics(logging.Filter):
  """Saves between evaluations carry no metrics by design; orbax warns each time."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietMissingMetrics())


def _valid_loss(metrics: dict[str, Any]) -> float:
  return metrics["valid_loss"]


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
        create=create)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "meta"))

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
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any],
           valid_loss: float | None = None) -> None:
    """Starts an async save; arrays are copied off the devices before it returns."""
    metrics = {"valid_loss": float(valid_loss)} if valid_loss is not None else None
    self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      meta=ocp.args.JsonSave(meta)),
        metrics=metrics, force=True)

  def restore(self, step: int, target_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores into the shapes, dtypes and shardings of `target_state`."""
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target_state),
                                      meta=ocp.args.JsonRestore()))
    return restored.state, dict(restored.meta)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
