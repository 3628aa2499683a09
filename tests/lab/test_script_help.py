"""Every lab script answers --help with its flags and exit status 0, without
running anything (python -m lab.scaling --help once ran the whole model)."""

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO



def _scripts() -> list[str]:
  """The lab's scripts (lab/*.py but the package's __init__)."""
  return sorted(name[:-3] for name in os.listdir(os.path.join(REPO, "lab"))
                if name.endswith(".py") and name != "__init__.py")


@pytest.mark.slow
def test_every_lab_script_answers_help_with_status_0():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  running = {name: subprocess.Popen(
      [sys.executable, "-m", f"lab.{name}", "--help"], cwd=REPO, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in _scripts()}
  failing, silent = set(), set()
  for name, process in running.items():
    out, _ = process.communicate(timeout=120)
    if process.returncode != 0:
      failing.add(name)
    elif "--" not in out and "usage" not in out.lower():
      silent.add(name)
  assert {"bench", "native_bench", "scaling", "data_bench"} <= set(running)
  assert failing == set() and silent == set()
