#!/usr/bin/env bash
# A real one-node Slurm cluster on localhost, for tests and for trying the job scripts without an
# allocation. Everything it runs (munged, slurmctld, slurmd) lives in one folder of its own, with its
# own munge key and socket, so it never touches a system Slurm or munge.
#   tools/slurm/local_cluster.sh install          apt-get the Debian packages (root), if missing
#   tools/slurm/local_cluster.sh start DIR        write DIR/slurm.conf, start the daemons, wait for the node
#   tools/slurm/local_cluster.sh stop DIR         stop the daemons started in DIR
# Then: export SLURM_CONF=DIR/slurm.conf; sbatch / srun / squeue / scancel as usual.
# Jobs run as the user who started the cluster (root in CI).
set -euo pipefail

PACKAGES=(slurmd slurmctld slurm-client munge)

have_binaries() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && command -v mungekey >/dev/null
}

install() {
  if have_binaries; then return 0; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "local_cluster: Slurm is not installed and cannot be installed here (needs root and apt-get)" >&2
    return 1
  fi
  # Debian's package scripts try to start the system daemons; we start our own.
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null \
    || { echo "local_cluster: apt-get could not install ${PACKAGES[*]}" >&2; return 1; }
  have_binaries || { echo "local_cluster: ${PACKAGES[*]} installed, but slurmctld/slurmd/munged are not on PATH" >&2; return 1; }
}

write_conf() {
  local dir=$1 user
  user=$(id -un)
  mkdir -p "$dir/state" "$dir/spool" "$dir/logs"
  cat > "$dir/slurm.conf" <<EOF
# One node on localhost (tools/slurm/local_cluster.sh).
ClusterName=local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/logs/slurmctld.log
SlurmdLogFile=$dir/logs/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Finished jobs stay visible to scontrol for 10 minutes (the tests read their exit codes).
MinJobAge=600
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  local dir
  dir=$(mkdir -p "$1" && cd "$1" && pwd)
  have_binaries || { echo "local_cluster: Slurm is not installed (run: $0 install)" >&2; return 1; }
  chmod 700 "$dir"
  write_conf "$dir"
  [ -f "$dir/munge.key" ] || mungekey --create --keyfile="$dir/munge.key" >/dev/null
  chmod 600 "$dir/munge.key"
  # --force: munged refuses to run as root otherwise; the key and socket are this folder's own.
  munged --force --socket="$dir/munge.socket" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/logs/munged.log" --seed-file="$dir/munged.seed"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF" -N localhost
  local waited=0
  until sinfo --noheader --states=idle --format=%N 2>/dev/null | grep -q localhost; do
    waited=$((waited + 1))
    if [ "$waited" -gt 60 ]; then
      echo "local_cluster: the node did not come up within 60 s; logs in $dir/logs" >&2
      tail -5 "$dir"/logs/*.log >&2 || true
      stop "$dir"
      return 1
    fi
    sleep 1
  done
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
  local dir=$1 name pid
  for name in slurmd slurmctld munged; do
    if [ -f "$dir/$name.pid" ]; then
      pid=$(cat "$dir/$name.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/$name.pid"
    fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start "${2:?usage: $0 start DIR}" ;;
  stop) stop "${2:?usage: $0 stop DIR}" ;;
  *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
