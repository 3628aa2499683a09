#!/usr/bin/env bash
# Wheels for a GPU node without network: run where PyPI is reachable, then
# copy the repository (wheels/ included) to the node and run
# bash launch/gpu_report.sh there, which installs them when missing.
#
#   bash launch/gpu_wheels.sh          # wheels for Python 3.12, x86-64 Linux
#   PY_VERSION=3.11 bash launch/gpu_wheels.sh
#
# The node's stack (jax with its CUDA plugin, flax, optax, orbax-checkpoint,
# absl-py, numpy, tqdm, matplotlib, tensorboard, torch, triton) lacks:
# - ml-collections (needs absl-py and PyYAML, both on the node with flax) and
#   tensorboardX (optional; needs protobuf, numpy and packaging, on the node
#   with tensorboard), at pyproject.toml's versions;
# - flashrnn 1.0.8, the kernel stage's FlashRNN rows (optional), with what
#   it needs beyond torch and triton: einops, and ninja for its CUDA backend's
#   build (a binary wheel).
# wheels/ is ignored by git; every wheel here is at most a few hundred KB.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "error: unknown argument $1 (see bash $0 --help)" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
EXTRA=(flashrnn==1.0.8 einops==0.8.2 ninja==1.13.2)

mapfile -t specs < <("$PYTHON" - <<'PY'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
  deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
  name = re.match(r"[A-Za-z0-9._-]+", dep).group(0)
  if name.lower() in ("ml-collections", "tensorboardx"):
    print(dep.split(";")[0].strip())
PY
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p wheels
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
  --python-version "${PY_VERSION:-3.12}" --implementation cp \
  "${platforms[@]}" -d wheels "${specs[@]}" "${EXTRA[@]}"
for whl in wheels/*.whl; do
  case "$whl" in
    *-none-any.whl|*x86_64*.whl) ;;
    *) echo "warning: ${whl} is neither pure Python nor x86-64" >&2 ;;
  esac
done
echo "wheels/ for Python ${PY_VERSION:-3.12} ($(du -sh wheels | cut -f1)):"
ls -1 wheels/*.whl | sed 's/^/  /'
