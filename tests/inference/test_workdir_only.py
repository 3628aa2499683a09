"""A trained workdir whose corpus is gone samples, scores, serves and
exports: inference reads config.json, workdir/tokenizer/ and a checkpoint."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest

from zebra_jax.configs import demo
from zebra_jax.training import loop
from tests.helpers import REPO

pytestmark = pytest.mark.slow


def _cli(workdir, *args, timeout=300):
  return subprocess.run(
      [sys.executable, "-m", "zebra_jax.main", f"--workdir={workdir}", *args],
      capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _serve_one(workdir, body) -> dict:
  """Starts --mode=serve, sends one /generate, stops it with Ctrl-C."""
  server = subprocess.Popen(
      [sys.executable, "-m", "zebra_jax.main", f"--workdir={workdir}",
       "--mode=serve", "--port=0"], stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, cwd=REPO)
  try:
    lines = []
    for line in server.stdout:  # ends if the server exits
      lines.append(line)
      found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
      if found:
        break
    assert found, "".join(lines)
    request = urllib.request.Request(
        f"http://127.0.0.1:{found.group(1)}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
      return json.load(reply)
  finally:
    server.send_signal(signal.SIGINT)
    try:
      server.wait(timeout=60)
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait(timeout=60)


@pytest.mark.slow
def test_a_workdir_without_its_corpus_samples_scores_serves_exports(
    tmp_path):
  corpus = tmp_path / "story.txt"
  corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the "
                            "lazy dog.\n" for i in range(200)))
  cfg = demo.get_config("tiny")
  cfg.data.source, cfg.data.path = "text", str(corpus)
  cfg.train.update(num_steps=4, eval_every=1000, sample_at_eval=False)
  cfg.checkpoint.every_steps = 4
  workdir = tmp_path / "run"
  loop.run(cfg, str(workdir))
  shutil.move(corpus, tmp_path / "elsewhere.txt")  # the corpus is gone
  # As a workdir from before the serving fields existed: no serve section.
  config_path = workdir / "config.json"
  saved = json.loads(config_path.read_text())
  saved.pop("serve", None)
  config_path.write_text(json.dumps(saved))

  greedy = ["--config.sample.temperature=0", "--config.sample.max_new_tokens=8"]
  out = _cli(workdir, "--mode=sample", "--prompt=the ", *greedy)
  assert out.returncode == 0, out.stderr
  [sampled] = re.findall(r"-----\n(the .*)\n", out.stdout)
  assert len(sampled) == len("the ") + 8

  out = _cli(workdir, "--mode=score", "--text=the quick brown fox")
  assert out.returncode == 0, out.stderr
  assert "18 tokens" in out.stdout and "ppl" in out.stdout  # 19 chars

  reply = _serve_one(workdir, {"prompt": "the ", "max_new_tokens": 8,
                               "temperature": 0})
  assert reply["texts"] == [sampled]  # the same engine, the same text

  out = _cli(workdir, "--mode=export", f"--export_dir={tmp_path / 'export'}")
  assert out.returncode == 0, out.stderr
  assert os.path.exists(tmp_path / "export" / "artifact" / "step.jax")
  assert not corpus.exists()
