"""Importing a lab script defines no flags: each defines its own when it
runs, so scripts with flags of the same name (--quick, --json, --config)
never meet."""

import json
import os
import subprocess
import sys

from tests.helpers import REPO

_CHECK = """
import importlib, json, pkgutil
from absl import flags
import absl.app, absl.logging  # absl's own flags, defined by every program
import lab
added = {}
for info in pkgutil.iter_modules(lab.__path__):
  before = set(flags.FLAGS)
  importlib.import_module(f"lab.{info.name}")
  added[info.name] = sorted(set(flags.FLAGS) - before)
print(json.dumps(added))
"""


def test_importing_a_lab_script_defines_no_flags():
  out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True,
                       text=True, cwd=REPO, check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  added = json.loads(out.stdout.strip().splitlines()[-1])
  assert len(added) >= 8 and "bench" in added and "gpu_report" in added
  assert added == {name: [] for name in added}
