#!/usr/bin/env bash
# Wheels for a GPU node without network: run on a machine with PyPI, then
# carry the repository (wheels/ included) to the node and run
# bash launch/gpu_report.sh there, which installs them when missing.
#
#   bash launch/gpu_wheels.sh          # wheels for Python 3.12
#   PY_VERSION=3.11 bash launch/gpu_wheels.sh
#
# The node's stack (jax with its CUDA plugin, flax, optax, orbax-checkpoint,
# absl-py, numpy, tqdm, matplotlib, tensorboard, torch) lacks only pure-Python
# packages: ml-collections (needs absl-py and PyYAML, both on the node with
# flax) and tensorboardX (optional; needs protobuf, numpy and packaging, on the
# node with tensorboard). Their versions come from pyproject.toml. wheels/ is
# ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}

mapfile -t specs < <("$PYTHON" - <<'EOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
  deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
  name = re.match(r"[A-Za-z0-9._-]+", dep).group(0)
  if name.lower() in ("ml-collections", "tensorboardx"):
    print(dep.split(";")[0].strip())
EOF
)
mkdir -p wheels
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
  --python-version "${PY_VERSION:-3.12}" -d wheels "${specs[@]}"
for whl in wheels/*.whl; do
  [[ "$whl" == *-none-any.whl ]] || echo "warning: ${whl} is not pure Python" >&2
done
echo "wheels/ for Python ${PY_VERSION:-3.12}:"
ls -1 wheels/*.whl | sed 's/^/  /'
