"""The README's Modes block, run as written on demo:tiny, in order.

Each command must exit 0, in a fresh folder, with `--config=demo` read as
`--config=demo:tiny` (the same code path in seconds). The serve command
runs in the background until /health answers, then gets SIGTERM, which
drains and exits 0. So the block's order is tested too: a command that reads
a workdir only a later line trains fails here.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests import docs_commands

README = os.path.join(docs_commands.REPO, "README.md")


def modes_block() -> list[str]:
  """The logical lines of the first shell block under "## Modes"."""
  with open(README, encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("\n## Modes\n"):]
  section = section[:section.index("\n## ", 1)]
  first, body = next(docs_commands.shell_blocks(section))
  return [line for _, line in docs_commands.logical_lines(first, body)]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen, seconds: float) -> None:
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    assert server.poll() is None, server.communicate()[1][-2000:]
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                  timeout=2) as answer:
        if answer.status == 200:
          return
    except OSError:
      time.sleep(0.5)
  raise AssertionError(f"no /health answer in {seconds} s")


@pytest.mark.slow
def test_the_modes_block_runs_in_order(tmp_path):
  lines = modes_block()
  assert any("--mode=serve" in line for line in lines)
  env = {**os.environ,
         "PATH": os.path.dirname(sys.executable) + os.pathsep +
                 os.environ.get("PATH", "")}
  assignments = []
  for line in lines:
    line = re.sub(r"--config=demo(?![:\w])", "--config=demo:tiny", line)
    if re.match(r"^[A-Za-z_]\w*=", line):
      assignments.append(line)
      continue
    script = "\n".join([*assignments, f"exec {line}"])
    if "--mode=serve" in line:
      port = _free_port()
      script = re.sub(r"--port=\d+", f"--port={port}", script)
      server = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
      try:
        _wait_healthy(port, server, 60)
      finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
      assert server.returncode == 0, (line, err[-2000:])
      continue
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (line, done.stderr[-2000:])
  assert (tmp_path / "runs/demo/curves.png").is_file()
  assert (tmp_path / "runs/demo/export").is_dir()
