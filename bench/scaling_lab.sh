#!/usr/bin/env bash
# The measurements behind docs/scaling.md, in the network lab: for each
# profile (RATES, by default "1gbit/100us 10gbit/50us": scripts/netlab.sh's
# RATE/DELAY; files name them 1gbit_100us), the allreduce of 4 KiB, 4 and 16 MiB between 2
# hosts (to fit the link's alpha and beta), and DDP on the deep model at 2, 3 and
# 4 hosts with a timeline of host 0 (its per-bucket backward times, and the
# step time to predict). Writes OUT/collectives-RATE.txt, OUT/ddp-RATE-P.json
# (the timeline) and OUT/ddp-RATE-P.txt (the measured line); then
#   python3 bench/scaling_model.py OUT
# fits, predicts and projects.
#
#   bench/scaling_lab.sh OUT [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
out=$(realpath -m "$1") steps=${2:-20}
mkdir -p "$out"
export BIN=$(realpath "$build_dir/lockstep-bench-ddp") RUN=$(realpath "$build_dir/lockstep-run") STEPS=$steps OUTDIR=$out
for profile in ${RATES:-1gbit/100us 10gbit/50us}; do
  rate=${profile//\//_}
  export RATE=$rate
  scripts/netlab.sh run 2 "$profile" -- bash -c '
    port=29800
    for mib in 0.00390625 4 16; do
      port=$((port + 1))
      for i in 0 1; do
        "$NETLAB" exec "$LAB" $i env OMP_NUM_THREADS=1 "$RUN" --nnodes 2 --node-rank $i --master-addr 10.77.0.1 \
          --master-port $port "$BIN" collectives gloo $mib &
      done
      wait
    done' 2>&1 | grep "allreduce of" | sed "s/^\[rank 0\] //" > "$out/collectives-$rate.txt"
  for p in 2 3 4; do
    export P=$p
    scripts/netlab.sh run "$p" "$profile" -- bash -c '
      for ((i = 0; i < P; i++)); do
        timeline=(); [ $i -eq 0 ] && timeline=(--timeline "$OUTDIR/ddp-$RATE-$P.json")
        "$NETLAB" exec "$LAB" $i env OMP_NUM_THREADS=1 "$RUN" --nnodes $P --node-rank $i --master-addr 10.77.0.1 \
          --master-port 29900 "${timeline[@]}" "$BIN" lockstep deep "$STEPS" &
      done
      wait' 2>&1 | grep "steps_per_s" | sed "s/^\[rank 0\] //" > "$out/ddp-$rate-$p.txt"
    echo "scaling_lab: $rate, $p hosts: $(cat "$out/ddp-$rate-$p.txt")"
  done
done
