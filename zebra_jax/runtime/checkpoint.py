"""Orbax checkpoints in workdir/checkpoints: save, verify, find and restore.

Each step directory holds two items: `state` (params, optimizer state, loss
scale, step, RNG and the LSTM carry, as arrays) and `meta` (JSON: data
position, best validation loss, and a checksum of every array).
Preservation keeps the latest `keep_latest` steps plus the best `keep_best` by
validation loss (orbax's legacy `max_to_keep` with `best_fn` would delete the
latest step and break resuming).

Orbax writes to a temporary directory and renames it when complete, so a
killed save leaves no half-written step; but it cannot tell a flipped bit in
an array file from data. The checksums can: `restore_latest` verifies them and
falls back to the newest step that restores intact, moving corrupt steps aside
(`<step>.corrupt-<time>`) instead of deleting anything.

Checksums and multi-process runs: each array's checksum is a position-weighted
sum of its elements' bit patterns (mod 2^64). Sums over disjoint pieces add
up, so each process sums the shards it is the first replica of, and one
all-gather adds them: replicated parameters are read once, sharded carries by
the process that holds each piece, and the result does not depend on how many
devices or processes saved or restore it. Every weight is odd, so any single
flipped bit changes the sum. All processes see the same gathered checksums
and the same verdict, so they fall back to the same step together.

Strictness: a checkpoint whose meta has `checksums` must cover every array
restored; a missing entry is corruption. A checkpoint without them was written
by an earlier version (before checksums, or with the whole-array CRC32
`digests` of single-process runs): it restores unverified, with a log line.
"""

import contextlib
import logging
import os
import time
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
  """A restored array does not match the checksum written with it."""


def _valid_loss(metrics: dict[str, Any]) -> float:
  return metrics["valid_loss"]


_MASK = (1 << 64) - 1
_MULTIPLIER = np.uint64(2 * 0x9E3779B97F4A7C15 & _MASK)  # weights 2*i*K + 1
_ROWS_PER_CHUNK_ELEMENTS = 1 << 20  # bounds the uint64 temporaries


