"""Fixtures of the model tests: a clean slate for the native time loops,
and this CPU's own build of them."""

import pytest

from zebra_jax.model.recurrence import native_build
from zebra_jax.model.recurrence import scan as recurrence


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
  """A private cache, this CPU's target, no prebuilt library, nothing
  loaded or warned about yet in this process."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  monkeypatch.delenv(native_build.MARCH_ENV, raising=False)
  monkeypatch.delenv(native_build.LIB_ENV, raising=False)
  monkeypatch.setattr(recurrence, "_warned", set())
  return tmp_path


@pytest.fixture
def this_cpus_build(monkeypatch):
  """The native library built for this CPU (-march=native), not a prebuilt
  one: the build that has the CPU's bf16 units where it has them."""
  monkeypatch.setenv(native_build.MARCH_ENV, "native")
  monkeypatch.delenv(native_build.LIB_ENV, raising=False)
