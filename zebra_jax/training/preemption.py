"""Stop at a step boundary when the job is told to, in every process at once.

SIGTERM (schedulers, SLURM's --signal) or SIGINT (Ctrl-C) set a flag; the
train loop polls it after a step, saves a checkpoint, waits for it and exits
0. A second signal while saving only repeats the request, so it cannot
interrupt a write half-way.

With several processes a signal may reach only one of them, and each has its
own clock; a process that stopped alone would leave the others waiting in the
next all-reduce. So every process polls at the same steps and the decision
is agreed: one all-gather of a small code per process (bit 0 SIGINT, bit 1
SIGTERM, bit 2 out of time). The time budget is process 0's clock alone, so
there is one answer to "is time up". Every process then stops at the same
step, with the same reason.

How a train run ended is its exit status, for launchers (launch/slurm.sbatch)
that must not parse logs: 0 when it reached train.num_steps (or its time
budget), EXIT_STOPPED_EARLY when a signal stopped it before that after saving
a checkpoint to resume from, 2 for a usage error, anything else a crash.
"""

import signal
import threading

import jax
import numpy as np

_SIGNAL_BITS = {"SIGINT": 1, "SIGTERM": 2}
_OUT_OF_TIME = 4

# sysexits.h's EX_TEMPFAIL ("try again later"): saved, not finished; rerun
# the same command (or requeue the job) to continue.
EXIT_STOPPED_EARLY = 75


def exit_status(stopped_early: bool) -> int:
  """The train command's exit status (0 or EXIT_STOPPED_EARLY).

  With several processes it returns only once every process has got here,
  after the checkpoint and the last metrics line are written: srun
  --kill-on-bad-exit kills a task's peers as soon as one exits non-zero, and
  must not cut them short.
  """
  if not stopped_early:
    return 0
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("zebra_jax: stopped early")
  return EXIT_STOPPED_EARLY


class StopRequest:
  """A context manager that turns SIGTERM/SIGINT into a polled, agreed flag.

  Installs its own SIGTERM handler in multi-process runs too, replacing the
  notifier jax.distributed installs: the agreement below covers both signals
  and the time budget in one collective.
  """

  def __init__(self):
    self._event = threading.Event()
    self.signal_name = None
    self.reason = None
    self.senders: list[int] = []  # processes that received the signal
    self._previous = {}
    self._depth = 0

  def _handler(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    self._event.set()

  def __enter__(self):
    """Installs the handlers; entering again while installed changes nothing."""
    self._depth += 1
    if self._depth == 1 and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._previous[sig] = signal.signal(sig, self._handler)
    return self

  def __exit__(self, *exc):
    self._depth -= 1
    if self._depth == 0:
      for sig, previous in self._previous.items():
        signal.signal(sig, previous)
      self._previous = {}
    return False

  def poll(self, step: int, out_of_time: bool = False) -> str | None:
    """Why to stop after `step` ("SIGTERM", "SIGINT", "time budget"), or None.

    Collective with several processes: every process calls it at the same
    steps and gets the same answer. `out_of_time` counts from process 0 only.
    """
    del step  # every process polls at the same steps; the step is implied
    code = _SIGNAL_BITS.get(self.signal_name, 0) if self._event.is_set() else 0
    if out_of_time and jax.process_index() == 0:
      code |= _OUT_OF_TIME
    codes = [code]
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      codes = np.asarray(multihost_utils.process_allgather(
          np.asarray(code, np.int32))).reshape(-1).tolist()
    combined = 0
    for c in codes:
      combined |= int(c)
    if combined & _SIGNAL_BITS["SIGTERM"]:
      self.reason = "SIGTERM"
    elif combined & _SIGNAL_BITS["SIGINT"]:
      self.reason = "SIGINT"
    elif combined & _OUT_OF_TIME:
      self.reason = "time budget"
    else:
      return None
    self.senders = [p for p, c in enumerate(codes) if int(c) & 3]
    return self.reason