def _weighted_sum(data: np.ndarray, index: tuple, shape: tuple) -> int:
  """sum_i bits(x_i) * (2 * i * K + 1) mod 2^64 over one piece of an array.

  i is the element's flat index in the whole array of `shape`; `index` (one
  slice per axis) places the piece `data` in it.
  """
  data = np.ascontiguousarray(data)
  bits = data.view(np.dtype(f"u{data.dtype.itemsize}"))
  if not shape:  # a scalar: flat index 0, weight 1
    return int(bits.reshape(-1)[0]) & _MASK
  strides = np.cumprod((shape[1:] + (1,))[::-1])[::-1]  # elements per step
  starts = [s.start or 0 for s in index] if index else [0] * len(shape)
  rest = np.zeros(data.shape[1:], np.uint64)  # flat offset within a row
  for axis in range(1, len(shape)):
    span = np.arange(starts[axis], starts[axis] + data.shape[axis],
                     dtype=np.uint64) * np.uint64(strides[axis])
    rest = rest + span.reshape((-1,) + (1,) * (len(shape) - 1 - axis))
  rows = max(1, _ROWS_PER_CHUNK_ELEMENTS // max(1, rest.size))
  total = 0
  for r in range(0, data.shape[0], rows):
    first = np.arange(starts[0] + r, starts[0] + min(r + rows, data.shape[0]),
                      dtype=np.uint64) * np.uint64(strides[0])
    flat = first.reshape((-1,) + (1,) * (len(shape) - 1)) + rest
    weights = flat * _MULTIPLIER + np.uint64(1)
    piece = bits[r:r + rows].astype(np.uint64)
    total += int(np.sum(piece * weights, dtype=np.uint64))
  return total & _MASK


def _local_sums(tree: Any, leaves: list) -> np.ndarray:
  """uint32 [n_leaves, 4]: (sum lo, sum hi, elements lo, elements hi) of the
  pieces of each array that this process is the first replica of."""
  out = np.zeros((len(leaves), 4), np.uint32)
  if tree is None:
    return out
  for row, leaf in enumerate(jax.tree.leaves(tree)):
    total, count = 0, 0
    if isinstance(leaf, jax.Array):
      for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
          data = np.asarray(shard.data)
          total += _weighted_sum(data, shard.index, leaf.shape)
          count += data.size
    elif jax.process_index() == 0:  # a host value: the same in every process
      data = np.asarray(leaf)
      total, count = _weighted_sum(data, (), data.shape), data.size
    total &= _MASK
    out[row] = (total & 0xFFFFFFFF, total >> 32, count & 0xFFFFFFFF,
                count >> 32)
  return out


def checksums(tree: Any, like: Any = None, prefix: str = "",
              ok: bool = True) -> tuple[dict[str, str], list[int]]:
  """({tree path: "dtype[shape]:sum"}, processes that were not `ok`).

  Collective with several processes: all of them call it with trees of the
  same structure. A process that could not read `tree` passes ok=False (and
  tree=None, `like` giving the structure); the others learn which one failed.
  """
  like = tree if like is None else like
  leaves = jax.tree_util.tree_leaves_with_path(like)
  local = _local_sums(tree if ok else None, leaves)
  local = np.concatenate([local, np.full((1, 4), int(ok), np.uint32)])
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    gathered = np.asarray(multihost_utils.process_allgather(local))
  else:
    gathered = local[None]
  failed = [p for p in range(gathered.shape[0]) if not gathered[p, -1, 0]]
  out = {}
  for row, (path, leaf) in enumerate(leaves):
    parts = gathered[:, row].astype(np.uint64)
    total = sum(int(lo) | int(hi) << 32 for lo, hi, _, _ in parts) & _MASK
    count = sum(int(lo) | int(hi) << 32 for _, _, lo, hi in parts)
    size = int(np.prod(leaf.shape))
    if not failed and count != size:  # a piece nobody summed: a bug, not data
      raise RuntimeError(f"checksum of {jax.tree_util.keystr(path)} covered "
                         f"{count} of {size} elements")
    out[prefix + jax.tree_util.keystr(path)] = (
        f"{np.dtype(leaf.dtype)}{list(leaf.shape)}:{total:016x}")
  return out, failed


def verify(actual: dict[str, str], meta: dict[str, Any],
           log: Callable[[str], None] | None = None) -> None:
  """Raises CorruptCheckpoint naming the first array whose checksum differs
  or is missing; see the module docstring for checkpoints without any."""
  expected = meta.get("checksums")
  if expected is None:
    if log is not None:
      log("this checkpoint predates checksums: restored without verifying it")
    return
  for key, value in actual.items():
    if key not in expected:
      raise CorruptCheckpoint(f"array {key} has no checksum in the checkpoint")
    if expected[key] != value:
      raise CorruptCheckpoint(f"array {key} does not match its checksum")


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
    meta = dict(meta, checksums=checksums(state)[0])  # all processes call it
    with self._reporting_write_errors(self._pending_step):
      self._manager.check_for_errors()  # did the previous async save fail?
    with self._reporting_write_errors(step):
      self._manager.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        meta=ocp.args.JsonSave(meta)),
          metrics=metrics, force=True)
    self._pending_step = step

  def restore(self, step: int, target_state: Any,
              log: Callable[[str], None] | None = None
              ) -> tuple[Any, dict[str, Any]]:
    """Restores into target_state's shapes/dtypes/shardings and verifies it.

    Every process gets the same outcome: a step that one process cannot read
    or verify raises in all of them.
    """
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target_state),
                              meta=ocp.args.JsonRestore())
    state, meta = self._agreed_restore(step, args, lambda r: r.state,
                                       target_state, "", log)
    return state, meta

  def restore_params(self, step: int, target_params: Any) -> Any:
    """Restores only the `params` field of a saved state, verified.

    Reads none of the optimizer state or carry: what inference needs, in a
    third of the memory of a full restore under Adam.
    """
    target = {"params": target_params}
    args = ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item=target, partial_restore=True,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target)),
        meta=ocp.args.JsonRestore())
    params, _ = self._agreed_restore(step, args, lambda r: r.state["params"],
                                     target_params, ".params", None)
    return params

  def _agreed_restore(self, step, args, pick, like, prefix, log):
    """Reads a step, then checksums it in one collective that also tells
    every process whether any other failed to read it."""
    try:
      restored = self._manager.restore(step, args=args)
      tree, meta, error = pick(restored), dict(restored.meta), None
    except Exception as e:  # truncated files, wrong structure
      tree, meta, error = None, None, e
    actual, failed = checksums(tree, like, prefix, ok=error is None)
    if error is not None:
      raise error
    if failed:
      raise CorruptCheckpoint(f"process {failed[0]} could not read it")
    verify(actual, meta, log)
    return tree, meta

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
        state, meta = self.restore(step, target_state, log)
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
    """Process 0 renames the step; then every process re-lists the folder,
    so that all of them may save that step number again."""
    if jax.process_index() == 0:
      src = os.path.join(self.directory, str(step))
      dst = f"{src}.corrupt-{int(time.time())}"
      os.rename(src, dst)
      log(f"moved the unusable checkpoint to {dst}")
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"zebra_jax quarantine {step}")
    self._manager.reload()

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
