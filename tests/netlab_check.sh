#!/usr/bin/env bash
# The network lab's own test (scripts/netlab.sh): two hosts at 1 Gb/s, one
# lockstep-run per host (--nnodes 2), run the collectives benchmark across
# the link. The allreduce's bus bandwidth must come within [0.5, 1.05] of
# the profile's rate. A DDP job with PowerSGD, no_sync and static_graph
# (lockstep_ddp_worker powersgd) must end with both hosts' parameters equal
# after every step, and lockstep-train must finish across the link. Every
# lab must be gone afterwards: after a command that fails, and after the
# script is killed.
#
#   tests/netlab_check.sh NETLAB LOCKSTEP_RUN LOCKSTEP_BENCH_DDP LOCKSTEP_DDP_WORKER LOCKSTEP_TRAIN
set -uo pipefail
netlab=$1 run=$2 bench=$3 worker=$4 train=$5
"$netlab" check || exit 77
fail() { echo "FAILED: $*"; exit 1; }
labs() { "$netlab" list | wc -l; }
before=$(labs)

out=$(RUN=$run BENCH=$bench "$netlab" run 2 1gbit -- bash -c '
  for i in 0 1; do
    "$NETLAB" exec "$LAB" $i "$RUN" --nnodes 2 --node-rank $i --nproc-per-node 1 --master-addr 10.77.0.1 \
      --master-port 29611 "$BENCH" collectives gloo 8 &
    pids[$i]=$!
  done
  wait ${pids[0]} && wait ${pids[1]}' 2>&1) || fail "the benchmark across the lab failed: $out"
echo "$out" | grep -E "bus bandwidth"
gbps=$(echo "$out" | sed -n 's/.*allreduce of 8 MiB.*bus bandwidth \([0-9.]*\) Gb\/s.*/\1/p' | head -1)
[ -n "$gbps" ] || fail "no allreduce figure in: $out"
awk -v g="$gbps" 'BEGIN { exit !(g >= 0.5 && g <= 1.05) }' || fail "allreduce at $gbps Gb/s on a 1 Gb/s link"
[ "$(labs)" -eq "$before" ] || fail "the lab is still there after its command ended"

out=$(RUN=$run WORKER=$worker TRAIN=$train OUT=$(mktemp -d) "$netlab" run 2 1gbit -- bash -c '
  for i in 0 1; do
    "$NETLAB" exec "$LAB" $i "$RUN" --nnodes 2 --node-rank $i --master-addr 10.77.0.1 --master-port 29612 \
      "$WORKER" powersgd &
    pids[$i]=$!
  done
  wait ${pids[0]} && wait ${pids[1]} || exit 1
  for i in 0 1; do
    "$NETLAB" exec "$LAB" $i env OMP_NUM_THREADS=1 "$RUN" --nnodes 2 --node-rank $i --master-addr 10.77.0.1 \
      --master-port 29613 "$TRAIN" --synthetic --train-samples 512 --test-samples 128 --batch-size 64 --epochs 1 \
      --comm-hook powersgd --powersgd-start 2 --out "$OUT" &
    pids[$i]=$!
  done
  wait ${pids[0]} && wait ${pids[1]}' 2>&1) || fail "the DDP job across the lab failed: $out"
for r in 0 1; do
  grep -q "rank $r: OK" <<<"$out" || fail "rank $r did not end with the other host's parameters: $out"
done
grep -q "final parameters fnv1a64=" <<<"$out" || fail "lockstep-train did not finish across the lab: $out"
echo "netlab: a DDP job with PowerSGD kept both hosts' parameters equal; lockstep-train finished across the link"

"$netlab" run 2 1gbit -- false && fail "a failing command's status was lost"
[ "$(labs)" -eq "$before" ] || fail "the lab is still there after its command failed"

"$netlab" run 2 1gbit -- sleep 60 > /dev/null 2>&1 &
script=$!
for _ in $(seq 50); do [ "$(labs)" -gt "$before" ] && break; sleep 0.1; done
[ "$(labs)" -gt "$before" ] || fail "no lab appeared"
kill -TERM "$script"
wait "$script"
[ "$(labs)" -eq "$before" ] || fail "the lab is still there after SIGTERM"

# The command sleeps on a host, where removing the lab kills it; its output
# goes elsewhere, or ctest would wait for whoever holds the pipe.
"$netlab" run 2 1gbit -- bash -c '"$NETLAB" exec "$LAB" 0 sleep 60' > /dev/null 2>&1 &
script=$!
for _ in $(seq 50); do [ "$(labs)" -gt "$before" ] && break; sleep 0.1; done
kill -KILL "$script"
wait "$script" 2>/dev/null
"$netlab" run 1 1gbit -- true # removes the orphan of the killed run
[ "$(labs)" -eq "$before" ] || fail "the lab of a killed run was not removed by the next"
echo "netlab: OK"
