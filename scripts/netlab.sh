#!/usr/bin/env bash
# A network lab on one machine: HOSTS "hosts", each a network namespace with
# one interface, eth0, at 10.77.0.(i+1), joined by a bridge in a switch
# namespace of their own. Each host's link is shaped by tc's tbf at RATE in
# both directions (the host's egress, and the switch port's towards it), as
# a full-duplex link to a switch. Nothing outside the lab's namespaces
# changes.
#
#   scripts/netlab.sh check                      exit 0 if this machine can make a lab, else say why and exit 77
#   scripts/netlab.sh run HOSTS RATE -- COMMAND  make a lab, run COMMAND, remove the lab (always, even when COMMAND
#                                                fails or the script is killed); COMMAND sees LAB (the lab's name),
#                                                LAB_HOSTS and LAB_RATE, and runs `scripts/netlab.sh exec "$LAB" I CMD`
#                                                to run CMD on host I
#   scripts/netlab.sh up HOSTS RATE NAME         make the lab NAME (at most 8 characters); `down NAME` removes it
#   scripts/netlab.sh exec NAME I COMMAND...     run COMMAND on host I of lab NAME, with GLOO_SOCKET_IFNAME=eth0
#   scripts/netlab.sh down NAME
#   scripts/netlab.sh list                       the labs that exist (a killed `up` leaves one: `down` it)
#
# RATE is tc's: 100mbit, 1gbit, 10gbit, optionally with a latency after a
# slash: 1gbit/100us, 10gbit/50us, 100mbit/2ms. The latency is added to every
# packet a host sends (so a round trip between two hosts gains twice it), by
# lockstep-netlab-delay behind an iptables NFQUEUE rule, since this kernel
# has no netem (Note [Latency without netem] in tools/netlab_delay.cpp);
# NETLAB_DELAY_BIN names the program, else LOCKSTEP_TORCH's build folder has
# it. Without one, a link's latency is the veth pair's and the bridge's own.
# Needs root and iproute2 (ip, tc); a latency also iptables.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

die() { echo "netlab: $*" >&2; exit 1; }

check() {
  local why=""
  if [ "$(id -u)" -ne 0 ]; then
    why="needs root (network namespaces and tc); this is uid $(id -u)"
  elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    why="needs iproute2 (ip and tc): apt-get install iproute2"
  elif ! ip netns add "lsck$$" 2>/dev/null; then
    why="cannot create a network namespace here (ip netns add failed)"
  else
    ip netns del "lsck$$"
  fi
  if [ -n "$why" ]; then
    echo "netlab: SKIPPED: $why" >&2
    return 77
  fi
}

# tbf's burst: a millisecond at the rate, and at least two 64 KiB segments
# (veth passes GSO segments whole; a smaller bucket would drop them).
burst_of() {
  local rate=$1 bits
  case "$rate" in
    *gbit) bits=$(( ${rate%gbit} * 1000000000 )) ;;
    *mbit) bits=$(( ${rate%mbit} * 1000000 )) ;;
    *) die "rate $rate: give it as Nmbit or Ngbit (for example 1gbit)" ;;
  esac
  local bytes=$(( bits / 8 / 1000 ))
  echo $(( bytes > 131072 ? bytes : 131072 ))
}

shape() { # NAMESPACE DEVICE RATE
  tc -n "$1" qdisc add dev "$2" root tbf rate "$3" burst "$(burst_of "$3")" latency 100ms
}

# A profile's latency in microseconds: 0 for "1gbit", 100 for "1gbit/100us",
# 2000 for "1gbit/2ms".
delay_us_of() {
  local profile=$1
  [[ "$profile" == */* ]] || { echo 0; return; }
  local delay=${profile#*/}
  case "$delay" in
    *us) [[ "${delay%us}" =~ ^[0-9]+$ ]] && { echo "${delay%us}"; return; } ;;
    *ms) [[ "${delay%ms}" =~ ^[0-9]+$ ]] && { echo $(( ${delay%ms} * 1000 )); return; } ;;
  esac
  die "latency '$delay' in '$profile': give it as Nus or Nms (for example 1gbit/100us)"
}

delay_bin() {
  local bin=${NETLAB_DELAY_BIN:-}
  if [ -z "$bin" ]; then
    bin=$(cd "$here/.." && source scripts/config.sh && echo "$PWD/$build_dir/lockstep-netlab-delay")
  fi
  [ -x "$bin" ] || die "a latency needs lockstep-netlab-delay, not found at $bin: build it (it needs libnetfilter-queue-dev, which scripts/setup.sh installs) or set NETLAB_DELAY_BIN"
  command -v iptables-legacy >/dev/null || die "a latency needs iptables: apt-get install iptables"
  echo "$bin"
}

