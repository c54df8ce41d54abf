#!/usr/bin/env bash
# Two builds of lockstep-bench-ddp side by side: before and after a change.
# Each round runs both (alternating which goes first) as 2 ranks of one core
# over Gloo on this machine (under mpirun for a MODE over MPI: mpi,
# gradop-mpi, ...), for each model; then medians and the ratio.
#
#   bench/ab_ddp.sh BEFORE_BUILD_DIR AFTER_BUILD_DIR [ROUNDS] [MODE]
#
# MODE is lockstep-bench-ddp's (default lockstep: DDP with default options);
# OPTIMIZER=adam steps Adam instead of SGD; MODELS="cnn vit" other models than
# the MLP and the deep one (40 steps each, the deep one 60).
set -euo pipefail
before=${1:?usage: bench/ab_ddp.sh BEFORE_BUILD_DIR AFTER_BUILD_DIR [ROUNDS] [MODE]}
after=${2:?usage: bench/ab_ddp.sh BEFORE_BUILD_DIR AFTER_BUILD_DIR [ROUNDS] [MODE]}
rounds=${3:-7}
mode=${4:-lockstep}
optimizer=${OPTIMIZER:-sgd}
# glibc's thresholds fixed, as bench/run_ddp_bench.sh fixes them and for
# the reason it gives.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-33554432}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4294967296}
out=$(mktemp)
run_pair() { # LABEL BUILD MODEL STEPS
  local port=$((20000 + RANDOM % 12000)) pids=() # below the ephemeral ports (32768 up), which a connection may hold
  if [ "$mode" = mpi ] || [ "${mode%-mpi}" != "$mode" ]; then
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout -k 5 120 mpirun -np 2 --bind-to none \
      -x OMP_NUM_THREADS=1 "$2/lockstep-bench-ddp" "$mode" "$3" "$4" --optimizer "$optimizer" | sed "s/^/$1 /" >>"$out"
    return
  fi
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
      timeout -k 5 120 "$2/lockstep-bench-ddp" "$mode" "$3" "$4" --optimizer "$optimizer" | sed "s/^/$1 /" >>"$out" &
    pids+=($!)
  done
  wait "${pids[@]}"
}
for ((round = 0; round < rounds; round++)); do
  for model in ${MODELS:-mlp deep}; do
    steps=40; [ "$model" = deep ] && steps=60
    if ((round % 2 == 0)); then
      run_pair before "$before" "$model" "$steps"; run_pair after "$after" "$model" "$steps"
    else
      run_pair after "$after" "$model" "$steps"; run_pair before "$before" "$model" "$steps"
    fi
  done
done
python3 - "$out" <<'PY'
import collections, statistics, sys
rates = collections.defaultdict(list)
for line in open(sys.argv[1]):
    label, mode, model, sps = line.split()[:4]
    rates[(model, label)].append(float(sps.split("=")[1]))
for model in dict.fromkeys(model for model, _ in rates):
    b, a = statistics.median(rates[(model, "before")]), statistics.median(rates[(model, "after")])
    print(f"{model}: before {b:.2f} steps/s, after {a:.2f} steps/s (medians of {len(rates[(model, 'after')])} rounds); "
          f"after/before = {a / b:.3f}")
PY
rm -f "$out"
