#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for `--multirun hydra/launcher=slurm` without a real cluster:
#   bash scripts/slurm_local.sh start [DIR]   # prints `export SLURM_CONF=...`: eval it, then sbatch/srun reach it
#   bash scripts/slurm_local.sh stop [DIR]    # cancels its jobs, stops its daemons, leaves DIR's logs
# From Debian's packages (apt-get install slurm-wlm munge); it installs nothing. munged, slurmctld and slurmd run
# as the current user (SlurmUser), with this machine's cores and memory as one CPU-only node, all their state in
# DIR (default: $TMPDIR/clo-slurm-<uid>) and ports picked free, so it touches no system Slurm or munge.
# No accounting database (slurmdbd needs MySQL): sacct fails, and the launcher reads job states from squeue.
set -euo pipefail
cmd=${1:-}
dir=${2:-${TMPDIR:-/tmp}/clo-slurm-$(id -u)}
PATH="$PATH:/usr/sbin:/sbin"  # the daemons are in sbin, which a non-root PATH may lack

die() { echo "error: $*" >&2; exit 2; }

need() {
  local missing=()
  for b in munged mungekey slurmctld slurmd sbatch srun squeue scontrol; do
    command -v "$b" > /dev/null || missing+=("$b")
  done
  [ ${#missing[@]} = 0 ] ||
    die "the local Slurm cluster needs ${missing[*]}: install Debian's packages (apt-get install slurm-wlm munge)"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop() {
  [ -f "$dir/slurm.conf" ] || return 0
  export SLURM_CONF="$dir/slurm.conf"
  if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2> /dev/null; then
    scancel --full --quiet --user="$(id -un)" 2> /dev/null || true  # its jobs' processes end with them
    for _ in $(seq 30); do [ -z "$(squeue -h -t running,completing 2> /dev/null)" ] && break; sleep 0.5; done
  fi
  for d in slurmd slurmctld munged; do  # only the daemons this script started: their pid files in $dir
    if [ -f "$dir/$d.pid" ]; then
      pid=$(cat "$dir/$d.pid")
      kill "$pid" 2> /dev/null || true
      for _ in $(seq 40); do kill -0 "$pid" 2> /dev/null || break; sleep 0.25; done
      rm -f "$dir/$d.pid"
    fi
  done
}

start() {
  need
  stop  # a cluster left in $dir by an earlier start
  user=$(id -un)
  node=$(hostname -s)
  mkdir -p "$dir"/{munge,ctld,spool}
  chmod 700 "$dir/munge"  # munged refuses a key or socket in a directory others can write
  [ -f "$dir/munge/munge.key" ] || mungekey --create --keyfile="$dir/munge/munge.key"
  chmod 600 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed"
  # the node as slurmd detects it (cores, sockets, memory): a node configured larger than it is would be drained
  hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
  cat > "$dir/slurm.conf" << EOF
ClusterName=clo-local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
# no cgroups (a container may not delegate them): processes tracked by parentage, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# a job that asks no memory gets 1 GB a core, not the whole node (which would keep the next job waiting)
DefMemPerCPU=1024
MpiDefault=none
ReturnToService=2
# a cancelled or timed-out job is killed 2 s after its SIGTERM (submitit ignores SIGTERM); finished jobs stay
# visible to squeue for 10 minutes, which is where the launcher reads their end states
KillWait=2
MinJobAge=600
NodeName=$node NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -c  # -c: a fresh cluster, whatever jobs an earlier one left in $dir/ctld
  slurmd
  for _ in $(seq 60); do
    state=$(sinfo -h -N -o %t 2> /dev/null || true)
    [ "$state" = idle ] && { echo "export SLURM_CONF=$SLURM_CONF"; return 0; }
    sleep 0.5
  done
  tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd.log "$dir"/munged.log >&2 || true
  stop
  die "the local Slurm cluster did not come up (node state: ${state:-none}); its logs are above and in $dir"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) die "usage: $0 start|stop [DIR]" ;;
esac
