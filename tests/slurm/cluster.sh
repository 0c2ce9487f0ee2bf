#!/usr/bin/env bash
# A real Slurm cluster on this one machine for the tests (Debian's slurmctld/slurmd/munge, run as root).
#   cluster.sh start DIR [NODES]   writes DIR/slurm.conf, starts munged, slurmctld and NODES slurmd (1 or 2);
#                                  prints SLURM_CONF=...
#   cluster.sh stop DIR            stops the daemons by their pid files and waits for them to exit
# One node is "localhost" (127.0.0.1). Two nodes are node1 and node2, two hosts as far as Slurm and the ranks can
# tell: each slurmd runs in a UTS namespace of its own (its tasks see their node's hostname), listens on its own
# loopback address (127.0.0.2, 127.0.0.3) and port, and the names resolve through /etc/hosts (entries added here
# when missing, and removed at stop). See tests/slurm/README.md.
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
  if [ -f "$dir/slurmctld.pid" ]; then  # jobs a failed test left running end first: their steps outlive slurmd
    export SLURM_CONF="$dir/slurm.conf"
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  for pidfile in "$dir"/slurmd-*.pid; do stop_pid "$pidfile"; done
  stop_pid "$dir/slurmctld.pid"
  [ -f "$dir/munged.ours" ] && stop_pid "$(cat "$dir/munged.ours")"  # only a munged this script started
  if [ -f "$dir/hosts.ours" ]; then  # only the /etc/hosts lines this script added
    grep -vxF -f "$dir/hosts.ours" /etc/hosts > "$dir/hosts.new" || true
    cat "$dir/hosts.new" > /etc/hosts && rm -f "$dir/hosts.ours" "$dir/hosts.new"
  fi
  exit 0
fi
nodes=${3:-1}
case $nodes in 1|2) ;; *) echo "NODES must be 1 or 2, not $nodes" >&2; exit 1 ;; esac

for tool in munged slurmctld slurmd sbatch scontrol unshare; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed (Debian: slurmctld slurmd slurm-client munge)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "the local cluster needs root (SlurmUser=root, munge)" >&2; exit 1; }
mkdir -p "$dir"/{state,log} /run/munge
chown munge:munge /run/munge  # munged runs as munge: its pid file goes here, not in a private temp dir
port=${SLURMD_PORT:-16818}
if [ "$nodes" = 1 ]; then
  names=(localhost); node_lines="NodeName=localhost NodeAddr=127.0.0.1 Port=$port CPUs=$(nproc) RealMemory=1000 State=UNKNOWN"
else
  names=(node1 node2); node_lines=""; cpus=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
  for i in 1 2; do
    address=127.0.0.$((i + 1))
    node_lines+="NodeName=node$i NodeAddr=$address Port=$((port + i - 1)) CPUs=$cpus RealMemory=1000 State=UNKNOWN"$'\n'
    if [ "$(getent hosts "node$i" | awk '{print $1}')" != "$address" ]; then
      getent hosts "node$i" >/dev/null && { echo "node$i resolves elsewhere here: $(getent hosts "node$i")" >&2; exit 1; }
      echo "$address node$i" | tee -a "$dir/hosts.ours" >> /etc/hosts
    fi
  done
fi
for name in "${names[@]}"; do mkdir -p "$dir/spool-$name"; done
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
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=$port
MinJobAge=300
$node_lines
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
for name in "${names[@]}"; do
  if [ "$name" = localhost ]; then
    slurmd -N localhost -f "$SLURM_CONF"
  else  # a host of its own name: slurmd and the tasks it starts see hostname $name
    unshare --uts sh -c "hostname $name && exec slurmd -N $name -f $SLURM_CONF"
  fi || { echo "slurmd $name did not start (see $dir/log/slurmd-$name.log)" >&2; exit 1; }
done
for _ in $(seq 100); do
  if [ "$(sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)')" = "$nodes" ]; then
    echo "SLURM_CONF=$SLURM_CONF"; exit 0
  fi
  sleep 0.2
done
echo "the nodes did not become idle within 20 s: $(sinfo -h -N 2>&1 | tr '\n' ' ')" >&2
exit 1
