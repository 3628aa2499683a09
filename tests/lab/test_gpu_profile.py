"""The profile stage's archives: the XLA dump's train-step module picked
from every module a process compiled, packed under the size the node
returns, its less useful files dropped first."""

import os
import tarfile

import numpy as np

from lab.benchmarks import gpu_profile


def _dump(folder):
  """A dump of two modules: a small one and the step (larger)."""
  rng = np.random.default_rng(0)
  files = {
      "module_0001.jit_draw.before_optimizations.txt": 100,
      "module_0034.jit_train_step.before_optimizations.txt": 3000,
      "module_0034.jit_train_step.cpu_after_optimizations.txt": 3000,
      "module_0034.jit_train_step.ir-with-opt.ll": 20000,
      "module_0034.jit_train_step.buffer-assignment.bin": 20000}
  for name, size in files.items():
    # random bytes as hex: text that gzip cannot shrink much
    (folder / name).write_text(rng.bytes(size // 2).hex())
  return files


def _names(path):
  with tarfile.open(path) as tar:
    return sorted(tar.getnames())


def test_the_step_module_is_packed_whole_when_it_fits(tmp_path):
  (tmp_path / "dump").mkdir()
  _dump(tmp_path / "dump")
  files = gpu_profile.step_module_files(str(tmp_path / "dump"))
  assert sorted(n for _, n in files) == sorted(
      n for n in os.listdir(tmp_path / "dump") if "module_0034" in n)
  packed = gpu_profile.pack_dump(files, str(tmp_path / "d.tar.gz"))
  assert packed["dump_files"] == 4
  assert packed["dump_bytes"] == os.path.getsize(tmp_path / "d.tar.gz")


def test_an_archive_over_the_cap_keeps_the_hlo_text(tmp_path):
  (tmp_path / "dump").mkdir()
  _dump(tmp_path / "dump")
  files = gpu_profile.step_module_files(str(tmp_path / "dump"))
  path = str(tmp_path / "d.tar.gz")
  packed = gpu_profile.pack_dump(files, path, cap=8000)
  assert packed["dump_files"] == 2 and packed["dump_bytes"] <= 8000
  assert _names(path) == [
      "module_0034.jit_train_step.before_optimizations.txt",
      "module_0034.jit_train_step.cpu_after_optimizations.txt"]
  packed = gpu_profile.pack_dump(files, path, cap=2500)
  assert _names(path) == [
      "module_0034.jit_train_step.cpu_after_optimizations.txt"]
  packed = gpu_profile.pack_dump(files, path, cap=100)
  assert packed["dump_error"].startswith("even the optimized HLO packs to")
  assert not os.path.exists(path)


def test_the_dump_flags_keep_the_callers_own(tmp_path):
  assert gpu_profile.dump_flags(str(tmp_path), "--xla_foo=1") == (
      f"--xla_foo=1 --xla_dump_to={tmp_path}/xla_dump --xla_dump_hlo_as_text "
      "--xla_gpu_enable_command_buffer=")
  assert gpu_profile.tensorboard_command().endswith(
      "tensorboard --logdir trace")
