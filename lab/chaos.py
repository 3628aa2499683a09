"""Fault injection: break a small training run in every way we promise to survive.

  python -m lab.chaos [--workdir=/tmp/chaos] [--steps=40] \
      [--config=demo:tiny] [--config.x=y ...]

Trains a tiny model once without interruption, then again while, in turn,
sending SIGTERM mid-run, SIGKILLing mid-save, corrupting the newest checkpoint
and filling the disk (a size-limited tmpfs when this user may mount one),
resuming after each. It then checks that the final parameters equal the
uninterrupted run's bit for bit and prints a table: fault, recovered, steps lost.
Exits non-zero if any fault was not recovered.
"""

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import flags
from ml_collections import config_flags

from zebra_jax.cli import entry
from zebra_jax.errors import UserError
from zebra_jax.runtime import plots
from zebra_jax.training import preemption


def _write_corpus(path: str) -> None:
  words = ("the cat sat on a mat while the dog ran to the park and the bird "
           "sang in a tree near the old house by the river").split()
  with open(path, "w") as f:
    for i in range(3000):
      f.write(" ".join(words[i % 17:i % 17 + 7]) + " .\n")


def _command(config: list[str], workdir: str, corpus: str,
             steps: int) -> list[str]:
  """config: --config=FILE and the --config.x=y overrides chaos was given."""
  return [sys.executable, "-m", "zebra_jax.main", *config,
          f"--workdir={workdir}", "--config.data.source=text",
          f"--config.data.path={corpus}", f"--config.train.num_steps={steps}",
          "--config.train.log_every=1", "--config.train.eval_every=100000",
          "--config.checkpoint.every_steps=5", "--config.checkpoint.keep_latest=3",
          "--config.train.report_at_end=false"]


def _config_args(argv: list[str]) -> list[str]:
  """--config (absolute, so runs may start anywhere) and its overrides."""
  path, _, variant = flags.FLAGS["config"].config_filename.partition(":")
  spec = os.path.abspath(path) + (f":{variant}" if variant else "")
  return [f"--config={spec}"] + [a for a in argv if a.startswith(
      ("--config.", "--noconfig."))]


def _steps(workdir: str) -> list[int]:
  folder = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(folder):
    return []
  return sorted(int(d) for d in os.listdir(folder) if d.isdigit())


def _last_logged_step(workdir: str, since: float = 0.0) -> int:
  """The last training step logged (in records written at Unix time `since`
  or later: a resumed run rewrites the file without the records past its
  checkpoint, so byte offsets do not mark a run's own records)."""
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return 0
  return max((r["step"] for r in plots.read_metrics(workdir)
              if r["kind"] == "train" and r["time"] >= since), default=0)


def _wait_for(predicate, timeout: float = 180.0) -> bool:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return True
    time.sleep(0.02)
  return False


# A partial run's exit status: stopped by its SIGTERM, or done before it.
_STOPPED_OR_DONE = (preemption.EXIT_STOPPED_EARLY, 0)


def _partial_run(cmd, workdir: str, until_step: int):
  """Starts a run, lets it log until_step, then SIGTERMs it: (code, out, err)."""
  since = time.time()  # only this run's own progress counts
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  _wait_for(lambda: _last_logged_step(workdir, since) >= until_step
            or proc.poll() is not None)
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  return proc.returncode, out, err


def _run(cmd, **kw):
  return subprocess.run(cmd, capture_output=True, text=True,
                        timeout=600, **kw)


