#!/usr/bin/env bash
# The DDP benchmark across the network lab (scripts/netlab.sh): HOSTS hosts
# whose links run at RATE, one rank of one thread per host, each contender in
# turn, ROUNDS times in alternating order; then each one's median steps/s and
# its ratio to the first contender's.
#
#   bench/netlab_bench.sh HOSTS RATE MODEL STEPS ROUNDS CONTENDER...
#
# CONTENDER: a lockstep-bench-ddp mode (lockstep, powersgd, gradop,
# fullshard, nocomm, comm; docs in bench/bench_ddp.cpp), python (PyTorch's
# DDP) or python-powersgd (with its powerSGD_hook), each optionally with
# :CAP_MB for bucket_cap_mb (lockstep:5), and a lockstep mode optionally with
# @BUILD_DIR to run that build's lockstep-bench-ddp (fullshard@/tmp/before,
# beside fullshard: a change before and after). MODEL: mlp or deep. For example:
#   bench/netlab_bench.sh 2 1gbit mlp 10 5 lockstep powersgd python python-powersgd
#   bench/netlab_bench.sh 2 10gbit deep 20 5 lockstep:1 lockstep:5 lockstep nocomm comm
# Lockstep's ranks start with lockstep-run --nnodes HOSTS, one per host;
# Python's with torchrun's variables, as torchrun would. Needs root, and a
# built tree of LOCKSTEP_TORCH's configuration (scripts/config.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
[ $# -ge 6 ] || { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
hosts=$1 rate=$2 model=$3 steps=$4 rounds=$5
shift 5
py=$PWD/.venv/bin/python
[ "$LOCKSTEP_TORCH" = current ] || py=/usr/bin/python3
# PyTorch's powerSGD_hook draws its seeds with NumPy, which the wheel does not require.
if [[ " $* " == *" python-powersgd"* ]] && ! "$py" -c "import numpy" 2>/dev/null; then
  echo "netlab_bench: installing NumPy for PyTorch's powerSGD_hook"
  if [ "$LOCKSTEP_TORCH" = current ]; then
    "$py" -m pip install -q --disable-pip-version-check numpy
  else
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-numpy >/dev/null
  fi
fi
export BENCH_HOSTS=$hosts BENCH_MODEL=$model BENCH_STEPS=$steps BENCH_ROUNDS=$rounds BENCH_PY=$py
export BENCH_BIN=$(realpath "$build_dir/lockstep-bench-ddp") BENCH_RUN=$(realpath "$build_dir/lockstep-run")
export BENCH_SCRIPT=$(realpath bench/ddp_python.py) BENCH_CONTENDERS="$*"
out=$(mktemp)
echo "netlab_bench: $hosts hosts at $rate, $model, $steps steps, $rounds rounds, PyTorch configuration $LOCKSTEP_TORCH"
scripts/netlab.sh run "$hosts" "$rate" -- bash -c '
  port=29700
  one() { # CONTENDER: prints rank 0s line
    local name=${1%%:*} cap=25 bin=$BENCH_BIN pids=() i
    [[ "$1" == *:* ]] && cap=${1#*:}
    [[ "$name" == *@* ]] && bin=${name#*@}/lockstep-bench-ddp name=${name%%@*}
    port=$((port + 1))
    for ((i = 0; i < BENCH_HOSTS; i++)); do
      if [[ "$name" == python* ]]; then
        local hook=""; [ "$name" = python-powersgd ] && hook=powersgd
        "$NETLAB" exec "$LAB" $i env RANK=$i WORLD_SIZE=$BENCH_HOSTS MASTER_ADDR=10.77.0.1 OMP_NUM_THREADS=1 \
          BENCH_HOOK=$hook BENCH_BUCKET_CAP_MB=$cap "$BENCH_PY" "$BENCH_SCRIPT" "$BENCH_MODEL" "$BENCH_STEPS" $port &
      else
        "$NETLAB" exec "$LAB" $i env OMP_NUM_THREADS=1 "$BENCH_RUN" --nnodes "$BENCH_HOSTS" --node-rank $i \
          --nproc-per-node 1 --master-addr 10.77.0.1 --master-port $port \
          "$bin" "$name" "$BENCH_MODEL" "$BENCH_STEPS" --bucket-cap-mb "$cap" &
      fi
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
  }
  for ((round = 0; round < BENCH_ROUNDS; round++)); do
    set -- $BENCH_CONTENDERS
    (( round % 2 == 1 )) && set -- $(printf "%s\n" "$@" | tac)
    for c in "$@"; do
      line=$(one "$c" 2>&1 | grep -E "steps_per_s=" | head -1 | sed "s/^\[rank 0\] //")
      echo "round $round $c ${line:-FAILED}"
    done
  done' | tee "$out"
python3 - "$out" "$@" <<'EOF'
import re, statistics, sys
lines = open(sys.argv[1]).read().splitlines()
contenders = sys.argv[2:]
rates = {c: [] for c in contenders}
for line in lines:
    m = re.match(r"round \d+ (\S+) .*steps_per_s=([0-9.]+)", line)
    if m and m.group(1) in rates:
        rates[m.group(1)].append(float(m.group(2)))
base = statistics.median(rates[contenders[0]]) if rates[contenders[0]] else float("nan")
for c in contenders:
    if rates[c]:
        med = statistics.median(rates[c])
        print(f"{c:20s} median {med:8.2f} steps/s  ({len(rates[c])} runs, {min(rates[c]):.2f}-{max(rates[c]):.2f})  "
              f"x{med / base:.2f} of {contenders[0]}")
    else:
        print(f"{c:20s} no result")
EOF
rm -f "$out"
