"""Progress bars: drawn on a terminal, silent when stdout is not a TTY."""

import io

from zebra_jax import progress


class _FakeTTY(io.StringIO):
  """A terminal for tests: a buffer that says it is a TTY."""

  def isatty(self):
    return True


def test_off_when_stdout_is_not_a_tty(capsys):
  # Under pytest, stdout is captured (a file, not a terminal), as in CI/SLURM.
  bar = progress.Progress(100, initial_step=10)
  assert not bar.enabled
  for step in range(11, 101):
    bar.update(step, tok_s=14523.4, loss=1.62)
  bar.close()
  assert list(progress.track(range(3), desc="valid")) == [0, 1, 2]
  progress.write("| epoch 1 step 100 | loss 1.62")
  out, err = capsys.readouterr()
  assert out == "| epoch 1 step 100 | loss 1.62\n"  # the log line and nothing else
  assert err == ""


def test_off_for_a_plain_file_and_a_dumb_terminal(monkeypatch):
  assert not progress.interactive(io.StringIO())
  monkeypatch.setenv("TERM", "dumb")
  assert not progress.interactive(_FakeTTY())


def test_track_returns_the_iterable_itself_when_off():
  items = [1, 2, 3]
  assert progress.track(items, file=io.StringIO()) is items


def test_bar_on_a_tty_shows_step_rate_loss(monkeypatch):
  monkeypatch.setenv("TERM", "xterm")
  tty = _FakeTTY()
  with progress.Progress(50, initial_step=0, file=tty) as bar:
    assert bar.enabled
    bar.update(50, tok_s=14523.4, loss=1.6234)
    progress.write("| log line", file=tty)
  text = tty.getvalue()
  assert "50/50" in text and "loss=1.62" in text and "tok_s=14523" in text
  assert "| log line" in text


def test_enabled_false_wins_over_a_tty(monkeypatch):
  monkeypatch.setenv("TERM", "xterm")
  tty = _FakeTTY()
  bar = progress.Progress(10, enabled=False, file=tty)  # process_index > 0
  bar.update(5, loss=1.0)
  bar.close()
  assert tty.getvalue() == ""


class _Clock:
  """Seconds that advance only when the test says so."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_lines_off_a_tty_every_few_seconds_with_rate_and_eta():
  out, clock = io.StringIO(), _Clock()
  bar = progress.Progress(1_000_000, desc="tokenizing train", unit="tok",
                          file=out, lines_every_s=10, clock=clock)
  assert not bar.enabled  # no bar: a plain file
  for second in range(1, 31):  # 25,000 tokens a second for 30 s
    clock.now = float(second)
    bar.update(25_000 * second)
  bar.close()
  lines = out.getvalue().splitlines()
  assert lines == [
      "tokenizing train: 250,000/1,000,000 tok (25%) | 25,000 tok/s | ETA 30s",
      "tokenizing train: 500,000/1,000,000 tok (50%) | 25,000 tok/s | ETA 20s",
      "tokenizing train: 750,000/1,000,000 tok (75%) | 25,000 tok/s | ETA 10s",
      "tokenizing train: 750,000 tok in 30s (25,000 tok/s)"]


def test_no_lines_for_a_short_phase_other_processes_or_by_default():
  for kwargs in ({"lines_every_s": 10},                    # done in 3 s
                 {"lines_every_s": 10, "enabled": False},  # process_index > 0
                 {}):                                      # training: silent
    out, clock = io.StringIO(), _Clock()
    bar = progress.Progress(100, file=out, clock=clock, **kwargs)
    for second in range(1, 4 if len(kwargs) == 1 else 60):
      clock.now = float(second)
      bar.update(second)
    bar.close()
    assert out.getvalue() == "", kwargs


def test_lines_count_only_the_work_left_after_a_resume():
  out, clock = io.StringIO(), _Clock()
  bar = progress.Progress(4000, initial_step=1000, unit="step", desc="train",
                          file=out, lines_every_s=5, clock=clock)
  clock.now = 5.0
  bar.update(1500)  # 100 steps/s since the resume, 2500 to go
  assert out.getvalue() == ("train: 1,500/4,000 step (38%) | 100 step/s | "
                            "ETA 25s\n")
  assert progress._duration(5000) == "1h23m"
  assert progress._duration(83) == "1m23s"
