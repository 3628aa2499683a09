#!/usr/bin/env bash
# Every GPU figure: installs the CUDA extras, then runs the report's stages,
# each as its own command (each fits in 10 minutes on one H100).
#
#   bash launch/gpu_report.sh                 # install + every stage
#   bash launch/gpu_report.sh bench wt103     # install + these stages
#   NO_INSTALL=1 bash launch/gpu_report.sh precision   # skip the install
#
# Writes docs/gpu-results.md and docs/gpu-results.json (OUT=dir to change);
# every stage adds its section, so stages can run in separate sessions.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs}
if [[ -z "${NO_INSTALL:-}" ]]; then
  python -m pip install -q -e ".[cuda12,bench]"
fi
stages=("$@")
if [[ ${#stages[@]} -eq 0 ]]; then
  stages=(bench wt103 precision infer scaling)
fi
status=0
for stage in "${stages[@]}"; do
  echo "=== gpu_report stage ${stage}"
  if ! timeout 600 python -m zebra_jax.tools.gpu_report --stage="${stage}" \
      --out="${OUT}"; then
    echo "=== stage ${stage} failed or ran past 10 minutes" >&2
    status=1
  fi
done
exit "${status}"
