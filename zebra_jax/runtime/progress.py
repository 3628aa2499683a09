"""Progress bars on a terminal, silence everywhere else.

On a TTY a tqdm bar shows the step, tokens/s, loss and the ETA between the log
lines. Under CI, SLURM or `> file`, stdout is not a TTY and nothing extra is
written: carriage-return redraws would bury the log lines (writer.py prints
those either way) in thousands of partial lines.

  bar = Progress(cfg.train.num_steps, initial_step=step, desc="train")
  bar.update(step, tok_s=14500, loss=1.62)       # absolute step, cheap
  bar.close()

  for window in track(windows, desc="valid"):    # eval / tokenise / generate
    ...

Log lines printed while a bar is open go through `write`, which clears the
bar, prints the line and redraws the bar below it.
"""

import os
import sys
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


class Progress:
  """A training bar over absolute step numbers; a no-op when not enabled.

  Args:
    total_steps: the step the run ends at (train.num_steps).
    initial_step: where a resumed run starts, so the bar and ETA count only
      the steps left.
    enabled: None = on exactly when the output is a TTY. Pass False on every
      process but the first (only process 0 prints).
    desc: the bar's label.
    file: where to draw (default stdout, where the log lines go).
  """

  def __init__(self, total_steps: int, initial_step: int = 0,
               enabled: bool | None = None, desc: str = "train",
               unit: str = "step", file: TextIO | None = None):
    global _open_bars
    self.file = file or sys.stdout
    self.enabled = interactive(self.file) if enabled is None else enabled
    self._bar = None
    if self.enabled:
      from tqdm import tqdm  # imported lazily: only terminals need it
      self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc,
                       unit=unit, file=self.file, dynamic_ncols=True,
                       leave=False, smoothing=0.1)
      _open_bars += 1

  def update(self, step: int, **postfix) -> None:
    """Moves the bar to `step`; postfix shows e.g. tok_s=..., loss=...."""
    if self._bar is None:
      return
    if postfix:
      self._bar.set_postfix({k: _format(v) for k, v in postfix.items()},
                            refresh=False)
    self._bar.update(step - self._bar.n)  # tqdm redraws at most ~10 times/s

  def close(self) -> None:
    global _open_bars
    if self._bar is not None:
      self._bar.close()
      self._bar = None
      _open_bars -= 1

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
