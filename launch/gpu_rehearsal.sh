#!/usr/bin/env bash
# Rehearses the GPU report's one call as a GPU node without network runs
# it, on this machine's CPU (dry shapes), and prints the node's time it
# would spend: the device-time ledger (start, the call, copy-back, margin
# against the 900 s window), every number from lab/benchmarks/gpu_budget.py.
#
#   bash launch/gpu_rehearsal.sh           # as root (unshare -n); downloads
#   bash launch/gpu_rehearsal.sh --here    # the call only (see below)
#
# 1. a Python 3.12 venv under ${REHEARSAL_DIR:-/tmp/zebra-gpu-rehearsal} with
#    the node's package set, pinned (NODE_PINS below): jax and jaxlib 0.11.2,
#    numpy 2.5.2 and torch 2.11.0 as the node has them; flax, optax,
#    orbax-checkpoint, absl-py, tqdm, matplotlib, tensorboard, flatbuffers
#    and aiohttp at the versions the node's jax 0.11.2 resolves to (the
#    report's versions section records the node's own: update the pins from
#    it); neither ml-collections, tensorboardX nor flashrnn. The node's
#    jax-cuda13-plugin cannot run without a GPU, so the venv has the CPU
#    jaxlib==0.11.2 in its place.
#    PyPI's torch for Linux is the CUDA build (over 500 MB plus CUDA
#    libraries): left out unless REHEARSAL_TORCH=1, and the torch rows then
#    say it is missing. The venv is reused while its versions are right.
# 2. wheels/ with bash launch/gpu_wheels.sh, in
# 3. a fresh clone of this repository's committed HEAD (uncommitted work is
#    not in it), where
# 4. the call runs as on the node: bash launch/gpu_report.sh --dry-run under
#    unshare -n (after checking that the network is really absent), with the
#    venv's python first on PATH, OUT an empty folder, killed with its whole
#    process group at the dry budget (python -m lab.benchmarks.gpu_rehearsal).
# 5. It passes when every stage ran to its end, every row the call printed
#    as measured is in the returned gpu-results.json, and the budgets fit
#    the node's window (a stage budget raised past the call's 480 s fails it).
#
# --here: steps 4 and 5 only, in a copy of this working tree (tracked and
# untracked files) with this machine's python3 (PYTHON=...), without unshare.
# --stages "smoke kernel" rehearses those stages only; --kill-after
# kernel:6 kills the call once the kernel stage has 6 rows on disk, as a
# timeout mid-stage would, and passes when every row measured before the
# kill came back. REHEARSAL_CALL_BUDGET=seconds overrides the call's budget.
set -euo pipefail
{  # parsed whole before it runs: editing the file mid-run changes nothing
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${REHEARSAL_DIR:-/tmp/zebra-gpu-rehearsal}
here=0
stages_arg=""
kill_after=""
while (($#)); do
  case "$1" in
    --here) here=1 ;;
    --stages) shift; stages_arg=${1:?--stages needs a value} ;;
    --stages=*) stages_arg=${1#--stages=} ;;
    --kill-after) shift; kill_after=${1:?--kill-after needs STAGE:ROWS} ;;
    --kill-after=*) kill_after=${1#--kill-after=} ;;
    -h|--help) sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (see bash $0 --help)" >&2; exit 2 ;;
  esac
  shift
done

JAX_VERSION=0.11.2
NODE_PINS=("jax==${JAX_VERSION}" "jaxlib==${JAX_VERSION}" numpy==2.5.2
           flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8
           absl-py==2.5.1 tqdm==4.70.1 matplotlib==3.11.2 tensorboard==2.21.0
           flatbuffers==25.12.19 aiohttp==3.14.5)
[[ "${REHEARSAL_TORCH:-0}" == 1 ]] && NODE_PINS+=(torch==2.11.0)

venv_ok() {
  [[ -x "$venv/bin/python" ]] || return 1
  "$venv/bin/python" - "${NODE_PINS[@]}" <<'PY' 2>/dev/null
import importlib.metadata, sys
assert sys.version_info[:2] == (3, 12)
for pin in sys.argv[1:]:
  name, version = pin.split("==")
  assert importlib.metadata.version(name) == version, pin
PY
}

