#!/usr/bin/env bash
# A single-node SLURM (munged + slurmctld + slurmd) with all its files in
# one folder, for trying kqsvd's job scripts on a workstation and for the
# tests.  Needs Debian's slurm-wlm and munge; run as root (or a user who may
# start the daemons).
#
#   slurm/local-cluster.sh start DIR    # prints: export SLURM_CONF=DIR/slurm.conf
#   slurm/local-cluster.sh stop DIR     # stops the daemons by their pid files
#
# Ports come from the folder's path, so two folders can run side by side.
set -euo pipefail
cmd=${1:-} dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

stop() {
  for f in slurmd slurmctld munged; do
    if [ -f "$dir/$f.pid" ]; then
      pid=$(cat "$dir/$f.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/$f.pid"
    fi
  done
}

case $cmd in
  stop) stop; exit 0 ;;
  start) ;;
  *) echo "local-cluster.sh: unknown command '$cmd' (start or stop)" >&2; exit 2 ;;
esac

for p in munged slurmctld slurmd sbatch; do
  command -v "$p" >/dev/null || [ -x "/usr/sbin/$p" ] || {
    echo "local-cluster.sh: $p not found (Debian: apt-get install slurm-wlm munge)" >&2; exit 1; }
done
export PATH=$PATH:/usr/sbin
stop
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
host=$(hostname -s)
cpus=$(nproc)
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
port=$(( 20000 + $(printf '%s' "$dir" | cksum | cut -d' ' -f1) % 20000 ))
user=$(id -un)

if [ ! -f "$dir/munge.key" ]; then
  dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$dir/munge.key"
fi
trap 'echo "local-cluster.sh: start failed; stopping what started" >&2; stop' ERR
munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" \
  --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge.seed"

cat > "$dir/slurm.conf" <<CONF
ClusterName=kqsvd-local
SlurmctldHost=$host
SlurmUser=$user
SlurmdUser=$user
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.2
done
echo "local-cluster.sh: the node did not come up; see $dir/log" >&2
sinfo >&2 || true
stop
exit 1
