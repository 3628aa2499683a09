#!/usr/bin/env bash
# Striped vs classic LSTM: time to perplexity at equal wall-clock, 3 seeds.
#   launch/compare_stripes.sh char|word [OUT] [--resume] [--flag=v ...]
# Settings: classic S=1, dense S=4,8 and grouped S=4,8,16 at hidden 256; grouped
# S=4,8,16 widened to the classic step time; parameter-matched classic LSTMs.
# 3.25 min per run on the embedded corpus (the demo config); the word level
# uses an adaptive head over 8,192 words, so that the recurrence is a real
# share of the step. Writes OUT/results.{md,json}, OUT/plan.json and
# OUT/valid_ppl_vs_time.png. OUT defaults to a new folder,
# runs/compare_stripes/LEVEL-DATE-TIME; an OUT holding an earlier sweep is
# refused unless --resume is given (then its finished runs are kept). Other
# flags go to python -m lab.experiments (e.g. --stripes=1,8 --no_classic).
set -euo pipefail
level=${1:-char}
shift $(( $# > 0 ? 1 : 0 ))
out=""
if [[ $# -gt 0 && "$1" != -* ]]; then
  out=$1
  shift
fi
resume=0
args=()
for arg in "$@"; do
  case "$arg" in
    --resume) resume=1 ;;
    *) args+=("$arg") ;;
  esac
done
out=${out:-runs/compare_stripes/$level-$(date +%Y%m%d-%H%M%S)}
if [[ -e "$out/results.json" && $resume == 0 ]]; then
  echo "error: $out holds an earlier sweep (results.json): add --resume to" \
       "continue it, or name a new OUT" >&2
  exit 2
fi
case "$level" in
  char) data=() ;;
  word) data=(--config.data.tokenizer=word --config.data.max_vocab_size=8192
              --config.model.head=adaptive "--config.model.adaptive_cutoffs=(1024,4096)") ;;
  *) echo "error: the level is char or word, not '$level'" >&2; exit 2 ;;
esac
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# The lab runs from this checkout (it is not part of the installed package).
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m lab.experiments --out="$out" --budget_minutes=3.25 \
    --seeds=0,1,2 --stripes=1,4,8 --grouped=4,8,16 --equal_time=4,8,16 \
    --config=demo ${data[@]+"${data[@]}"} ${args[@]+"${args[@]}"}
