#!/usr/bin/env bash
# An elastic job across the network lab (scripts/netlab.sh): three hosts at
# 1 Gb/s, one lockstep-run each at --nnodes 2:3, lockstep-train under them.
# Host 2's link is cut mid-run: hosts 0 and 1 go on at world size 2, and
# host 2's launcher fails, saying it lost the rendezvous store. The link comes
# back and a new launcher starts on host 2: the job grows back to 3 and
# finishes. Every training sample must have been trained once per epoch
# (16128 samples in batches of 96: every batch splits evenly over 2 and 3).
#
#   tests/netlab_elastic.sh NETLAB LOCKSTEP_RUN LOCKSTEP_TRAIN
set -uo pipefail
netlab=$1 run=$2 train=$3
"$netlab" check || exit 77
fail() { echo "FAILED: $*"; exit 1; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
RUN=$run TRAIN=$train OUT=$out "$netlab" run 3 1gbit -- bash -c '
  node() { # HOST LOG: one launcher of the job on host HOST
    "$NETLAB" exec "$LAB" "$1" env OMP_NUM_THREADS=1 "$RUN" --nnodes 2:3 --rdzv-endpoint 10.77.0.1:29700 \
      --rdzv-id lab --rdzv-conf last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=4 \
      "$TRAIN" --synthetic --train-samples 16128 --test-samples 256 --batch-size 96 --epochs 2 \
      --checkpoint "$OUT/ckpt" --checkpoint-every 4 --out "$OUT/train" > "$2" 2>&1
  }
  wait_for() { # FILE TEXT SECONDS
    for _ in $(seq $(( $3 * 10 ))); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
    echo "no \"$2\" in $1 within $3 s"; return 1
  }
  node 0 "$OUT/h0.log" & h0=$!
  sleep 0.5 # host 0 serves the store
  node 1 "$OUT/h1.log" & h1=$!
  node 2 "$OUT/h2.log" & h2=$!
  wait_for "$OUT/h0.log" "DistributedDataParallel over 3 ranks" 60 || exit 1
  for _ in $(seq 600); do [ -e "$OUT/ckpt" ] && break; sleep 0.1; done
  ip -n "$LAB-h2" link set eth0 down
  wait_for "$OUT/h0.log" "membership change: world size 3 -> 2" 60 || exit 1
  # Let the 2 hosts train and checkpoint, so that the job grows from a state of theirs.
  saved=$(stat -c %Y.%s "$OUT/ckpt"); sleep 0.5
  for _ in $(seq 600); do [ "$(stat -c %Y.%s "$OUT/ckpt")" != "$saved" ] && break; sleep 0.1; done
  wait $h2; echo "first host 2 exit $?" > "$OUT/h2.status"
  ip -n "$LAB-h2" link set eth0 up
  node 2 "$OUT/h2b.log" & h2b=$!
  wait $h0 && wait $h1 && wait $h2b' > "$out/lab.log" 2>&1
status=$?
for f in lab h0 h1 h2 h2b; do echo "==== $f"; grep -v "ETA" "$out/$f.log" 2>/dev/null | tail -40; done
[ $status -eq 0 ] || fail "the elastic job across the lab failed (status $status)"
grep -q "first host 2 exit 1" "$out/h2.status" || fail "host 2's first launcher did not fail: $(cat "$out/h2.status")"
grep -q "lockstep-run: the rendezvous store at 10.77.0.1:29700: " "$out/h2.log" ||
  fail "host 2's first launcher did not say it lost the store"
# grep reads the files itself: under pipefail, `cat | grep -q` fails when grep
# stops at its match while cat still writes (SIGPIPE).
grep -q "lockstep-run: node [0-9]* is lost: no heartbeat" "$out/h0.log" "$out/h1.log" ||
  fail "neither host 0 nor host 1 saw host 2 lost"
grep -q "membership change: world size 2 -> 3 at step" "$out/h0.log" || fail "the job did not grow back to 3"
grep -q "sample counts: each of the 16128 training samples trained 2 time(s), once per epoch" "$out/h0.log" ||
  fail "a sample was lost or trained twice"
echo "netlab: an elastic job lost a host, went on at 2, and grew back to 3; every sample trained once per epoch"