def main(argv: list[str]) -> int:
  if flags.FLAGS.config is None:
    raise UserError("pass --config=FILE, e.g. --config=demo:tiny")
  config, steps = _config_args(argv), flags.FLAGS.steps
  root = flags.FLAGS.workdir or tempfile.mkdtemp(prefix="zebra_chaos_")
  os.makedirs(root, exist_ok=True)
  corpus = os.path.join(root, "corpus.txt")
  _write_corpus(corpus)
  reference, chaos = os.path.join(root, "reference"), os.path.join(root, "chaos")
  mounted = False
  if os.geteuid() == 0:
    os.makedirs(chaos, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs",
                              chaos], capture_output=True).returncode == 0
  rows, notes = [], []
  try:
    out = _run(_command(config, reference, corpus, steps))
    if out.returncode:
      print(out.stderr, file=sys.stderr)
      return 1
    cmd = _command(config, chaos, corpus, steps)

    # 1. SIGTERM mid-run: a checkpoint at the current step, exit 75.
    code, out, err = _partial_run(cmd, chaos, until_step=7)
    saved = max(_steps(chaos), default=0)
    rows.append(("SIGTERM mid-run", code == preemption.EXIT_STOPPED_EARLY
                 and "received SIGTERM" in out,
                 _last_logged_step(chaos) - saved, out + err))

    # 2. SIGKILL while an async save is being written; the next run resumes
    #    from the newest complete step.
    since = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    tmp_glob = os.path.join(chaos, "checkpoints", "*.orbax-checkpoint-tmp*")
    in_save = _wait_for(lambda: glob.glob(tmp_glob)
                        and _last_logged_step(chaos, since) > saved)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = max(_steps(chaos), default=0)
    lost = _last_logged_step(chaos) - complete
    code, out, err = _partial_run(cmd, chaos, until_step=complete + 3)
    rows.append(("SIGKILL mid-save" if in_save else "SIGKILL mid-run",
                 code in _STOPPED_OR_DONE
                 and f"resuming from checkpoint at step {complete}" in out,
                 lost, out + err))

    # 3. Flip bytes throughout the newest checkpoint's array files; the next
    #    run reports it, moves it aside and resumes from the one before.
    newest = max(_steps(chaos))
    for path in glob.glob(os.path.join(chaos, "checkpoints", str(newest),
                                       "state", "**", "d", "*"), recursive=True):
      data = bytearray(open(path, "rb").read())
      for i in range(0, len(data), 97):  # same size, different bytes
        data[i] ^= 0xFF
      with open(path, "r+b") as f:
        f.write(data)
    older = max(s for s in _steps(chaos) if s < newest)
    code, out, err = _partial_run(cmd, chaos, until_step=newest + 1)
    rows.append(("corrupt newest checkpoint",
                 code in _STOPPED_OR_DONE and "unusable" in out
                 and f"resuming from checkpoint at step {older}" in out,
                 newest - older, out + err))

    # 4. A full disk during a save (only on a size-limited tmpfs): one clear
    #    line, exit code 2, and the previous checkpoint survives.
    if mounted:
      before = _steps(chaos)
      free = shutil.disk_usage(chaos).free
      with open(os.path.join(chaos, "filler"), "wb") as f:
        f.write(b"\0" * max(free - 50_000, 0))
      full = _run(cmd)
      os.remove(os.path.join(chaos, "filler"))
      clear = (full.returncode == 2 and "error: could not write" in full.stderr
               and set(before) <= set(_steps(chaos)))
      rows.append(("disk full during save", clear, 0, full.stdout + full.stderr))
      noise = full.stderr.count("Traceback")
      if noise:  # orbax's writer threads may print before our one-line error
        notes.append(f"disk full: orbax's background threads printed {noise} "
                     f"tracebacks before the one-line error")

    # Resume to the end after all of it.
    final = _run(cmd)
    same = final.returncode == 0 and _same_final_params(reference, chaos)
    rows.append(("final params == uninterrupted run", same, 0,
                 final.stdout + final.stderr))
  finally:
    if mounted:
      subprocess.run(["umount", "-l", chaos], check=False)
  print(f"{'fault':36} {'recovered':>10} {'steps lost':>11}")
  for fault, ok, lost, _ in rows:
    print(f"{fault:36} {('yes' if ok else 'NO'):>10} {lost:>11}")
  for note in notes:
    print(f"note: {note}")
  for fault, ok, _, err in rows:
    if not ok:
      print(f"\n{fault}: its output ends with:\n" + "\n".join(
          err.strip().splitlines()[-15:]), file=sys.stderr)
  return 0 if all(ok for _, ok, _, _ in rows) else 1


def _final_state(workdir: str):
  """The newest checkpoint's whole train state, as host arrays."""
  import jax
  from zebra_jax.config import files
  from zebra_jax.runtime import checkpoint, parallel
  from zebra_jax.training import train_state
  cfg = files.load_saved(workdir)
  ckpt = checkpoint.Checkpointer(workdir, create=False)
  _, target = train_state.abstract_state(cfg, parallel.make_mesh())
  return jax.device_get(ckpt.restore(ckpt.latest_step(), target)[0])


def _same_final_params(reference: str, chaos: str) -> bool:
  """Bitwise comparison of the two runs' final train states."""
  import jax
  import numpy as np
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  a, b = _final_state(reference), _final_state(chaos)
  return all(np.array_equal(x, y)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


if __name__ == "__main__":
  config_flags.DEFINE_config_file(
      "config", entry.default_config("demo:tiny"),
      "Config file[:variant] of the runs; --config.x=y overrides apply.")
  flags.DEFINE_string("workdir", None, "Where the runs go (default: a new "
                      "temporary folder).")
  flags.DEFINE_integer("steps", 40, "Training steps of each run.")
  entry.run_tool(main)
