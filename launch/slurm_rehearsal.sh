#!/usr/bin/env bash
# Rehearses the cluster path on this machine under a real SLURM:
#
#   sudo bash launch/slurm_rehearsal.sh      # about 7 min on 2 loaded CPU cores
#
# 1. SLURM: reuses one that answers `sinfo` (SLURM_CONF as set), else, as
#    root, installs Debian's slurm-wlm and munge if missing and starts a
#    cluster of two emulated nodes on 127.0.0.1: slurmctld, `slurmd -N n1`
#    and `slurmd -N n2` on their own ports, n1 and n2 in /etc/hosts (jax
#    finds its coordinator by the first node's name), a partition `low`
#    with GraceTime=60 that a partition `high` preempts (PreemptMode=REQUEUE).
#    Its files live in $REHEARSAL_DIR/slurm.
# 2. Submits the repository's launch/slurm.sbatch as the docs say, for a CPU
#    cluster: sbatch --nodes=2 --cpus-per-task=2 launch/slurm.sbatch
#    demo:tiny WORKDIR ..., two emulated CPU devices per task
#    (XLA_FLAGS), the python named by ZEBRA_JAX_PYTHON (default: python3 on
#    PATH) with this checkout first on PYTHONPATH. One workdir, one planned
#    end ($REHEARSAL_STEPS steps), four interruptions of the same run:
#      - scancel --signal=TERM: every task saves, the job ends FAILED 75:0
#        (stopped early) and is not requeued;
#      - the same sbatch command again resumes at the saved step;
#      - scontrol requeue: the job goes back in the queue and resumes;
#      - a job in `high` preempts it: with the grace time the tasks save,
#        the script requeues the job, it resumes at the saved step
#    and the job ends COMPLETED 0:0 at the planned step, every run on 4
#    devices of one jax.distributed run, metrics.jsonl strict JSON.
#    Requeued jobs wait ~2 min before SLURM starts them again; the rehearsal
#    lifts that wait (scontrol update StartTime=now) to finish sooner.
# 3. Cancels its jobs and stops only the daemons it started (by pid), and
#    removes the /etc/hosts line it added; REHEARSAL_KEEP=1 leaves the
#    cluster up (SLURM_CONF=$REHEARSAL_DIR/slurm/slurm.conf to use it; a
#    later rehearsal reuses it).
#
# Every wait has a time limit (REHEARSAL_TIMEOUT seconds each, default 300).
# Exits 0 when every check passed, 1 when one failed, 2 when it cannot start.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${REHEARSAL_DIR:-/tmp/zebra-slurm-rehearsal}
steps=${REHEARSAL_STEPS:-600}
limit=${REHEARSAL_TIMEOUT:-300}
port=${REHEARSAL_PORT:-16817}  # slurmctld; the two slurmd use the next two
high=${REHEARSAL_HIGH_PARTITION:-high}
python=${ZEBRA_JAX_PYTHON:-$(command -v python3 || true)}
conf_dir="$dir/slurm" jobs_dir="$dir/jobs" workdir="$dir/run"
started_pids=() submitted=() added_hosts=0
failures=0

say() { echo "== $*"; }
die() { echo "error: $*" >&2; exit 2; }
s() { timeout 30 "$@"; }  # a SLURM client call that cannot hang

# ---------------------------------------------------------------- cluster
write_conf() {
  mkdir -p "$conf_dir/state" "$conf_dir/n1" "$conf_dir/n2" "$conf_dir/log"
  cat > "$conf_dir/slurm.conf" <<EOF
# Two emulated nodes on 127.0.0.1 (launch/slurm_rehearsal.sh)
ClusterName=zebra-rehearsal
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$conf_dir/state
SlurmdSpoolDir=$conf_dir/%n
SlurmctldPidFile=$conf_dir/slurmctld.pid
SlurmdPidFile=$conf_dir/slurmd-%n.pid
SlurmctldLogFile=$conf_dir/log/slurmctld.log
SlurmdLogFile=$conf_dir/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
KillWait=30
MinJobAge=3600
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 1)) CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=2 State=UNKNOWN
PartitionName=low Nodes=n1,n2 Default=YES PriorityTier=1 GraceTime=60 MaxTime=INFINITE State=UP
PartitionName=$high Nodes=n1,n2 PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP
EOF
}

start_daemon() {  # pidfile, command...: starts it, records its pid
  local pidfile=$1; shift
  rm -f "$pidfile"
  "$@"
  for _ in $(seq 50); do [[ -s "$pidfile" ]] && break; sleep 0.2; done
  [[ -s "$pidfile" ]] || die "$* did not start (logs in $conf_dir/log)"
  started_pids+=("$(cat "$pidfile")")
}

