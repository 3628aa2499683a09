"""Stop at a step boundary when the job is told to: SIGTERM (schedulers, SLURM's
--signal) or SIGINT (Ctrl-C) set a flag; the train loop sees it after the step
in flight, saves a checkpoint, waits for it and exits 0. A second signal while
saving only repeats the request, so it cannot interrupt a write half-way.

Multi-process runs also ask JAX's preemption sync point, so that every process
stops at the same step (jax.distributed installs its own SIGTERM notifier).
"""

import signal
import threading

import jax


class StopRequest:
  """A context manager that turns SIGTERM/SIGINT into a polled flag."""

  def __init__(self):
    self._event = threading.Event()
    self.signal_name = None
    self._previous = {}

  def _handler(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    self._event.set()

  def __enter__(self):
    signals = [signal.SIGINT]
    if jax.process_count() == 1:  # multi-process: jax's notifier owns SIGTERM
      signals.append(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
      for sig in signals:
        self._previous[sig] = signal.signal(sig, self._handler)
    return self

  def __exit__(self, *exc):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    return False

  def should_stop(self, step: int) -> bool:
    """True once a stop was requested (agreed across processes when several)."""
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = self.signal_name or "SIGTERM"
        return True
    return self._event.is_set()
