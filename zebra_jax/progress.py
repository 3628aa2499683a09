"""Progress bars on a terminal; plain progress lines, or nothing, elsewhere.

On a TTY a tqdm bar shows the step, tokens/s, loss and the ETA between the log
lines. Under CI, SLURM or `> file`, stdout is not a TTY: carriage-return
redraws would bury the log lines (writer.py prints those either way) in
thousands of partial lines. There a Progress given `lines_every_s` prints a
whole line every so many seconds instead, so a long phase without log lines
(tokenizing a corpus, say) is not silent for minutes:

  tokenizing train: 12,582,912/103,227,021 tok (12%) | 1,049,000 tok/s | ETA 1m26s

and one closing line with the total time. Training passes no `lines_every_s`:
its log lines already say how far it is.

  bar = Progress(cfg.train.num_steps, initial_step=step, desc="train")
  bar.update(step, tok_s=14500, loss=1.62)       # absolute step, cheap
  bar.close()

  for window in track(windows, desc="valid"):    # eval / tokenise / generate
    ...

  with Progress(num_tokens, desc="tokenizing train", unit="tok",
                lines_every_s=10) as bar:          # long phases: lines in logs
    for done in ...:
      bar.update(done)                             # tokens done so far

Log lines printed while a bar is open go through `write`, which clears the
bar, prints the line and redraws the bar below it.
"""

import os
import sys
import time
from typing import Iterable, TextIO, TypeVar

T = TypeVar("T")

_open_bars = 0  # write() goes through tqdm only while a bar is drawn


def interactive(file: TextIO | None = None) -> bool:
  """Whether `file` (default stdout) is a terminal that can redraw a bar."""
  file = file or sys.stdout
  isatty = getattr(file, "isatty", None)
  return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"


def _format(value) -> str:
  """Short postfix values: 14523.4 -> '14523', 1.6234 -> '1.62'."""
  if isinstance(value, float):
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
  return str(value)


def _duration(seconds: float) -> str:
  """83 -> '1m23s', 5000 -> '1h23m', 4.2 -> '4s'."""
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  if seconds >= 60:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds}s"


class Progress:
  """A bar over absolute counts (steps, tokens); a no-op when not enabled.

  Args:
    total_steps: the count the phase ends at (train.num_steps, tokens, ...).
    initial_step: where a resumed run starts, so the bar and ETA count only
      the steps left.
    enabled: None = a bar exactly when the output is a TTY. Pass False on
      every process but the first (only process 0 prints): no bar, no lines.
    desc: the bar's label.
    unit: what is counted ("step", "tok").
    file: where to draw (default stdout, where the log lines go).
    lines_every_s: off a TTY (with enabled=None), print a progress line at
      most this often, with the rate and ETA; None = silent off a TTY.
    clock: seconds, monotonic (tests pass a fake one).
  """

  def __init__(self, total_steps: int, initial_step: int = 0,
               enabled: bool | None = None, desc: str = "train",
               unit: str = "step", file: TextIO | None = None,
               lines_every_s: float | None = None, clock=time.monotonic):
    global _open_bars
    self.file = file or sys.stdout
    tty = interactive(self.file)
    self.enabled = tty if enabled is None else enabled
    self._bar = None
    self._total, self._initial, self._desc, self._unit = (
        total_steps, initial_step, desc, unit)
    self._clock = clock
    self._line_every = (lines_every_s if enabled is None and not tty
                        else None)
    self._start = self._last_line = clock()
    self._done, self._lines_printed = initial_step, 0
    if self.enabled:
      from tqdm import tqdm  # imported lazily: only terminals need it
      self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc,
                       unit=unit, file=self.file, dynamic_ncols=True,
                       leave=False, smoothing=0.1)
      _open_bars += 1

  def update(self, step: int, **postfix) -> None:
    """Moves to `step`; postfix shows e.g. tok_s=..., loss=... on a bar."""
    self._done = step
    if self._line_every is not None:
      now = self._clock()
      if now - self._last_line >= self._line_every:
        self._last_line = now
        self._print_line(now)
    if self._bar is None:
      return
    if postfix:
      self._bar.set_postfix({k: _format(v) for k, v in postfix.items()},
                            refresh=False)
    self._bar.update(step - self._bar.n)  # tqdm redraws at most ~10 times/s

  def _print_line(self, now: float) -> None:
    elapsed = max(now - self._start, 1e-9)
    rate = (self._done - self._initial) / elapsed
    line = f"{self._desc}: {self._done:,}"
    if self._total:
      line += (f"/{self._total:,} {self._unit} "
               f"({100 * self._done / self._total:.0f}%)")
    else:
      line += f" {self._unit}"
    line += f" | {rate:,.0f} {self._unit}/s"
    if self._total and rate > 0:
      line += f" | ETA {_duration((self._total - self._done) / rate)}"
    write(line, self.file)
    self._lines_printed += 1

  def close(self) -> None:
    global _open_bars
    if self._bar is not None:
      self._bar.close()
      self._bar = None
      _open_bars -= 1
    if self._lines_printed:  # a phase long enough to report: say it ended
      elapsed = max(self._clock() - self._start, 1e-9)
      count = self._done - self._initial
      write(f"{self._desc}: {count:,} {self._unit} in {_duration(elapsed)} "
            f"({count / elapsed:,.0f} {self._unit}/s)", self.file)
      self._lines_printed = 0

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def track(iterable: Iterable[T], total: int | None = None, desc: str = "",
          enabled: bool | None = None, unit: str = "it",
          file: TextIO | None = None) -> Iterable[T]:
  """Wraps a loop (evaluation windows, tokenising, generation) in a bar.

  Returns the iterable itself, untouched, when not enabled, so a loop costs
  nothing extra under CI or SLURM.
  """
  file = file or sys.stdout
  if not (interactive(file) if enabled is None else enabled):
    return iterable
  return _tracked(iterable, total, desc, unit, file)


def _tracked(iterable, total, desc, unit, file):
  global _open_bars
  from tqdm import tqdm
  _open_bars += 1
  try:
    yield from tqdm(iterable, total=total, desc=desc, unit=unit, file=file,
                    dynamic_ncols=True, leave=False)
  finally:
    _open_bars -= 1


def write(message: str, file: TextIO | None = None) -> None:
  """Prints a log line; above the bar when one is drawn, plainly otherwise."""
  file = file or sys.stdout
  if _open_bars:
    from tqdm import tqdm
    tqdm.write(message, file=file)
    file.flush()
  else:
    print(message, file=file, flush=True)
