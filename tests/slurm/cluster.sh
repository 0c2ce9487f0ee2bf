#!/usr/bin/env bash
# A real one-node Slurm cluster on localhost for the tests (Debian's slurmctld/slurmd/munge, run as root).
#   cluster.sh start DIR   writes DIR/slurm.conf, starts munged, slurmctld and slurmd; prints SLURM_CONF=...
#   cluster.sh stop DIR    stops the daemons by their pid files and waits for them to exit
# Exits non-zero, with the reason on stderr, when the cluster cannot be started here.
set -euo pipefail
action=${1:?start or stop}; dir=$(realpath -m "${2:?state directory}")

stop_pid() {  # stop the daemon whose pid file is $1, waiting up to 10 s
  [ -f "$1" ] || return 0
  local pid; pid=$(cat "$1"); kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true; rm -f "$1"
}

if [ "$action" = stop ]; then
  stop_pid "$dir/slurmd.pid"; stop_pid "$dir/slurmctld.pid"
  [ -f "$dir/munged.ours" ] && stop_pid "$(cat "$dir/munged.ours")"  # only a munged this script started
  exit 0
fi

for tool in munged slurmctld slurmd sbatch scontrol; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed (Debian: slurmctld slurmd slurm-client munge)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "the local cluster needs root (SlurmUser=root, munge)" >&2; exit 1; }
mkdir -p "$dir"/{state,spool,log} /run/munge
chown munge:munge /run/munge  # munged runs as munge: its pid file goes here, not in a private temp dir
cpus=$(nproc)
cat > "$dir/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5  # a requeued job waits this long before it may start again (default 120 s)
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MailProg=/bin/true
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"
if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  echo "using the munged already running" >&2  # e.g. the system's; not ours to stop
else
  runuser -u munge -- munged --pid-file=/run/munge/munged.tests.pid --socket=/run/munge/munge.socket.2 \
    2>"$dir/log/munged.err" || { echo "munged did not start: $(cat "$dir/log/munged.err")" >&2; exit 1; }
  echo /run/munge/munged.tests.pid > "$dir/munged.ours"
fi
slurmctld -f "$SLURM_CONF" || { echo "slurmctld did not start (see $dir/log/slurmctld.log)" >&2; exit 1; }
slurmd -N localhost -f "$SLURM_CONF" || { echo "slurmd did not start (see $dir/log/slurmd.log)" >&2; exit 1; }
for _ in $(seq 100); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then echo "SLURM_CONF=$SLURM_CONF"; exit 0; fi
  sleep 0.2
done
echo "the node did not become idle within 20 s: $(sinfo -h 2>&1 | head -1)" >&2
exit 1
