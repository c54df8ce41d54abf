#!/usr/bin/env bash
# The network lab's latency (scripts/netlab.sh RATE/DELAY, Note [Latency
# without netem]): two hosts at 1 Gb/s, a small allreduce across the link
# (lockstep's agreement round trip, then Gloo's exchanges) with no added
# latency and with 2 ms on every packet sent. Each of the two needs at least
# one round trip, 4 ms with the latency: the median must be at least 8 ms
# with it, and under 8 ms without it (about 0.5 ms here). A latency that
# does not parse is a clear error, and the delay's processes and logs go
# with the lab.
#
#   tests/netlab_latency.sh NETLAB LOCKSTEP_RUN LOCKSTEP_BENCH_DDP LOCKSTEP_NETLAB_DELAY
set -uo pipefail
netlab=$1 run=$2 bench=$3
export NETLAB_DELAY_BIN=$4
"$netlab" check || exit 77
fail() { echo "FAILED: $*"; exit 1; }

allreduce_ms() { # PROFILE: the median of a 4 KiB allreduce between the lab's two hosts
  local out
  out=$(RUN=$run BENCH=$bench "$netlab" run 2 "$1" -- bash -c '
    for i in 0 1; do
      "$NETLAB" exec "$LAB" $i "$RUN" --nnodes 2 --node-rank $i --nproc-per-node 1 --master-addr 10.77.0.1 \
        --master-port 29621 "$BENCH" collectives gloo 0.004 &
      pids[$i]=$!
    done
    wait ${pids[0]} && wait ${pids[1]}' 2>&1) || fail "the benchmark across a $1 lab failed: $out"
  echo "$out" | grep "allreduce" >&2
  echo "$out" | sed -n 's/.*allreduce of .*: \([0-9.]*\) ms (median.*/\1/p' | head -1
}

plain=$(allreduce_ms 1gbit)
slow=$(allreduce_ms 1gbit/2ms)
[ -n "$plain" ] && [ -n "$slow" ] || fail "no allreduce figure ('$plain', '$slow')"
echo "netlab: a 4 KiB allreduce takes $plain ms on 1gbit, $slow ms on 1gbit/2ms"
awk -v s="$slow" 'BEGIN { exit !(s >= 8) }' || fail "with 2 ms on every packet, an allreduce took $slow ms (< 8)"
awk -v p="$plain" 'BEGIN { exit !(p < 8) }' || fail "with no added latency, an allreduce took $plain ms (>= 8)"
ls /tmp/netlab-*.delay 2>/dev/null && fail "a delay's log outlived its lab"

out=$("$netlab" run 2 1gbit/2x -- true 2>&1) && fail "a latency of '2x' was taken"
grep -q "latency '2x' in '1gbit/2x': give it as Nus or Nms" <<<"$out" || fail "unclear error for '2x': $out"
echo "netlab latency: OK"
