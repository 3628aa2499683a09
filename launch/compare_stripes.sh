#!/usr/bin/env bash
# Dense stripes (S = 1, 4, 8), grouped stripes (S = 2, 4, 8) and parameter-matched
# classic LSTMs at equal wall-clock.
#   launch/compare_stripes.sh [OUT] [MINUTES_PER_RUN] [SEEDS] [--config=... --config.k=v ...]
#   launch/compare_stripes.sh runs/compare_stripes 0.5 0,1,2       # docs/stripes_vs_classic.md
#   launch/compare_stripes.sh runs/gpu 30 0,1,2 --config=configs/wt103.py \
#       --config.data.path=/data/wikitext-103                       # longer, on a GPU
# Writes OUT/results.md, OUT/results.json and OUT/valid_ppl_vs_time.png; rerun to resume.
set -euo pipefail
out=${1:-runs/compare_stripes}
minutes=${2:-1.5}
seeds=${3:-0,1,2}
shift $(( $# < 3 ? $# : 3 ))
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec python3 -m zebra_jax.tools.experiments --out="$out" --budget_minutes="$minutes" \
    --seeds="$seeds" --stripes=1,4,8 --grouped=2,4,8 "$@"
