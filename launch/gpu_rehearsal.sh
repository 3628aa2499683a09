#!/usr/bin/env bash
# Rehearses a GPU node without network on this machine, on the CPU:
#
#   bash launch/gpu_rehearsal.sh       # as root (unshare -n); downloads
#
# 1. a Python 3.12 venv under ${REHEARSAL_DIR:-/tmp/zebra-gpu-rehearsal} with
#    the node's package set: jax==0.11.2, flax, optax, orbax-checkpoint,
#    absl-py, tqdm, matplotlib, tensorboard, numpy 2, torch, and neither
#    ml-collections nor tensorboardX. The node's jax-cuda13-plugin cannot run
#    without a GPU, so the venv has the CPU jaxlib==0.11.2 in its place.
#    PyPI's torch for Linux is the CUDA build (over 500 MB plus CUDA
#    libraries): left out unless REHEARSAL_TORCH=1, and bench's torch rows are
#    then skipped. The venv is reused while its versions are right.
# 2. wheels/ with bash launch/gpu_wheels.sh, in
# 3. a fresh clone of this repository's committed HEAD (uncommitted work is
#    not in it), where
# 4. unshare -n runs bash launch/gpu_report.sh --dry-run with the venv's python
#    first on PATH, no pip configuration, after checking that the network is
#    really absent.
#
# Extra arguments go to gpu_report.sh (e.g. stage names); the dry run's report
# lands in $REHEARSAL_DIR/report (OUT=... to change).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${REHEARSAL_DIR:-/tmp/zebra-gpu-rehearsal}
venv="$dir/venv"
clone="$dir/repo"
JAX_VERSION=0.11.2
node_packages=("jax==${JAX_VERSION}" "jaxlib==${JAX_VERSION}" flax optax
               orbax-checkpoint absl-py tqdm matplotlib tensorboard "numpy>=2")
[[ "${REHEARSAL_TORCH:-0}" == 1 ]] && node_packages+=(torch)

venv_ok() {
  [[ -x "$venv/bin/python" ]] || return 1
  REHEARSAL_TORCH=${REHEARSAL_TORCH:-0} "$venv/bin/python" - <<EOF 2>/dev/null
import os, sys
import absl, flax, jax, jaxlib, matplotlib, numpy, optax, orbax.checkpoint
import tensorboard, tqdm
assert sys.version_info[:2] == (3, 12)
assert jax.__version__ == jaxlib.__version__ == "${JAX_VERSION}"
assert int(numpy.__version__.split(".")[0]) >= 2
if os.environ["REHEARSAL_TORCH"] == "1":
  import torch
EOF
}

mkdir -p "$dir"
if venv_ok; then
  echo "== venv ${venv}: reused"
else
  echo "== venv ${venv}: building (Python 3.12, the node's packages)"
  rm -rf "$venv"
  PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3.12 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "${node_packages[@]}"
  venv_ok || { echo "error: the venv lacks a package of the node" >&2; exit 1; }
fi
# What gpu_report.sh installs from wheels/ in a run is not on the node.
"$venv/bin/python" -m pip uninstall -q -y ml-collections tensorboardX \
  2>/dev/null || true
if [[ "${REHEARSAL_TORCH:-0}" != 1 ]]; then
  "$venv/bin/python" -m pip uninstall -q -y torch 2>/dev/null || true
  echo "== torch left out (PyPI has only its CUDA build for Linux):" \
       "the torch rows will be skipped"
fi
echo "== venv packages:"
"$venv/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(jax|jaxlib|flax|optax|orbax-checkpoint|absl-py|tqdm|matplotlib|tensorboard|numpy|torch|ml-collections|tensorboardx)==' \
  | sed 's/^/   /'

echo "== clone of $(git -C "$repo" rev-parse --short HEAD) into ${clone}"
rm -rf "$clone"
git clone -q --no-checkout "$repo" "$clone"
git -C "$clone" checkout -q "$(git -C "$repo" rev-parse HEAD)"

echo "== wheels: bash launch/gpu_wheels.sh"
(cd "$clone" && PYTHON="$venv/bin/python" bash launch/gpu_wheels.sh)

echo "== unshare -n: bash launch/gpu_report.sh --dry-run $*"
cd "$clone"
report=${OUT:-$dir/report}
if [[ -z "${OUT:-}" ]]; then rm -rf "$report"; fi  # no figures of an older run
unshare -n env -u PYTHON -u NO_INSTALL PATH="$venv/bin:$PATH" \
    PIP_CONFIG_FILE=/dev/null OUT="$report" bash -c '
  set -euo pipefail
  python - <<EOF
import socket
try:
  socket.create_connection(("1.1.1.1", 443), timeout=5).close()
except OSError as e:
  print(f"network absent: {e}")
else:
  raise SystemExit("error: the network is reachable inside unshare -n")
EOF
  bash launch/gpu_report.sh --dry-run "$@"
' rehearsal "$@"
"$venv/bin/python" - "$report/gpu-results.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
status = report["stages"]
failed = [f"{s}: {v['status']}" for s, v in status.items()
          if v["status"] != "done"]
if failed:
  raise SystemExit(f"== rehearsal failed: {'; '.join(failed)}")
print(f"== rehearsal passed: dry run of {', '.join(status)} without network "
      f"(jax {report['machine']['jax']}, Python {report['machine']['python']});"
      f" report in {sys.argv[1].rsplit('/', 1)[0]}")
EOF
