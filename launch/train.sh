#!/usr/bin/env bash
# Single node, every local GPU: JAX sees all devices and the batch is split over them.
#   launch/train.sh wt103 runs/wt103 --config.data.path=/data/wikitext-103
set -euo pipefail
config=${1:?usage: launch/train.sh CONFIG WORKDIR [--config.x=y ...]}
workdir=${2:?usage: launch/train.sh CONFIG WORKDIR [--config.x=y ...]}
shift 2
# Let XLA take GPU memory as needed rather than 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec python3 -m zebra_jax.main --config="$config" --workdir="$workdir" "$@"
