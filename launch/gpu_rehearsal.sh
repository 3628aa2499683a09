#!/usr/bin/env bash
# Rehearses the GPU report's calls on a GPU node without network, on this
# machine's CPU (dry shapes):
#
#   bash launch/gpu_rehearsal.sh           # as root (unshare -n); downloads
#   bash launch/gpu_rehearsal.sh --here    # the calls only (see below)
#
# 1. a Python 3.12 venv under ${REHEARSAL_DIR:-/tmp/zebra-gpu-rehearsal} with
#    the node's package set, pinned (NODE_PINS below): jax and jaxlib 0.11.2,
#    numpy 2.5.2 and torch 2.11.0 as the node has them; flax, optax,
#    orbax-checkpoint, absl-py, tqdm, matplotlib, tensorboard, flatbuffers
#    and aiohttp at the versions the node's jax 0.11.2 resolves to (the
#    report's versions section records the node's own: update the pins from
#    it); neither ml-collections nor tensorboardX. The node's
#    jax-cuda13-plugin cannot run without a GPU, so the venv has the CPU
#    jaxlib==0.11.2 in its place.
#    PyPI's torch for Linux is the CUDA build (over 500 MB plus CUDA
#    libraries): left out unless REHEARSAL_TORCH=1, and the torch rows are
#    then skipped. The venv is reused while its versions are right.
# 2. wheels/ with bash launch/gpu_wheels.sh, in
# 3. a fresh clone of this repository's committed HEAD (uncommitted work is
#    not in it), where
# 4. each call of docs/gpu-results.md's sequence (gpu_results.CALLS) runs as
#    on the node: bash launch/gpu_report.sh --dry-run STAGES under unshare -n
#    (after checking that the network is really absent), with the venv's
#    python first on PATH, OUT an empty folder, the call killed at its budget
#    (CALL_BUDGET_S); then the returned gpu-results.json and .md are copied
#    over the clone's docs/, which the next call carries.
# 5. The combined docs/gpu-results.json must hold every stage, each done,
#    and every call must have ended within its budget.
#
# --here: steps 4 and 5 only, in a copy of this working tree (tracked and
# untracked files) with this machine's python3 (PYTHON=...), without unshare.
# --calls "smoke quick bench;wt103 ..." rehearses other calls (';' between
# calls); REHEARSAL_CALL_BUDGET=seconds overrides the call budget.
set -euo pipefail
{  # parsed whole before it runs: editing the file mid-run changes nothing
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${REHEARSAL_DIR:-/tmp/zebra-gpu-rehearsal}
here=0
calls_arg=""
while (($#)); do
  case "$1" in
    --here) here=1 ;;
    --calls) shift; calls_arg=${1:?--calls needs a value} ;;
    --calls=*) calls_arg=${1#--calls=} ;;
    -h|--help) sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
  "$venv/bin/python" - "${NODE_PINS[@]}" <<'EOF' 2>/dev/null
import importlib.metadata, sys
assert sys.version_info[:2] == (3, 12)
for pin in sys.argv[1:]:
  name, version = pin.split("==")
  assert importlib.metadata.version(name) == version, pin
EOF
}

if [[ "$here" == 1 ]]; then
  py=${PYTHON:-$(command -v python3 || command -v python)}
  tree=$(mktemp -d "${TMPDIR:-/tmp}/zebra-gpu-rehearsal-here.XXXXXX")
  trap 'rm -rf "$tree"' EXIT
  echo "== copy of the working tree into ${tree}; python ${py}"
  (cd "$repo" && git ls-files -co --exclude-standard -z \
     | xargs -0 cp --parents -t "$tree" 2>/dev/null || true)
  run_call() {  # STAGES... in $tree with OUT=$out
    (cd "$tree" && env -u NO_INSTALL PYTHON="$py" OUT="$out" \
       timeout -k 10 "$budget" bash launch/gpu_report.sh --dry-run "$@")
  }
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

  echo "== clone of $(git -C "$repo" rev-parse --short HEAD) into ${tree}"
  rm -rf "$tree"
  git clone -q --no-checkout "$repo" "$tree"
  git -C "$tree" checkout -q "$(git -C "$repo" rev-parse HEAD)"

  echo "== wheels: bash launch/gpu_wheels.sh"
  (cd "$tree" && PYTHON="$venv/bin/python" bash launch/gpu_wheels.sh)
  py="$venv/bin/python"
  run_call() {  # STAGES... in $tree with OUT=$out, without network
    (cd "$tree" && unshare -n env -u PYTHON -u NO_INSTALL \
       PATH="$venv/bin:$PATH" PIP_CONFIG_FILE=/dev/null OUT="$out" \
       timeout -k 10 "$budget" bash -c '
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
    ' rehearsal "$@")
  }
fi

# The documented calls and their budget, from the tree being rehearsed.
plan=$(cd "$tree" && PYTHONPATH="$tree" "$py" -c '
from lab.benchmarks.gpu_results import CALLS, CALL_BUDGET_S
print(CALL_BUDGET_S)
print(";".join(" ".join(c) for c in CALLS))')
budget=${REHEARSAL_CALL_BUDGET:-$(sed -n 1p <<< "$plan")}
IFS=';' read -r -a calls <<< "${calls_arg:-$(sed -n 2p <<< "$plan")}"

rm -f "$tree/docs/gpu-results.json"  # the sequence starts with no results
failed=()
for i in "${!calls[@]}"; do
  read -r -a stages <<< "${calls[$i]}"
  out=$(mktemp -d "${TMPDIR:-/tmp}/zebra-gpu-rehearsal-out.XXXXXX")
  echo "== call $((i + 1)) of ${#calls[@]} (budget ${budget} s):" \
       "bash launch/gpu_report.sh --dry-run ${stages[*]}"
  start=$SECONDS
  rc=0
  run_call "${stages[@]}" || rc=$?
  took=$((SECONDS - start))
  if ((rc == 124 || rc == 137)); then
    failed+=("call $((i + 1)) killed at its ${budget} s budget")
  elif ((rc != 0)); then
    failed+=("call $((i + 1)) exited ${rc}")
  fi
  echo "== call $((i + 1)): exit ${rc}, ${took} s of ${budget} s"
  # What the node returns, copied back into the tree for the next call.
  for f in gpu-results.json gpu-results.md; do
    if [[ -f "$out/$f" ]]; then cp "$out/$f" "$tree/docs/$f"; fi
  done
  rm -rf "$out"
done

"$py" - "$tree/docs/gpu-results.json" "${calls[@]}" \
    "${failed[@]/#/FAILED:}" <<'EOF'
import json, os, sys
path, args = sys.argv[1], sys.argv[2:]
failed = [a[len("FAILED:"):] for a in args if a.startswith("FAILED:")]
wanted = [s for a in args if not a.startswith("FAILED:") for s in a.split()]
report = json.load(open(path)) if os.path.exists(path) else {}
status = report.get("stages", {})
missing = [s for s in wanted if s not in status or s not in report]
failed += [f"{s}: {status[s]['status']}" for s in wanted
           if s in status and status[s]["status"] != "done"]
failed += [f"{s}: not in the combined file" for s in missing]
if failed:
  raise SystemExit(f"== rehearsal failed: {'; '.join(failed)}")
print(f"== rehearsal passed: {', '.join(wanted)} in one file over "
      f"{len([a for a in args if not a.startswith('FAILED:')])} calls "
      f"(jax {report['machine']['jax']}, Python "
      f"{report['machine']['python']}); versions outside pyproject.toml: "
      f"{'; '.join(report['versions']['outside']) or 'none'}")
EOF
exit
}
