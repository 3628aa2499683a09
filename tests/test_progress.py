"""Progress bars: drawn on a terminal, silent when stdout is not a TTY."""

import io

from zebra_jax.runtime import progress


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