start_cluster() {
  [[ $EUID == 0 ]] || die "no SLURM answers sinfo and only root can start \
one: run as root, or point SLURM_CONF at a running cluster"
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge (apt)"
    timeout 600 apt-get update -qq
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq \
      slurm-wlm munge >/dev/null
  fi
  if ! timeout 5 munge -n </dev/null >/dev/null 2>&1; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    [[ -s /etc/munge/munge.key ]] || timeout 30 mungekey --create
    start_daemon /run/munge/munged.pid runuser -u munge -- /usr/sbin/munged
  fi
  if ! getent hosts n1 >/dev/null || ! getent hosts n2 >/dev/null; then
    echo "127.0.0.1 n1 n2  # zebra-slurm-rehearsal" >> /etc/hosts
    added_hosts=1
  fi
  write_conf
  export SLURM_CONF="$conf_dir/slurm.conf"
  say "starting slurmctld and slurmd n1, n2 ($SLURM_CONF)"
  start_daemon "$conf_dir/slurmctld.pid" slurmctld -f "$SLURM_CONF" -i
  for node in n1 n2; do
    start_daemon "$conf_dir/slurmd-$node.pid" slurmd -f "$SLURM_CONF" -N "$node"
  done
  for _ in $(seq 60); do
    [[ "$(s sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" == 2 ]] \
      && return
    sleep 1
  done
  die "the two nodes did not come up idle (logs in $conf_dir/log)"
}

