#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests and for trying `diloco sweep --launch slurm`:
# munged + slurmctld + slurmd from Debian's slurm-wlm (apt-get install slurm-wlm), run as root.
#
#   scripts/slurm_local.sh start DIR   writes DIR/slurm.conf, starts the daemons, waits until the node is idle;
#                                      prints `export SLURM_CONF=DIR/slurm.conf` (sbatch/srun/squeue read it)
#   scripts/slurm_local.sh stop DIR    stops the daemons started from DIR (nothing else)
#
# Partition `debug` (default) and `tiny` (max 1 CPU, for "would not fit" tests); the node has this
# machine's CPUs. No cgroups (proctrack/linuxproc): it runs inside containers.
set -euo pipefail
cmd=${1:?start|stop}; dir=$(realpath -m "${2:?state folder}")
case $cmd in
stop)
  for d in slurmd slurmctld munged; do
    [ -f "$dir/$d.pid" ] && kill "$(cat "$dir/$d.pid")" 2>/dev/null || true
  done
  exit 0 ;;
start) ;;
*) echo "slurm_local.sh: unknown command '$cmd' (start|stop)" >&2; exit 2 ;;
esac
for b in munged slurmctld slurmd sbatch; do
  command -v "$b" >/dev/null || { echo "slurm_local.sh: $b not found: apt-get install slurm-wlm" >&2; exit 3; }
done
[ "$(id -u)" = 0 ] || { echo "slurm_local.sh: run as root (slurmd starts jobs as their users)" >&2; exit 3; }
mkdir -p "$dir"/{spool,state,log,munge}
host=$(hostname -s); cpus=$(nproc); mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
[ -f "$dir/munge/munge.key" ] || { head -c 1024 /dev/urandom > "$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"; }
cat > "$dir/slurm.conf" <<CONF
ClusterName=diloco-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=${SLURM_LOCAL_PORT:-6817}
SlurmdPort=$(( ${SLURM_LOCAL_PORT:-6817} + 1 ))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
MpiDefault=none
PlugStackConfig=/dev/null
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=tiny Nodes=$host MaxCPUsPerNode=1 MaxTime=60 State=UP
CONF
munged --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" -f
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  if sinfo -h -o %T -p debug 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    echo "export SLURM_CONF=$SLURM_CONF"; exit 0
  fi
  sleep 0.5
done
echo "slurm_local.sh: the node did not come up in 30 s; logs in $dir/log" >&2; exit 1
