#!/usr/bin/env bash
# Every GPU figure in one command: python -m lab.gpu_report from the
# repository root (the project itself need not be pip-installed).
#
#   bash launch/gpu_report.sh [--dry-run] [--no-install]
#                             [--budgets=STAGE=SECONDS,...] [STAGE ...]
#
# On a GPU node lent for 15 minutes, one call, with a 480 s timeout
# (lab/benchmarks/gpu_budget.py holds every budget):
#   bash launch/gpu_report.sh
# runs every stage in order of value, each writing its rows into OUT as it
# measures them: smoke kernel wt103 precision infer scaling profile
# A second, optional call reruns named stages only, with more time where
# the node has it to spare:
#   bash launch/gpu_report.sh wt103 infer
#   bash launch/gpu_report.sh --budgets=kernel=250 kernel
#   bash launch/gpu_report.sh --dry-run        # tiny shapes on any CPU
#
# What it installs, one printed line per decision:
# - jax: nothing when the Python already has jax with a CUDA plugin (a GPU
#   node's own stack), with --dry-run (CPU), or with --no-install / NO_INSTALL=1.
#   Otherwise, on a machine with a package index, pip install -e
#   ".[cuda13,bench]" (CUDA_EXTRA=cuda12 for CUDA 12 drivers).
# - the packages the project needs beyond that stack, only when the module
#   is missing, from wheels/ with pip install --no-index: ml-collections
#   (required); tensorboardX, einops, ninja and flashrnn (optional: without
#   them TensorBoard files come from the tensorboard package and the FlashRNN
#   rows say why they did not run). Make wheels/ where PyPI is reachable
#   (bash launch/gpu_wheels.sh) and copy the repository with it to the node.
#
# Writes OUT/gpu-results.md, OUT/gpu-results.json and the profile's two
# archives (and, where the caller set OUT, the call's log gpu-report.log):
# OUT=lab/notes by default, a folder under /tmp for --dry-run (its
# figures mean nothing). Where OUT has no gpu-results.json, the run starts
# from lab/notes/gpu-results.json (the previous call's, carried in the tree).
# PYTHON=... picks the interpreter (default: the first of python3 and python
# on PATH that imports jax, else python3).
set -euo pipefail
call_started=$(date +%s)  # the call's budget counts from here
cd "$(dirname "$0")/.."

usage() { sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//'; }

dry=""
budgets=""
install=1
[[ -n "${NO_INSTALL:-}" && "${NO_INSTALL}" != 0 ]] && install=0
stages=()
for arg in "$@"; do
  case "$arg" in
    --dry-run|--dry_run) dry="--dry_run" ;;
    --no-install|--no_install) install=0 ;;
    --budgets=*) budgets="$arg" ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "error: unknown option ${arg} (see bash $0 --help)" >&2; exit 2 ;;
    *) stages+=("$arg") ;;
  esac
done
csv=$(IFS=,; echo "${stages[*]:-}")
# An OUT given by the caller (a node's folder it sends back) also gets the
# call's whole log, written as it runs: a call killed at any second keeps it.
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu-report.log") 2>&1
fi

pick_python() {
  local name path
  for name in python3 python; do
    path=$(command -v "$name") || continue
    if "$path" -c "import jax" 2>/dev/null; then
      echo "$path"
      return
    fi
  done
  command -v python3 || command -v python || true
}
PYTHON=${PYTHON:-$(pick_python)}
if [[ -z "$PYTHON" ]]; then
  echo "error: no python on PATH (set PYTHON=...)" >&2
  exit 2
fi
echo "python: ${PYTHON}"
if [[ -n "$dry" ]]; then
  OUT=${OUT:-${TMPDIR:-/tmp}/zebra-gpu-report-dry-run}
else
  OUT=${OUT:-lab/notes}
fi
# Imports zebra_jax and the lab from this checkout, in every subprocess too.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# "JAX_VERSION PLUGIN", "-" for what is missing. A plugin module is enough;
# without one, a jaxlib built with CUDA shows as a gpu device.
probe='
import importlib.util
try:
  import jax
except Exception:
  print("- -"); raise SystemExit
found = [m for m in ("jax_cuda13_plugin", "jax_cuda12_plugin",
                     "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
         if importlib.util.find_spec(m.split(".")[0]) is not None
         and importlib.util.find_spec(m) is not None]
if not found:
  try:
    if jax.devices("gpu"):
      found = ["jaxlib-cuda"]
  except Exception:
    pass
print(jax.__version__, found[0] if found else "-")
'
read -r jax_version plugin < <("$PYTHON" -c "$probe" 2>/dev/null || echo "- -")

if [[ "$install" == 0 ]]; then
  echo "--no-install: nothing installed (jax ${jax_version}, CUDA plugin ${plugin})"
elif [[ "$jax_version" != "-" && "$plugin" != "-" ]]; then
  echo "jax ${jax_version} with CUDA plugin found (${plugin}): nothing installed"
elif [[ -n "$dry" ]]; then
  echo "dry run: jax ${jax_version} on the CPU, no CUDA jax installed"
else
  extra=${CUDA_EXTRA:-cuda13}
  echo "no CUDA jax (jax ${jax_version}, no CUDA plugin): installing .[${extra},bench]"
  "$PYTHON" -m pip install -q -e ".[${extra},bench]"
fi

# MODULE:DISTRIBUTION:required|optional, beyond a GPU node's stack; a
# distribution's needs before it.
for entry in ml_collections:ml-collections:required \
             tensorboardX:tensorboardX:optional \
             einops:einops:optional ninja:ninja:optional \
             flashrnn:flashrnn:optional; do
  IFS=: read -r module dist need <<< "$entry"
  if "$PYTHON" -c "import ${module}" 2>/dev/null; then
    continue
  fi
  wheel=$(find wheels -maxdepth 1 -iname "${dist//-/_}-*.whl" 2>/dev/null \
          | head -n 1 || true)
  if [[ "$install" == 1 && -n "$wheel" ]]; then
    echo "${module} from wheels/ ($(basename "$wheel"))"
    if ! "$PYTHON" -m pip install -q --no-index --find-links wheels "$dist"; then
      # a Python whose site-packages is read-only: a folder on PYTHONPATH
      echo "${module}: site-packages not writable, installed into wheels/site"
      "$PYTHON" -m pip install -q --no-index --find-links wheels \
        --target wheels/site "$dist" \
        || { [[ "$need" == optional ]] \
             && echo "${module}: not installed, its rows will say so"; } \
        || exit 1
      export PYTHONPATH="$PWD/wheels/site:$PYTHONPATH"
    fi
  elif [[ "$need" == optional ]]; then
    case "$module" in
      tensorboardX) echo "${module} missing: TensorBoard scalars through the tensorboard package, or none" ;;
      *) echo "${module} missing: the FlashRNN rows will say why they did not run" ;;
    esac
  else
    echo "error: ${module} missing and no ${dist} wheel in wheels/: run" \
         "bash launch/gpu_wheels.sh where PyPI is reachable and bring wheels/ here" >&2
    exit 1
  fi
done

stage_flag=${csv:+--stages=${csv}}
echo "=== gpu_report ${stage_flag:-(every stage)} ${dry} --out=${OUT}"
exec "$PYTHON" -m lab.gpu_report --out="$OUT" ${stage_flag} ${dry} \
  ${budgets} --call_started="$call_started"
