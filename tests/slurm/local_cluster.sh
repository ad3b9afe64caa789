#!/usr/bin/env bash
# A one-node Slurm cluster on localhost, for the tests (tests/test_slurm.py) and by hand.
#
#   tests/slurm/local_cluster.sh start   install when missing (apt, as root), then start
#                                        munged, slurmctld and slurmd; wait until the node
#                                        is idle; print the line that points srun at it
#   tests/slurm/local_cluster.sh stop    cancel its jobs, end the daemons it started
#   tests/slurm/local_cluster.sh status  exit 0 when it answers, 1 when not
#   tests/slurm/local_cluster.sh env     print `export SLURM_CONF=...`
#
# Everything lives in MCRDL_SLURM_DIR (default /tmp/mcrdl-slurm): its slurm.conf, munge
# key and socket, spool, state, logs and pid files; nothing is written under /etc. Client
# commands find the cluster through SLURM_CONF=$MCRDL_SLURM_DIR/slurm.conf.
#
# The node declares more CPUs than the machine has (MCRDL_SLURM_CPUS, default 4 per core
# and at least 8), so that 4 to 8 tasks fit on 2 cores; tasks are not bound to CPUs
# (task/none), so ranks see every core and mcrdl finds the node oversubscribed.
#
# Environment: MCRDL_SLURM_DIR, MCRDL_SLURM_CPUS, MCRDL_SLURM_PORT (slurmctld's port;
# slurmd takes the next), MCRDL_SLURM_INSTALL=0 (never install), MCRDL_SLURM_WAIT_S
# (bound on each wait, default 60).
#
# Exit codes: 0 done; 2 Slurm cannot run here (not installed and not installable, or not
# root: slurmd must start tasks as their user); 1 a step failed (its log is named).
set -uo pipefail

DIR=${MCRDL_SLURM_DIR:-/tmp/mcrdl-slurm}
PORT=${MCRDL_SLURM_PORT:-6817}
WAIT_S=${MCRDL_SLURM_WAIT_S:-60}
CONF=$DIR/slurm.conf
NODE=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge)
export SLURM_CONF=$CONF

say() { echo "local_cluster: $*" >&2; }
cannot() { say "cannot run Slurm here: $*"; exit 2; }
fail() { say "FAILED: $*"; exit 1; }

# Whether the process of pid file $1 is alive (and is the program named $2).
alive() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  [ -z "${2:-}" ] || grep -qF "$2" "/proc/$pid/comm" 2>/dev/null
}

# Wait (at most WAIT_S seconds) until command "$@" succeeds.
wait_for() {
  local end=$((SECONDS + WAIT_S))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.5
  done
}

have_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v srun >/dev/null && command -v munged >/dev/null
}

install() {
  have_slurm && return 0
  [ "${MCRDL_SLURM_INSTALL:-1}" != 0 ] \
    || cannot "slurmctld, slurmd, srun or munged not found and MCRDL_SLURM_INSTALL=0"
  [ "$(id -u)" = 0 ] || cannot "slurmctld, slurmd, srun or munged not found; installing" \
    "them needs root (apt-get install ${PACKAGES[*]})"
  command -v apt-get >/dev/null || cannot "slurmctld, slurmd, srun or munged not found" \
    "and no apt-get to install them; install Slurm and munge with this system's packages"
  say "installing ${PACKAGES[*]} (apt-get)"
  local log=$DIR/install.log
  mkdir -p "$DIR"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      "${PACKAGES[@]}" >"$log" 2>&1; then
    say "apt-get install failed; updating the package lists and retrying"
    DEBIAN_FRONTEND=noninteractive apt-get update >>"$log" 2>&1 \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${PACKAGES[@]}" >>"$log" 2>&1 \
      || cannot "apt-get could not install ${PACKAGES[*]} (see $log)"
  fi
  have_slurm || cannot "installed ${PACKAGES[*]} but slurmctld, slurmd, srun or munged" \
    "is still missing (see $log)"
}

