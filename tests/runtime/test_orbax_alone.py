"""A workdir's best checkpoint read with orbax alone, as docs/reliability.md
shows it: the same parameters zebra_jax restores."""

import os
import subprocess
import sys

import jax
import numpy as np

from zebra_jax import api
from tests.helpers import python_block

# After the page's block: no zebra_jax imported; every array by its path.
_SAVE = """
import sys
import jax, numpy as np
assert "zebra_jax" not in sys.modules
keys = lambda path: "/".join(str(k.key) for k in path)
np.savez(sys.argv[1], step=step, **{keys(p): np.asarray(a) for p, a in
                                    jax.tree_util.tree_leaves_with_path(params)})
"""


def _key(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                  for k in path)


def test_the_best_params_with_orbax_alone(char_run, tmp_path):
  _, workdir = char_run
  os.makedirs(tmp_path / "runs")
  os.symlink(workdir, tmp_path / "runs" / "demo")
  code = python_block("docs/reliability.md", "StandardCheckpointer") + _SAVE
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.npz")],
                       cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "could not be restored" not in out.stderr
  got = dict(np.load(tmp_path / "p.npz"))
  with api.load(workdir) as model:
    assert int(got.pop("step")) == model.step
    want = {_key(p): np.asarray(a) for p, a in
            jax.tree_util.tree_leaves_with_path(model.params)}
  assert sorted(got) == sorted(want) and "layers/0/w_h/value" in got
  for name, array in want.items():
    np.testing.assert_array_equal(got[name], array, err_msg=name)