cleanup() {
  local status=$?
  for job in "${submitted[@]}"; do s scancel "$job" 2>/dev/null || true; done
  if [[ "${REHEARSAL_KEEP:-0}" == 1 ]]; then
    ((${#started_pids[@]})) && say "cluster left running: SLURM_CONF=$SLURM_CONF"
    exit "$status"
  fi
  if ((${#started_pids[@]})); then
    sleep 2  # let the cancelled steps go before their slurmd
    # Reverse order: slurmd before slurmctld, munged last.
    for ((i = ${#started_pids[@]} - 1; i >= 0; i--)); do
      kill -TERM "${started_pids[i]}" 2>/dev/null || true
      for _ in $(seq 50); do
        kill -0 "${started_pids[i]}" 2>/dev/null || break
        sleep 0.2
      done
      kill -KILL "${started_pids[i]}" 2>/dev/null || true
    done
    say "stopped the daemons it started"
  fi
  if ((added_hosts)); then
    sed -i '/# zebra-slurm-rehearsal$/d' /etc/hosts
  fi
  exit "$status"
}
trap cleanup EXIT

# ---------------------------------------------------------------- jobs
field() {  # job, field name: its value in scontrol show job
  s scontrol show job "$1" 2>/dev/null \
    | grep -o "\(^\|[[:space:]]\)$2=[^[:space:]]*" | head -1 | cut -d= -f2
}
job_log() { echo "$jobs_dir/zebra_jax-$1.out"; }
wait_for() {  # description, command...: until the command succeeds
  local what=$1; shift
  local deadline=$((SECONDS + limit))
  until "$@"; do
    if ((SECONDS > deadline)); then
      echo "error: waited ${limit} s for $what" >&2
      return 1
    fi
    sleep 2
  done
}
last_train_step() {  # the workdir's latest logged train step, else 0
  "$python" - "$workdir/metrics.jsonl" <<'EOF' 2>/dev/null || echo 0
import json, sys
steps = [r["step"] for r in map(json.loads, open(sys.argv[1]))
         if r["kind"] == "train"]
print(steps[-1] if steps else 0)
EOF
}
trained_past() { (($(last_train_step) >= $1)); }
is_state() { [[ " ${*:2} " == *" $(field "$1" JobState) "* ]]; }
log_has() { [[ -f "$(job_log "$1")" ]] && grep -q -- "$2" "$(job_log "$1")"; }
lift_requeue_wait() {  # a requeued job waits ~2 min: start it now
  if is_state "$1" PENDING && [[ "$(field "$1" Reason)" == BeginTime ]]; then
    s scontrol update JobId="$1" StartTime=now >/dev/null 2>&1 || true
  fi
  is_state "$1" RUNNING COMPLETED
}
resumed_at() {  # job: the step its latest run resumed at, else empty
  grep -o "resuming from checkpoint at step [0-9]*" "$(job_log "$1")" \
    | tail -1 | grep -o "[0-9]*$"
}
stopped_at() {  # the step of the workdir's latest summary record
  "$python" - "$workdir/metrics.jsonl" <<'EOF'
import json, sys
print([r for r in map(json.loads, open(sys.argv[1]))
       if r["kind"] == "summary"][-1]["steps"])
EOF
}
check() {  # name, condition text, command...
  local name=$1 detail=$2; shift 2
  if "$@"; then
    printf '%-46s %-4s %s\n' "$name" yes "$detail"
  else
    printf '%-46s %-4s %s\n' "$name" NO "$detail"
    failures=$((failures + 1))
  fi
}
restarted() { local n; n=$(field "$1" Restarts); ((${n:-0} >= $2)); }
resumed_times() {  # job, n: its log shows at least n resumed runs
  local n; n=$(grep -c "resuming from checkpoint" "$(job_log "$1")")
  ((${n:-0} >= $2))
}
submit() {  # variable, sbatch arguments...: submits, sets the variable to
  local id  # the job id
  id=$(cd "$jobs_dir" && s sbatch --parsable "${@:2}") \
    || die "sbatch ${*:2} failed"
  id=${id%%;*}
  submitted+=("$id")
  printf -v "$1" %s "$id"
}

# ---------------------------------------------------------------- main
began=$SECONDS
[[ -n "$python" ]] || die "no python3 on PATH: set ZEBRA_JAX_PYTHON"
if s sinfo -h >/dev/null 2>&1; then
  say "reusing the SLURM that answers sinfo (${SLURM_CONF:-default config})"
else
  start_cluster
fi
rm -rf "$workdir" "$jobs_dir"
mkdir -p "$jobs_dir"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" ZEBRA_JAX_PYTHON="$python"
export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2
# The submission the docs give for CPU nodes, plus a time limit that keeps
# the time-limit requeue out of these checks.
command=(--nodes=2 --cpus-per-task=2 --time=30 "$repo/launch/slurm.sbatch"
         demo:tiny "$workdir" --config.train.num_steps="$steps"
         --config.train.log_every=25 --config.train.eval_every=$((steps / 2))
         --config.checkpoint.every_steps=$((steps / 2)))
gap=$((steps / 6))  # steps trained between interruptions

say "1/4 a 2-node run, stopped with scancel --signal=TERM"
submit a "${command[@]}"
wait_for "job $a to train $gap steps" trained_past "$gap"
s scancel --signal=TERM "$a"
wait_for "job $a to end" is_state "$a" FAILED COMPLETED CANCELLED TIMEOUT
term_step=$(stopped_at)
check "TERM: saved, FAILED 75:0, not requeued" \
  "job $a: $(field "$a" JobState) $(field "$a" ExitCode), step $term_step" \
  test "$(field "$a" JobState) $(field "$a" ExitCode) $(field "$a" Restarts)" \
  == "FAILED 75:0 0"
check "one jax.distributed run on 4 devices" "job $a" \
  log_has "$a" "4 cpu device(s)"

say "2/4 the same command again, then scontrol requeue"
submit b "${command[@]}"
wait_for "job $b to resume" log_has "$b" "resuming from checkpoint"
check "resubmission resumes at the saved step" \
  "job $b: step $(resumed_at "$b") (saved $term_step)" \
  test "$(resumed_at "$b")" == "$term_step"
wait_for "job $b to train" trained_past $((term_step + gap))
s scontrol requeue "$b"
wait_for "job $b to be requeued" restarted "$b" 1
wait_for "job $b to start again" lift_requeue_wait "$b"
wait_for "job $b to resume" resumed_times "$b" 2
requeue_step=$(resumed_at "$b")
check "scontrol requeue: requeued and resumed" \
  "job $b: restart $(field "$b" Restarts), step $requeue_step" \
  test "$requeue_step" -ge "$term_step"

say "3/4 preempted by a job in partition $high (GraceTime 60)"
if [[ -z "$(s sinfo -h -p "$high" -o %P 2>/dev/null)" ]]; then
  check "preemption with grace time" "skipped: no partition $high" false
else
  wait_for "job $b to train" trained_past $((requeue_step + gap))
  submit h -p "$high" --nodes=2 --time=5 --wrap "sleep 5"
  wait_for "job $b to be preempted and requeued" restarted "$b" 2
  preempt_step=$(stopped_at)
  check "preempted: saved, exit 75, script requeued" \
    "job $b: step $preempt_step" \
    log_has "$b" "stopped early (preempted), checkpoint saved: requeueing"
  wait_for "job $h to end" is_state "$h" COMPLETED FAILED CANCELLED
  wait_for "job $b to start again" lift_requeue_wait "$b"
  wait_for "job $b to resume" resumed_times "$b" 3
  check "preempted job resumed at the saved step" \
    "job $b: step $(resumed_at "$b") (saved $preempt_step)" \
    test "$(resumed_at "$b")" == "$preempt_step"
fi

say "4/4 the run reaches its planned end"
wait_for "job $b to end" is_state "$b" COMPLETED FAILED CANCELLED TIMEOUT
check "COMPLETED 0:0 at the planned step" \
  "job $b: $(field "$b" JobState) $(field "$b" ExitCode), step $(stopped_at)" \
  test "$(field "$b" JobState) $(field "$b" ExitCode) $(stopped_at)" \
  == "COMPLETED 0:0 $steps"
check "every run on 4 devices" "job $b" \
  test "$(grep -c "4 cpu device(s)" "$(job_log "$b")")" -ge 3
check "metrics.jsonl is strict JSON" "$workdir/metrics.jsonl" \
  "$python" -c "import json, sys; [json.loads(l, parse_constant=lambda c: \
1 / 0) for l in open(sys.argv[1])]" "$workdir/metrics.jsonl"
echo "job logs: $jobs_dir"
((failures == 0)) || { echo "error: $failures check(s) failed" >&2; exit 1; }
say "all checks passed in $((SECONDS - began)) s"
