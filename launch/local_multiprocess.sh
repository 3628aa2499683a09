#!/usr/bin/env bash
# Several JAX processes on this machine talking over 127.0.0.1: the multi-host
# code path (jax.distributed, per-process data slices, one global mesh) on CPU.
#   launch/local_multiprocess.sh 2 4 demo:tiny /tmp/mp [--config.x=y ...]
# runs 2 processes with 4 emulated CPU devices each (8 devices in the mesh).
set -euo pipefail
nproc=${1:?usage: launch/local_multiprocess.sh NUM_PROCESSES DEVICES_PER_PROCESS CONFIG WORKDIR [flags...]}
ndev=${2:?devices per process}
config=${3:?config}
workdir=${4:?workdir}
shift 4
port=${ZEBRA_COORDINATOR_PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((i = 0; i < nproc; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$ndev" \
    python3 -m zebra_jax.main --config="$config" --workdir="$workdir" \
      --coordinator_address="127.0.0.1:$port" --num_processes="$nproc" \
      --process_id="$i" "$@" &
  pids+=($!)
done
# A signal to this script reaches every process (Ctrl-C reaches them anyway):
# they agree on a step, save there and exit 75 (stopped early); rerun to
# resume.
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
trap 'kill -INT "${pids[@]}" 2>/dev/null' INT
status=0
for pid in "${pids[@]}"; do
  # A trapped signal ends `wait` early (status > 128): wait until it exits.
  while :; do
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  ((rc == 0)) || status=$rc
done
exit $status
