"""Several JAX processes on this machine (jax.distributed over 127.0.0.1, each
with emulated CPU devices), as under SLURM, 2 and 4 of them: stops agreed by
every process, preemption from a signal to one process (while training or
before its first step), checksums over every process's shards, and train +
eval on 1, 2, 4 and 8 devices with whole-split evaluation. Every process has a timeout, so a hang fails instead of stalling.
"""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from zebra_jax.configs import demo
from zebra_jax.runtime import checkpoint, parallel
from zebra_jax.training import preemption, train_state
from tests.helpers import (REPO, flip_a_bit_orbax_reads, sampled_text,
                           score_numbers)

TIMEOUT = 240  # seconds per run (a few on an idle machine): a hang fails


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A small text file (its valid split is a few eval windows) and a compile
  cache shared by every run in this module."""
  base = tmp_path_factory.mktemp("mp")
  story = base / "story.txt"
  story.write_text("".join(f"line {i}: the quick brown fox jumps over the "
                           f"lazy dog.\n" for i in range(200)))
  return str(story), str(base / "xla_cache")


def _args(corpus, workdir, *extra):
  story, _ = corpus
  return ["-m", "zebra_jax.main", "--config=demo:tiny",
          f"--workdir={workdir}", "--config.data.source=text",
          f"--config.data.path={story}", "--config.sample.prompt=the ",
          *extra]


def _env(corpus, devices):
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
              ZEBRA_COMPILATION_CACHE=corpus[1],
              PYTHONUNBUFFERED="1")  # tests watch the output as it comes


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(corpus, workdir, *extra, processes=2, devices=2):
  """The processes of one run; each writes its stdout/stderr to files beside
  the workdir, so a test can watch them while they run."""
  port = _free_port()
  procs = []
  for i in range(processes):
    logs = [open(f"{workdir}.{i}.{name}", "w") for name in ("out", "err")]
    procs.append(subprocess.Popen(
        [sys.executable, *_args(corpus, workdir, *extra),
         f"--coordinator_address=127.0.0.1:{port}",
         f"--num_processes={processes}", f"--process_id={i}"],
        env=_env(corpus, devices), cwd=REPO, stdout=logs[0], stderr=logs[1],
        text=True))
    procs[-1].logs = logs
  return procs


def _output(p) -> tuple[str, str]:
  """What process p has written so far: (stdout, stderr)."""
  return tuple(open(log.name).read() for log in p.logs)


def _finish(procs, timeout=TIMEOUT, status=0):
  """(stdout, stderr) of each process, each of which must exit with
  `status`; kills them all if any hangs."""
  deadline = time.time() + timeout
  try:
    for p in procs:
      p.wait(timeout=max(1, deadline - time.time()))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
      p.wait()
    tails = "\n".join(
        f"--- process {i} stdout:\n{out[-1500:]}\n--- stderr:\n{err[-1500:]}"
        for i, (out, err) in enumerate(map(_output, procs)))
    pytest.fail(f"processes still running after {timeout} s (a hang)\n{tails}")
  finally:
    for p in procs:
      for log in p.logs:
        log.close()
  outs = [_output(p) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == status, err[-3000:]
  return outs


def _run(corpus, workdir, *extra, processes=2, devices=2):
  return _finish(_start(corpus, workdir, *extra, processes=processes,
                        devices=devices))


def _steps(workdir):
  return checkpoint.Checkpointer(workdir, create=False).all_steps()


def _wait_for(procs, line):
  """Waits until process 0 has printed `line` (fails if any process ends)."""
  deadline = time.time() + TIMEOUT
  while time.time() < deadline:
    if line in _output(procs[0])[0]:
      return
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.1)
  _finish(procs, timeout=1)
  pytest.fail(f"process 0 never printed {line!r}")


def _saved_by_all(workdir, step, processes):
  """Every process wrote its carry shards into the step: it was a collective
  save, so all of them were at that step."""
  state = f"{workdir}/checkpoints/{step}/state"
  return all(glob.glob(f"{state}/ocdbt.process_{i}") for i in range(processes))


def _target(workdir):
  """An abstract train state of the tiny model, to restore checkpoints into."""
  cfg = demo.get_config("tiny")
  cfg.model.vocab_size = json.load(open(f"{workdir}/config.json"))["model"][
      "vocab_size"]
  return train_state.abstract_state(cfg, parallel.make_mesh())[1]


# (processes, devices per process): 2 x 2 and 4 x 1, so 4 devices either way.
_LAYOUTS = pytest.mark.parametrize("processes,devices", [(2, 2), (4, 1)],
                                   ids=["2procs", "4procs"])


@pytest.mark.slow
@_LAYOUTS
def test_time_budget_stops_every_process_at_one_step_then_eval(
    corpus, tmp_path, processes, devices):
  workdir = str(tmp_path / "run")
  layout = dict(processes=processes, devices=devices)
  runs = _run(corpus, workdir, "--config.train.num_steps=100000",
              "--config.train.time_budget_minutes=0.05",
              "--config.train.log_every=5",
              "--config.train.eval_every=100000",
              "--config.checkpoint.every_steps=100000",
              "--verbosity=0", **layout)  # INFO: data preparation is logged
  (out, _) = runs[0]
  # Process 0 alone tokenized the corpus and built the tokenizer; the others
  # waited, then read its files.
  for line in ("tokenized the corpus", "tokenizer (vocab"):
    assert [line in err for _, err in runs] == [True] + [False] * (
        processes - 1), line
  reached = [l for l in out.splitlines() if "time budget of" in l]
  assert len(reached) == 1, out
  step = int(reached[0].rsplit("step ", 1)[1])
  assert step % 5 == 0  # an agreed poll step
  assert _steps(workdir) == [step] and _saved_by_all(workdir, step, processes)
  # Then, as after any finished run: whole-split eval and a sample (process 0
  # prints them; every process takes part).
  assert "| end of training" in out and "test ppl" in out
  assert "----- sample 1/1" in out
  (again, _) = _run(corpus, workdir, "--mode=eval", **layout)[0]
  assert "valid ppl" in again and "test ppl" in again


@pytest.mark.parametrize("sig,processes,devices,when", [
    (signal.SIGTERM, 2, 2, "training"),
    (signal.SIGINT, 4, 1, "training"),
    (signal.SIGTERM, 4, 1, "compiling"),
], ids=["SIGTERM-2procs", "SIGINT-4procs", "SIGTERM-4procs-before-step-1"])
@pytest.mark.slow
def test_signal_to_one_process_stops_all_at_one_saved_step(
    corpus, tmp_path, sig, processes, devices, when):
  workdir = str(tmp_path / "run")
  layout = dict(processes=processes, devices=devices)
  common = ["--config.train.log_every=2", "--config.train.eval_every=100000",
            "--config.checkpoint.every_steps=100000",
            "--config.train.report_at_end=false",
            "--config.model.dropout_hidden=0.1",
            # a constant rate: the schedule must not depend on num_steps,
            # which differs between the interrupted and the straight run
            "--config.optim.warmup_steps=0", "--config.optim.min_lr_ratio=1.0"]
  procs = _start(corpus, workdir, "--config.train.num_steps=100000", *common,
                 **layout)
  # "training": a step has been logged. "compiling": the model is built and
  # the first step is compiling, before the training loop has run at all.
  _wait_for(procs, "| epoch " if when == "training" else "model: ")
  procs[1].send_signal(sig)  # not the one that logs
  (out, _) = _finish(procs, status=preemption.EXIT_STOPPED_EARLY)[0]
  assert f"received {sig.name} (process 1)" in out
  [saved] = _steps(workdir)
  assert saved % 2 == 0 and _saved_by_all(workdir, saved, processes)
  if sig == signal.SIGINT or when != "training":
    return  # the same path; one resume check is enough
  # A rerun resumes at that step and continues as an uninterrupted run would.
  end = saved + 4
  (resumed, _) = _run(corpus, workdir, f"--config.train.num_steps={end}",
                      *common, **layout)[0]
  assert f"resuming from checkpoint at step {saved}" in resumed
  straight = str(tmp_path / "straight")
  _run(corpus, straight, f"--config.train.num_steps={end}", *common, **layout)
  target = _target(workdir)
  a, _ = checkpoint.Checkpointer(workdir).restore(end, target)
  b, _ = checkpoint.Checkpointer(straight).restore(end, target)
  for x, y in zip(jax.tree.leaves(jax.device_get(a)),
                  jax.tree.leaves(jax.device_get(b))):
    np.testing.assert_array_equal(x, y)  # bitwise


@pytest.mark.slow
@_LAYOUTS
def test_bit_flip_in_one_process_shard_falls_back_everywhere(
    corpus, tmp_path, processes, devices):
  workdir = str(tmp_path / "run")
  layout = dict(processes=processes, devices=devices)
  common = ["--config.train.eval_every=100000",
            "--config.checkpoint.every_steps=6",
            "--config.checkpoint.keep_latest=3",
            "--config.train.report_at_end=false"]
  _run(corpus, workdir, "--config.train.num_steps=12", *common, **layout)
  assert _steps(workdir) == [6, 12]
  # A file that the last process wrote (orbax spreads the replicated arrays'
  # writes over the processes); orbax reads the flipped bit back without
  # complaint.
  flip_a_bit_orbax_reads(workdir, 12, _target(workdir), process=processes - 1)
  (out, _) = _run(corpus, workdir, "--config.train.num_steps=14", *common,
                  **layout)[0]
  assert ("checkpoint at step 12 is unusable (array ." in out
          and "does not match its checksum" in out), out
  assert "resuming from checkpoint at step 6" in out
  assert glob.glob(f"{workdir}/checkpoints/12.corrupt-*")
  assert _steps(workdir) == [6, 12, 14]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_train_and_eval_finish_on_any_device_count(corpus, tmp_path, devices):
  workdir = str(tmp_path / "run")
  env = _env(corpus, devices)
  train = subprocess.run(
      [sys.executable, *_args(corpus, workdir, "--config.train.num_steps=20")],
      env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
  assert train.returncode == 0, train.stderr[-3000:]
  assert f"{devices} cpu device(s)" in train.stdout
  assert "test ppl" in train.stdout and "----- sample 1/1" in train.stdout
  if devices == 8:  # --mode=eval: the same whole-split evaluation
    ev = subprocess.run(
        [sys.executable, *_args(corpus, workdir, "--mode=eval")], env=env,
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "valid ppl" in ev.stdout and "test ppl" in ev.stdout


@pytest.mark.slow
def test_stripe_devices_inside_each_process(corpus, tmp_path):
  """2 processes x 2 devices, each process's 2 devices one stripe group:
  train (with its closing eval and sample), eval, greedy sampling and
  scoring split over a process's 2 devices (as one device gives them),
  export."""
  workdir = str(tmp_path / "run")
  stripes = "--config.parallel.stripe_devices=2"
  outs = _run(corpus, workdir, stripes, "--config.train.num_steps=10")
  assert "test ppl" in outs[0][0] and "----- sample 1/1" in outs[0][0]
  assert "valid ppl" in _run(corpus, workdir, "--mode=eval")[0][0]
  greedy = ("--mode=sample", "--prompt=the quick",
            "--config.sample.temperature=0")
  scored = ("--mode=score", "--text=the lazy dog jumps over the fox.")
  def one_device(*args):
    one = subprocess.run(
        [sys.executable, *_args(corpus, workdir, *args,
                                "--config.parallel.stripe_devices=1")],
        env=_env(corpus, 1), cwd=REPO, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr[-3000:]
    return one.stdout

  assert sampled_text(_run(corpus, workdir, *greedy)[0][0]) == sampled_text(
      one_device(*greedy))
  # printed to 4 decimals: equal up to the last digit's rounding
  assert score_numbers(_run(corpus, workdir, *scored)[0][0]) == pytest.approx(
      score_numbers(one_device(*scored)), abs=1e-4, rel=1e-4)
  assert "Triton model" in _run(corpus, workdir, "--mode=export")[0][0]
