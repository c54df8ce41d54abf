#!/usr/bin/env bash
# A Slurm cluster on one machine: NODES nodes, each a host of the network
# lab (scripts/netlab.sh) at 10.77.0.(i+1), running its own slurmd named
# nodeI; slurmctld runs on node0, munged on the machine (its socket is a
# file, which every namespace sees; started and stopped here if none runs).
# Debian's Slurm packages (slurmctld, slurmd, slurm-client, munge) and PMIx,
# installed when missing.
#
#   scripts/slurm_cluster.sh check                  exit 0 if a cluster can be made here, else say why and exit 77
#   scripts/slurm_cluster.sh run NODES -- COMMAND   make the cluster, run COMMAND on node0 with SLURM_CONF set
#                                                   (srun, sbatch, squeue reach the cluster), remove it (always)
#
# COMMAND also sees SLURM_LAB (the lab's name) and SLURM_DIR (the cluster's
# configuration, logs and state; gone afterwards). The cluster's partition is
# "lab"; every node has the machine's cores, so tasks share them.
# Needs root (network namespaces, daemons as root).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

die() { echo "slurm_cluster: $*" >&2; exit 1; }

install_slurm() {
  local missing=()
  for p in slurmctld slurmd slurm-client munge libpmix2; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "slurm_cluster: installing ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

check() {
  "$here/netlab.sh" check || return 77
  install_slurm || { echo "slurm_cluster: SKIPPED: cannot install Slurm's packages" >&2; return 77; }
}

# slurm.conf for NODES nodes, with everything under DIR.
write_conf() {
  local nodes=$1 dir=$2 cores
  cores=$(nproc)
  cat > "$dir/slurm.conf" <<EOF
ClusterName=lockstep
SlurmctldHost=$(hostname -s)(10.77.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/slurmctld.log
StateSaveLocation=$dir/state
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdSpoolDir=$dir/spool-%n
SlurmdLogFile=$dir/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=5
MinJobAge=60
SlurmdTimeout=30
EOF
  for ((i = 0; i < nodes; i++)); do
    echo "NodeName=node$i NodeAddr=10.77.0.$((i + 1)) CPUs=$cores RealMemory=1000 State=UNKNOWN" >> "$dir/slurm.conf"
  done
  echo "PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE" >> "$dir/slurm.conf"
  # slurmd starts its cgroup plugin whatever the tracking; this machine has cgroup v1.
  local version=v1
  [ "$(stat -f -c %T /sys/fs/cgroup)" = cgroup2fs ] && version=v2
  printf 'CgroupPlugin=cgroup/%s\nCgroupAutomount=no\n' "$version" > "$dir/cgroup.conf"
  mkdir -p "$dir/state"
}

# Inside the lab: the daemons, a wait until every node is idle, COMMAND.
inside() {
  local nodes=$1 dir=$2
  shift 2
  export SLURM_CONF=$dir/slurm.conf SLURM_LAB=$LAB SLURM_DIR=$dir
  # Every node resolves the others' names: `ip netns exec` mounts
  # /etc/netns/NAMESPACE/hosts over /etc/hosts (netlab.sh down removes them).
  for ((i = 0; i < nodes; i++)); do
    mkdir -p "/etc/netns/$LAB-h$i"
    { echo "127.0.0.1 localhost"; for ((j = 0; j < nodes; j++)); do echo "10.77.0.$((j + 1)) node$j"; done; } \
      > "/etc/netns/$LAB-h$i/hosts"
  done
  "$NETLAB" exec "$LAB" 0 slurmctld -D -i -f "$SLURM_CONF" > "$dir/slurmctld.out" 2>&1 &
  # Each node has a /tmp of its own, as separate machines do: PMIx keeps a
  # folder per step there, named by the job and step alone. A project
  # checked out under /tmp (its build, its .venv) stays visible on every
  # node, as a shared file system would keep it: its steps run from there.
  local root shared=""
  root=$(cd "$here/.." && pwd -P)
  case "$root/" in /tmp/?*) shared=${root#/tmp/} ;; esac
  for ((i = 0; i < nodes; i++)); do
    mkdir -p "$dir/spool-node$i" "$dir/tmp-node$i"
    chmod 1777 "$dir/tmp-node$i"
    [ -z "$shared" ] || mkdir -p "$dir/tmp-node$i/$shared"
    "$NETLAB" exec "$LAB" "$i" unshare -m sh -c '
      if [ -n "$4" ]; then mount --bind "/tmp/$4" "$1/$4" || exit 1; fi
      mount --rbind "$1" /tmp && exec slurmd -D -N "$2" -f "$3"' sh \
      "$dir/tmp-node$i" "node$i" "$SLURM_CONF" "$shared" > "$dir/slurmd-node$i.out" 2>&1 &
  done
  local idle=0 deadline=$((SECONDS + 30))
  while [ $SECONDS -lt $deadline ]; do
    idle=$("$NETLAB" exec "$LAB" 0 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l || true)
    [ "$idle" -ge "$nodes" ] && break
    sleep 0.1
  done
  if [ "$idle" -lt "$nodes" ]; then
    echo "slurm_cluster: only $idle of $nodes node(s) came up idle within 30 s; the daemons' logs:" >&2
    tail -n 20 "$dir"/*.log "$dir"/*.out >&2 || true
    return 1
  fi
  "$NETLAB" exec "$LAB" 0 env SLURM_CONF="$SLURM_CONF" SLURM_LAB="$LAB" SLURM_DIR="$dir" "$@"
}

stop_munged() {
  pkill -x munged || true
  for _ in $(seq 50); do pgrep -x munged > /dev/null || return 0; sleep 0.1; done
}

run() {
  local nodes=$1
  shift
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "run: give the command after --"
  [[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 8 ] || die "NODES must be 1 to 8, got '$nodes'"
  install_slurm
  local started_munge=0
  if ! munge -n > /dev/null 2>&1; then # no munged answers: one of this script's own, stopped at the end
    stop_munged # one on its way out
    mkdir -p /run/munge && chown munge:munge /run/munge && su -s /bin/sh munge -c munged
    started_munge=1
    for _ in $(seq 50); do munge -n > /dev/null 2>&1 && break; sleep 0.1; done # the daemons need it answering
  fi
  local dir
  dir=$(mktemp -d /var/tmp/lockstep-slurm.XXXXXX) # not under /tmp, which each node has its own of
  chmod 755 "$dir"
  write_conf "$nodes" "$dir"
  local status=0
  "$here/netlab.sh" run "$nodes" 10gbit -- "$here/slurm_cluster.sh" inside "$nodes" "$dir" "$@" || status=$?
  rm -rf "$dir"
  [ "$started_munge" -eq 0 ] || stop_munged
  return "$status"
}

case "${1:-}" in
  check) check ;;
  run) [ $# -ge 4 ] || die "usage: run NODES -- COMMAND..."; shift; run "$@" ;;
  inside) shift; inside "$@" ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
