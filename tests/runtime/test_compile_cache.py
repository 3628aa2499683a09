"""Where the persistent compilation cache goes: the workdir, a folder the
user names, off, or a JAX_COMPILATION_CACHE_DIR that was already set."""

import os

import jax
import pytest

from zebra_jax.runtime import compile_cache


@pytest.fixture
def no_cache_yet():
  """A process whose JAX has no cache folder set (the suite sets one)."""
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  yield
  jax.config.update("jax_compilation_cache_dir", before)


def test_defaults_to_the_workdir(tmp_path, monkeypatch, no_cache_yet):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  path = compile_cache.enable(str(tmp_path / "run"))
  assert path == os.path.abspath(tmp_path / "run" / "xla_cache")
  assert jax.config.jax_compilation_cache_dir == path


def test_a_named_folder_or_off(tmp_path, monkeypatch, no_cache_yet):
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "shared"))
  assert compile_cache.enable("run") == str(tmp_path / "shared")
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.setenv(compile_cache.ENV, "off")
  assert compile_cache.enable("run") is None
  assert not jax.config.jax_compilation_cache_dir


def test_a_folder_set_before_wins(tmp_path, monkeypatch, no_cache_yet):
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "other"))
  assert compile_cache.enable("run") == str(tmp_path / "mine")