write_config() {
  local cores mem cpus
  cores=$(nproc --all)
  cpus=${MCRDL_SLURM_CPUS:-$((cores * 4 > 8 ? cores * 4 : 8))}
  # RealMemory in MiB, less a tenth for the system
  mem=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  mkdir -p "$DIR"/{spool,state,log,run}
  cat >"$CONF" <<EOF
# Written by tests/slurm/local_cluster.sh: one node, this host, oversubscribed.
ClusterName=mcrdl-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/run/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: processes tracked by their parentage, tasks not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
# Accounting without a database: finished jobs in a text file.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The MPI wheel's processes find each other through Slurm's PMI-2 server.
MpiDefault=pmi2
# A step whose task fails ends at once; SIGTERM then SIGKILL after 5 s (time limit,
# scancel); finished jobs stay visible to scontrol for 10 minutes.
KillOnBadExit=1
KillWait=5
MinJobAge=600
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

running() {
  alive "$DIR/run/munged.pid" munged && alive "$DIR/run/slurmctld.pid" slurmctld \
    && alive "$DIR/run/slurmd.pid" slurmd
}

node_idle() {
  sinfo -h -N -n "$NODE" -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc)'
}

start() {
  local t0=$SECONDS
  if running && node_idle; then
    say "already running ($DIR); node $NODE is up"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  install
  [ "$(id -u)" = 0 ] || cannot "slurmd must run as root to start tasks (run this as root)"
  stop_daemons quiet
  write_config

  # munge: a key of this cluster's own, its own socket (the system's munged, if any, is
  # left alone)
  if [ ! -s "$DIR/munge.key" ]; then
    (umask 077 && dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 2>/dev/null) \
      || fail "could not write the munge key $DIR/munge.key"
  fi
  chmod 0700 "$DIR/run"
  chmod 0400 "$DIR/munge.key"
  munged --force --key-file="$DIR/munge.key" --socket="$DIR/run/munge.socket" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/run/munged.seed" >"$DIR/log/munged.out" 2>&1 \
    || fail "munged did not start: $(tail -n 3 "$DIR/log/munged.out" "$DIR/log/munged.log" 2>/dev/null)"
  wait_for test -S "$DIR/run/munge.socket" || fail "munged's socket did not appear (see $DIR/log/munged.log)"

  slurmctld -f "$CONF" -i >"$DIR/log/slurmctld.out" 2>&1 \
    || fail "slurmctld did not start (see $DIR/log/slurmctld.log, $DIR/log/slurmctld.out)"
  wait_for scontrol ping || fail "slurmctld does not answer within ${WAIT_S} s (see $DIR/log/slurmctld.log)"
  slurmd -f "$CONF" -N "$NODE" >"$DIR/log/slurmd.out" 2>&1 \
    || fail "slurmd did not start (see $DIR/log/slurmd.log, $DIR/log/slurmd.out)"
  if ! wait_for node_idle; then
    fail "node $NODE is not idle after ${WAIT_S} s: $(sinfo -h -N -o '%t %E' 2>&1)" \
      "(see $DIR/log/slurmd.log)"
  fi
  say "started in $((SECONDS - t0)) s ($DIR); node $NODE: $(sinfo -h -N -o '%c CPUs, %m MiB')"
  echo "export SLURM_CONF=$CONF"
}

# End the daemons this script started (by their pid files), slurmd first.
stop_daemons() {
  local name pid end
  for name in slurmd slurmctld munged; do
    alive "$DIR/run/$name.pid" "$name" || continue
    pid=$(cat "$DIR/run/$name.pid")
    kill -TERM "$pid" 2>/dev/null
    end=$((SECONDS + WAIT_S))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      say "$name (pid $pid) did not end on SIGTERM; killing it"
      kill -KILL "$pid" 2>/dev/null
    fi
    [ "${1:-}" = quiet ] || say "stopped $name (pid $pid)"
  done
}

no_jobs() { [ -z "$(squeue -h -o %i 2>/dev/null)" ]; }
no_steps() { ! ls "$DIR/spool/$NODE"_* >/dev/null 2>&1; }

stop() {
  if alive "$DIR/run/slurmctld.pid" slurmctld && alive "$DIR/run/slurmd.pid" slurmd; then
    # Cancel the jobs first, so that slurmd ends their steps' processes.
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null)
    # shellcheck disable=SC2086
    [ -z "$jobs" ] || scancel --quiet $jobs 2>/dev/null
    wait_for no_jobs || say "jobs still listed after ${WAIT_S} s: $(squeue -h 2>&1)"
    # slurmstepd processes end with their steps (their sockets in the spool directory)
    wait_for no_steps || say "job steps still running after ${WAIT_S} s"
  fi
  stop_daemons
  say "stopped ($DIR)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) running && scontrol ping >/dev/null 2>&1 ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 64 ;;
esac
