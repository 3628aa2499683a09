"""Preemption, exact resume, corrupt checkpoints and a full disk."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zebra_jax.errors import UserError
from zebra_jax.runtime import checkpoint, parallel
from zebra_jax.training import loop, preemption, train_state
from tests.helpers import (REPO, array_files, flip_a_bit_orbax_reads,
                           tiny_word_config, write_wikitext)


def _config(data, num_steps=12):
  cfg = tiny_word_config(data, head="full")
  cfg.train.update(num_steps=num_steps, log_every=1, eval_every=1000,
                   report_at_end=False)
  cfg.checkpoint.update(every_steps=1000, keep_latest=3)
  return cfg


def _train_losses(workdir):
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _final_state(cfg, workdir, step):
  cfg.model.vocab_size = json.load(open(f"{workdir}/config.json"))["model"][
      "vocab_size"]
  _, target = train_state.abstract_state(cfg, parallel.make_mesh())
  state, meta = checkpoint.Checkpointer(workdir).restore(step, target)
  return jax.device_get(state), meta


@pytest.mark.slow
def test_interrupted_run_resumes_bitwise(tmp_path, monkeypatch):
  data = write_wikitext(tmp_path / "wt")
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  loop.run(_config(data), straight)

  real = preemption.StopRequest.poll
  monkeypatch.setattr(preemption.StopRequest, "poll",
                      lambda self, step, out_of_time=False:
                      "SIGTERM" if step == 6 else real(self, step, out_of_time))
  first = loop.run(_config(data), resumed)
  assert first["preempted"] and first["steps"] == 6
  monkeypatch.setattr(preemption.StopRequest, "poll", real)
  second = loop.run(_config(data), resumed)
  assert second["steps"] == 12 and not second["preempted"]

  a, b = _train_losses(straight), _train_losses(resumed)
  shared = sorted(set(a) & set(b))
  assert len(shared) >= 8 and max(shared) == 12
  assert [a[s] for s in shared] == [b[s] for s in shared]  # bitwise
  state_a, meta_a = _final_state(_config(data), straight, 12)
  state_b, meta_b = _final_state(_config(data), resumed, 12)
  for x, y in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
    np.testing.assert_array_equal(x, y)
  assert meta_a["position"] == meta_b["position"]


@pytest.mark.slow
def test_sigterm_saves_and_exits_stopped_early_then_resumes(tmp_path):
  data = write_wikitext(tmp_path / "wt")
  workdir = str(tmp_path / "run")
  args = [sys.executable, "-m", "zebra_jax.main", "--config=wt103:tiny",
          f"--workdir={workdir}", f"--config.data.path={data}",
          "--config.model.head=full", "--config.train.log_every=2",
          "--config.train.eval_every=100000",
          "--config.checkpoint.every_steps=100000",
          "--config.train.report_at_end=false"]
  proc = subprocess.Popen(args + ["--config.train.num_steps=1000000"], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 120
  while time.time() < deadline and not (
      os.path.exists(metrics) and '"train"' in open(metrics).read()):
    time.sleep(0.1)  # wait for a logged training step
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == preemption.EXIT_STOPPED_EARLY, err
  assert "received SIGTERM" in out
  saved = checkpoint.Checkpointer(workdir).all_steps()
  assert len(saved) == 1 and saved[0] >= 2
  resumed = subprocess.run(args + [f"--config.train.num_steps={saved[0] + 4}"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
  assert resumed.returncode == 0, resumed.stderr
  assert f"resuming from checkpoint at step {saved[0]}" in resumed.stdout
  assert f"step {saved[0] + 4} |" in resumed.stdout


def _two_checkpoints(tmp_path):
  """A workdir whose checkpoints hold steps 6 and 12 of one run."""
  data = write_wikitext(tmp_path / "wt")
  cfg = _config(data)
  cfg.checkpoint.every_steps = 6
  workdir = str(tmp_path / "run")
  loop.run(cfg, workdir)
  assert checkpoint.Checkpointer(workdir).all_steps() == [6, 12]
  cfg.model.vocab_size = json.load(open(f"{workdir}/config.json"))["model"][
      "vocab_size"]
  return cfg, workdir


def _flip_bytes(workdir, step):
  """Inverts every 97th byte of every array data file of a step, keeping sizes.

  A single flipped spot can land in bytes no array reads (file padding), so
  the damage is spread over every file to be sure it hits the data.
  """
  for path in array_files(workdir, step):
    data = bytearray(open(path, "rb").read())
    for i in range(0, len(data), 97):
      data[i] ^= 0xFF
    with open(path, "r+b") as f:
      f.write(data)


def _largest_array_file(workdir, step):
  return max(array_files(workdir, step), key=os.path.getsize)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_latest_checkpoint_falls_back(tmp_path, damage):
  cfg, workdir = _two_checkpoints(tmp_path)
  if damage == "flip":  # same size, different bytes: orbax alone reads garbage
    _flip_bytes(workdir, 12)
  else:  # every data file: orbax may keep a copy of the data in another one
    for path in array_files(workdir, 12):
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
  _, target = train_state.abstract_state(cfg, parallel.make_mesh())
  ckpt = checkpoint.Checkpointer(workdir)
  messages = []
  step, state, meta = ckpt.restore_latest(target, messages.append)
  assert step == 6 and meta["position"]["index"] == 6
  assert "checkpoint at step 12 is unusable" in messages[0]
  assert ckpt.all_steps() == [6]  # step 12 moved aside, nothing deleted
  assert glob.glob(f"{workdir}/checkpoints/12.corrupt-*")
  # The training command resumes from step 6 and saves step 12 again.
  cfg.train.num_steps = 12
  summary = loop.run(cfg, workdir)
  assert summary["steps"] == 12
  assert checkpoint.Checkpointer(workdir).all_steps() == [6, 12]


def test_checksum_catches_a_bit_flip_that_orbax_restores(tmp_path):
  cfg, workdir = _two_checkpoints(tmp_path)
  _, target = train_state.abstract_state(cfg, parallel.make_mesh())
  state, meta = checkpoint.Checkpointer(workdir).restore(12, target)  # intact
  flip_a_bit_orbax_reads(workdir, 12, target)  # orbax: no error, new values
  with pytest.raises(checkpoint.CorruptCheckpoint, match="does not match"):
    checkpoint.Checkpointer(workdir).restore(12, target)
  messages = []
  step, _, _ = checkpoint.Checkpointer(workdir).restore_latest(
      target, messages.append)
  assert step == 6 and "does not match its checksum" in messages[0]


def test_checksum_is_strict_about_missing_entries(tmp_path):
  cfg, workdir = _two_checkpoints(tmp_path)
  _, target = train_state.abstract_state(cfg, parallel.make_mesh())
  state, meta = checkpoint.Checkpointer(workdir).restore(12, target)
  actual, failed = checkpoint.checksums(state)
  assert failed == [] and actual == meta["checksums"]
  missing = dict(meta, checksums=dict(list(meta["checksums"].items())[1:]))
  with pytest.raises(checkpoint.CorruptCheckpoint, match="has no checksum"):
    checkpoint.verify(actual, missing)
  old = {k: v for k, v in meta.items() if k != "checksums"}
  notes = []
  checkpoint.verify(actual, old, notes.append)  # written before checksums
  assert "predates checksums" in notes[0]


def test_checksum_ignores_layout_and_sees_every_bit():
  rng = np.random.default_rng(0)
  tree = {"w": rng.standard_normal((16, 6)).astype(np.float32),
          "b": rng.integers(0, 9, (16,)).astype(np.int32),
          "s": np.float32(3.5), "h": jnp.ones((16, 4), jnp.bfloat16)}
  sums = []
  for n in (1, 2, 8):
    mesh = parallel.make_mesh(jax.devices()[:n])
    placed = {k: jax.device_put(v, parallel.batch_sharded(mesh)
                                if k != "s" else parallel.replicated(mesh))
              for k, v in tree.items()}
    sums.append(checkpoint.checksums(placed)[0])
  assert sums[0] == sums[1] == sums[2]  # 1, 2 or 8 shards: one checksum
  w = tree["w"].copy()
  bits = w.view(np.uint32)
  for index, bit in [((0, 0), 0), ((7, 3), 31), ((15, 5), 17)]:
    bits[index] ^= np.uint32(1 << bit)
    flipped = checkpoint.checksums(dict(tree, w=w))[0]
    assert flipped["['w']"] != sums[0]["['w']"]
    bits[index] ^= np.uint32(1 << bit)
  swapped = tree["w"].copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places
  assert checkpoint.checksums(dict(tree, w=swapped))[0]["['w']"] != \
      sums[0]["['w']"]


def test_killed_save_leaves_a_temp_dir_that_is_ignored(tmp_path):
  cfg, workdir = _two_checkpoints(tmp_path)
  # What SIGKILL during an async save leaves: an unfinished temporary step.
  shutil.copytree(f"{workdir}/checkpoints/12",
                  f"{workdir}/checkpoints/18.orbax-checkpoint-tmp-1234")
  os.remove(_largest_array_file(workdir, "18.orbax-checkpoint-tmp-1234"))
  ckpt = checkpoint.Checkpointer(workdir)
  assert ckpt.all_steps() == [6, 12]
  _, target = train_state.abstract_state(cfg, parallel.make_mesh())
  step, _, _ = ckpt.restore_latest(target, print)
  assert step == 12
  ckpt.close()
  # Opening the checkpoints removed the leftover: no disk leaks across kills.
  assert sorted(os.listdir(f"{workdir}/checkpoints")) == ["12", "6"]


def test_all_checkpoints_unusable_is_one_clear_error(tmp_path):
  cfg, workdir = _two_checkpoints(tmp_path)
  for step in (6, 12):
    for path in array_files(workdir, step):
      with open(path, "r+b") as f:
        f.truncate(10)
  _, target = train_state.abstract_state(cfg, parallel.make_mesh())
  with pytest.raises(UserError, match="no checkpoint in .* could be restored"):
    checkpoint.Checkpointer(workdir).restore_latest(target, print)
  assert checkpoint.Checkpointer(workdir).all_steps() == [6, 12]  # kept


def _mount_tmpfs(path, size):
  os.makedirs(path, exist_ok=True)
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                           "tmpfs", str(path)], capture_output=True)
  return result.returncode == 0


def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path):
  mount = tmp_path / "small"
  if not _mount_tmpfs(mount, "4m"):
    pytest.skip("needs permission to mount a size-limited tmpfs (root)")
  try:
    data = write_wikitext(tmp_path / "wt")
    cfg = _config(data, num_steps=6)
    cfg.checkpoint.every_steps = 6
    workdir = str(mount / "run")
    loop.run(cfg, workdir)
    free = shutil.disk_usage(mount).free
    with open(mount / "filler", "wb") as f:  # leave ~20 KB: too little to save
      f.write(b"\0" * (free - 20_000))
    cfg.train.num_steps = 12
    with pytest.raises(UserError, match="could not write checkpoint step 12.*"
                       "previous checkpoint \\(step 6\\) is intact"):
      loop.run(cfg, workdir)
    os.remove(mount / "filler")
    assert checkpoint.Checkpointer(workdir).all_steps() == [6]
    summary = loop.run(cfg, workdir)  # space again: resumes from step 6
    assert summary["steps"] == 12
  finally:
    subprocess.run(["umount", "-l", str(mount)], check=False)