# Holds every packet host NAMESPACE sends on eth0 for US microseconds: the
# program first, then the rule that queues packets to it (a rule with no
# program bound would drop them).
delay() { # NAMESPACE US BIN
  local log="/tmp/netlab-$1.delay"
  ip netns exec "$1" setsid "$3" 0 "$2" > "$log" 2>&1 < /dev/null &
  local pid=$! i
  disown "$pid" # down kills it; no "Killed" from this shell then
  for i in $(seq 100); do
    grep -q "lockstep-netlab-delay: queue" "$log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || die "the delay of host $1 did not start: $(cat "$log")"
    sleep 0.05
  done
  grep -q "lockstep-netlab-delay: queue" "$log" || die "the delay of host $1 did not start within 5 s"
  ip netns exec "$1" iptables-legacy -w -A OUTPUT -o eth0 -j NFQUEUE --queue-num 0
}

up() {
  local hosts=$1 rate=${2%%/*} name=$3 us bin=""
  [[ "$hosts" =~ ^[0-9]+$ ]] && [ "$hosts" -ge 1 ] && [ "$hosts" -le 16 ] || die "HOSTS must be 1 to 16, got '$hosts'"
  [ "${#name}" -le 8 ] || die "lab name '$name' is longer than 8 characters"
  burst_of "$rate" >/dev/null
  us=$(delay_us_of "$2")
  [ "$us" -eq 0 ] || bin=$(delay_bin)
  ip netns add "$name-sw"
  ip -n "$name-sw" link add br0 type bridge
  ip -n "$name-sw" link set br0 up
  ip -n "$name-sw" link set lo up
  for ((i = 0; i < hosts; i++)); do
    ip netns add "$name-h$i"
    ip link add eth0 netns "$name-h$i" type veth peer name "p$i" netns "$name-sw"
    ip -n "$name-sw" link set "p$i" master br0 up
    ip -n "$name-h$i" link set lo up
    ip -n "$name-h$i" addr add "10.77.0.$((i + 1))/24" dev eth0
    ip -n "$name-h$i" link set eth0 up
    shape "$name-h$i" eth0 "$rate"
    shape "$name-sw" "p$i" "$rate"
    [ -z "$bin" ] || delay "$name-h$i" "$us" "$bin"
  done
}

down() {
  local name=$1 ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(sw|h[0-9]+)$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns"
    # the files a host mounts over /etc (scripts/slurm_cluster.sh), and its delay's log
    rm -rf "/etc/netns/$ns" "/tmp/netlab-$ns.delay"
  done
}

exec_on() {
  local name=$1 host=$2
  shift 2
  ip netns list | grep -q "^$name-h$host\b" || die "lab $name has no host $host"
  exec ip netns exec "$name-h$host" env GLOO_SOCKET_IFNAME=eth0 "$@"
}

# Labs that `run` made for a process that is gone (killed with SIGKILL,
# which no trap sees): removed before the next lab is made.
remove_orphans() {
  local lab
  for lab in $(ip netns list | awk '{print $1}' | sed -n 's/^\(ls[0-9]*\)-sw$/\1/p'); do
    kill -0 "${lab#ls}" 2>/dev/null || down "$lab"
  done
}

run() {
  local hosts=$1 rate=$2 status=0
  shift 2
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "run: give the command after --"
  remove_orphans
  lab="ls$$" # global: the traps run after run() has returned
  child=""
  trap 'down "$lab"' EXIT
  trap '[ -n "$child" ] && kill "$child" 2>/dev/null; exit 143' TERM INT
  up "$hosts" "$rate" "$lab"
  # In the background, so that a signal's trap runs at once, not after it.
  LAB=$lab LAB_HOSTS=$hosts LAB_RATE=$rate NETLAB="$here/netlab.sh" "$@" &
  child=$!
  wait "$child" || status=$?
  return "$status"
}

case "${1:-}" in
  check) check ;;
  up) [ $# -eq 4 ] || die "usage: up HOSTS RATE NAME"; up "$2" "$3" "$4" ;;
  down) [ $# -eq 2 ] || die "usage: down NAME"; down "$2" ;;
  exec) [ $# -ge 4 ] || die "usage: exec NAME HOST COMMAND..."; shift; exec_on "$@" ;;
  run) [ $# -ge 4 ] || die "usage: run HOSTS RATE -- COMMAND..."; shift; run "$@" ;;
  list) ip netns list | awk '{print $1}' | sed -n 's/-sw$//p' ;;
  *) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