cleanup=()
trap 'rm -rf "${cleanup[@]}"' EXIT  # reads the list when it fires
if [[ "$here" == 1 ]]; then
  py=${PYTHON:-$(command -v python3 || command -v python)}
  tree=$(mktemp -d "${TMPDIR:-/tmp}/zebra-gpu-rehearsal-here.XXXXXX")
  cleanup+=("$tree")
  echo "== copy of the working tree into ${tree}; python ${py}"
  (cd "$repo" && git ls-files -co --exclude-standard -z \
     | xargs -0 cp --parents -t "$tree" 2>/dev/null || true)
  call=(env -u NO_INSTALL PYTHON="$py" bash launch/gpu_report.sh --dry-run)
else
  venv="$dir/venv"
  tree="$dir/repo"
  mkdir -p "$dir"
  if venv_ok; then
    echo "== venv ${venv}: reused"
  else
    echo "== venv ${venv}: installing the node's pinned packages (Python 3.12)"
    if ! "$venv/bin/python" -c \
        "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
      rm -rf "$venv"
      PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3.12 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q "${NODE_PINS[@]}"
    venv_ok || { echo "error: the venv lacks a pinned package" >&2; exit 1; }
  fi
  # What gpu_report.sh installs from wheels/ in a run is not on the node.
  "$venv/bin/python" -m pip uninstall -q -y ml-collections tensorboardX \
    flashrnn einops ninja 2>/dev/null || true
  if [[ "${REHEARSAL_TORCH:-0}" != 1 ]]; then
    "$venv/bin/python" -m pip uninstall -q -y torch 2>/dev/null || true
    echo "== torch left out (PyPI has only its CUDA build for Linux):" \
         "the torch rows will say so"
  fi
  echo "== venv packages:"
  "$venv/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(jax|jaxlib|flax|optax|orbax-checkpoint|absl-py|tqdm|matplotlib|tensorboard|numpy|torch|ml-collections|tensorboardx)==' \
    | sed 's/^/   /'

  echo "== clone of $(git -C "$repo" rev-parse --short HEAD) into ${tree}"
  rm -rf "$tree"
  git clone -q --no-checkout "$repo" "$tree"
  git -C "$tree" checkout -q "$(git -C "$repo" rev-parse HEAD)"

  echo "== wheels: bash launch/gpu_wheels.sh"
  (cd "$tree" && PYTHON="$venv/bin/python" bash launch/gpu_wheels.sh)
  py="$venv/bin/python"
  # The node's call, without network: checked absent first.
  call=(unshare -n env -u PYTHON -u NO_INSTALL PATH="$venv/bin:$PATH"
        PIP_CONFIG_FILE=/dev/null bash -c '
      set -euo pipefail
      python -c "
import socket
try:
  socket.create_connection((\"1.1.1.1\", 443), timeout=5).close()
except OSError as e:
  print(f\"network absent: {e}\")
else:
  raise SystemExit(\"error: the network is reachable inside unshare -n\")
"
      exec bash launch/gpu_report.sh --dry-run "$@"
    ' rehearsal)
fi

read -r -a stages <<< "${stages_arg}"
out=$(mktemp -d "${TMPDIR:-/tmp}/zebra-gpu-rehearsal-out.XXXXXX")
cleanup+=("$out")
rm -f "$tree/lab/notes/gpu-results.json"  # the call starts with no results
echo "== the call: bash launch/gpu_report.sh --dry-run${stages_arg:+ $stages_arg}" \
     "(OUT empty${kill_after:+; killed once ${kill_after%%:*} has ${kill_after#*:} rows})"
args=(--out="$out")
[[ -n "${REHEARSAL_CALL_BUDGET:-}" ]] && args+=(--budget="$REHEARSAL_CALL_BUDGET")
[[ -n "$stages_arg" ]] && args+=(--stages="$stages_arg")
[[ -n "$kill_after" ]] && args+=(--kill_after="$kill_after")
rc=0
(cd "$tree" && OUT="$out" PYTHONPATH="$tree" \
   "$py" -m lab.benchmarks.gpu_rehearsal "${args[@]}" -- \
   "${call[@]}" "${stages[@]}") || rc=$?
exit "$rc"
}
