#!/usr/bin/env bash
# The DDP benchmark: lockstep DDP over Gloo and over MPI, Python DDP, the
# naive C++ approach and no communication at all, each as 2 processes of one
# core, in alternating order over several rounds; then medians and ratios.
#
#   bench/run_ddp_bench.sh [ROUNDS] [STEPS_MLP] [STEPS_DEEP]
#
# CONTENDERS="lockstep python" runs only those (lockstep must be among them:
# the ratios are against it); MODELS="reversed" only those models. The
# bucket figures (rebuild and static_graph):
#   CONTENDERS="lockstep norebuild static" MODELS="reversed deep" bench/run_ddp_bench.sh
# A contender ending in -tcp keeps Gloo's TCP between ranks of one host (Note
# [Collectives through shared memory]):
#   CONTENDERS="lockstep lockstep-tcp python nocomm" bench/run_ddp_bench.sh
# and one ending in -ompi keeps Open MPI's own collectives (LOCKSTEP_MPI_SHM=0):
#   CONTENDERS="lockstep mpi mpi-ompi nocomm" bench/run_ddp_bench.sh
# and barrier-mpi, no communication but a barrier over MPI after each step,
# what is left of nocomm's rate once the ranks wait for each other every step:
#   CONTENDERS="lockstep mpi barrier-mpi nocomm" bench/run_ddp_bench.sh
# and the flight recorder's cost, and LOCKSTEP_DEBUG=detail's:
#   CONTENDERS="lockstep norecorder detail" bench/run_ddp_bench.sh
# FullyShardedDataParallel against DDP and PyTorch's FSDP2, with Adam:
#   OPTIMIZER=adam CONTENDERS="lockstep gradop fullshard mpi gradop-mpi fullshard-mpi python-fsdp" bench/run_ddp_bench.sh
# and its memory, on a model whose Adam state dominates:
#   OPTIMIZER=adam CONTENDERS="lockstep gradop fullshard" MODELS=wide bench/run_ddp_bench.sh 3 10 10
# A contender ending in +bf16 runs under bf16 autocast (PRECISION=bf16: every
# contender); the transformers against PyTorch, in both:
#   CONTENDERS="lockstep python fullshard python-fsdp lockstep+bf16 python+bf16 fullshard+bf16 python-fsdp+bf16" \
#     MODELS="vit gpt" bench/run_ddp_bench.sh 5 30 30
# and activation checkpointing's memory (BATCH: the global batch):
#   CONTENDERS="lockstep checkpointed fullshard fullshard-checkpointed" MODELS="vit gpt" BATCH=128 bench/run_ddp_bench.sh 3 10 10
#
# Needs a built tree (scripts/build.sh) of the configuration LOCKSTEP_TORCH
# names (scripts/config.sh). Python DDP, the peer, runs on the same PyTorch:
# .venv/'s for current, Debian's python3-torch for debian (installed when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
rounds=${1:-5}
steps_mlp=${2:-40}
steps_deep=${3:-60}
if [ "$LOCKSTEP_TORCH" = current ]; then
  py=.venv/bin/python
else
  # Debian's interpreter: the one python3-torch installs into (PATH may name another).
  py=/usr/bin/python3
  if ! "$py" -c "import torch" 2>/dev/null; then
    echo "run_ddp_bench: installing python3-torch"
    sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends python3-torch >/dev/null
  fi
fi
echo "run_ddp_bench: configuration $LOCKSTEP_TORCH, $("$py" -c 'import torch; print("PyTorch", torch.__version__)' 2>/dev/null)"
out=$(mktemp)
optimizer=${OPTIMIZER:-sgd}
# PRECISION=bf16: forward under autocast to bfloat16, in both contenders.
export BENCH_PRECISION=${PRECISION:-fp32}
# BATCH=N: a global batch of N instead of each model's default, in both contenders.
export BENCH_BATCH=${BATCH:-0}
# glibc's malloc gives memory back to the system, and takes it again, where
# its own heuristics fall: a contender that frees and reallocates its
# gradients every step (zero_grad() sets them to none since PyTorch 2.0)
# then pays hundreds of page faults a step that another, allocating in
# another order, does not. With 2.15, no communication ran 1.11 x faster
# with the thresholds below than without (docs/performance.md). So every
# contender runs with them fixed, unless the environment sets its own.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-33554432} # 32 MiB, glibc's largest
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4294967296}
run_time() { # MODE MODEL STEPS PRECISION: one contender's line(s), appended to $out.pair
  local port=$((20000 + RANDOM % 12000)) # below the ephemeral ports (32768 up), which a connection may hold
  local flags=(--optimizer "$optimizer" --precision "$4" --batch "$BENCH_BATCH")
  if [ "$1" = python ] || [ "$1" = python-fsdp ]; then
    local script=bench/ddp_python.py; [ "$1" = python-fsdp ] && script=bench/fsdp_python.py
    # A time limit: Debian's torch.multiprocessing can hang at exit.
    BENCH_PRECISION=$4 timeout -k 5 120 "$py" "$script" "$2" "$3" "$port" "$optimizer" 2>/dev/null |
      grep steps_per_s >>"$out.pair" || true
    return
  fi
  if [ "$1" = mpi ] || [ "${1%-mpi}" != "$1" ]; then
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout -k 5 120 \
      mpirun -np 2 --bind-to none -x OMP_NUM_THREADS=1 "$build_dir/lockstep-bench-ddp" "$1" "$2" "$3" "${flags[@]}" \
      >>"$out.pair"
    return
  fi
  local pids=()
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
      timeout -k 5 120 "$build_dir/lockstep-bench-ddp" "$1" "$2" "$3" "${flags[@]}" >>"$out.pair" &
    pids+=($!)
  done
  wait "${pids[@]}"
}
run_pair() { # CONTENDER MODEL STEPS; a CONTENDER ending in +bf16 is that mode under bf16 autocast,
  # one ending in -tcp that mode with Gloo's TCP between the ranks of one host (LOCKSTEP_GLOO_SHM=0),
  # one ending in -ompi that MPI mode with Open MPI's own collectives (LOCKSTEP_MPI_SHM=0)
  local mode=${1%+bf16} precision=$BENCH_PRECISION shm=1 mpi_shm=1
  [ "$mode" != "$1" ] && precision=bf16
  [ "${mode%-tcp}" != "$mode" ] && mode=${mode%-tcp} && shm=0
  [ "${mode%-ompi}" != "$mode" ] && mode=${mode%-ompi} && mpi_shm=0
  : >"$out.pair"
  LOCKSTEP_GLOO_SHM=$shm LOCKSTEP_MPI_SHM=$mpi_shm run_time "$mode" "$2" "$3" "$precision"
  sed "s/^$mode /$1 /" "$out.pair" >>"$out"
}
default_contenders="lockstep python naive nocomm views"
command -v mpirun >/dev/null && default_contenders+=" mpi"
read -r -a contenders <<<"${CONTENDERS:-$default_contenders}"
read -r -a models <<<"${MODELS:-mlp deep}"
for ((round = 0; round < rounds; round++)); do
  for model in "${models[@]}"; do
    steps=$steps_mlp; [ "$model" != mlp ] && steps=$steps_deep
    n=${#contenders[@]}
    for ((i = 0; i < n; i++)); do
      run_pair "${contenders[$(((i + round) % n))]}" "$model" "$steps"
    done
  done
done
"$py" - "$out" "${models[@]}" <<'PY'
import collections, statistics, sys
rates = collections.defaultdict(list)
rss = collections.defaultdict(list)
base = collections.defaultdict(list)  # peak RSS before the model (lockstep's contenders only)
for line in open(sys.argv[1]):
    mode, model, sps, mem, *rest = line.split()
    rates[(model, mode)].append(float(sps.split("=")[1]))
    rss[(model, mode)].append(max(float(v) for v in mem.split("=")[1].split(",")))
    for field in rest:
        if field.startswith("base_mb="):
            base[(model, mode)].append(max(float(v) for v in field.split("=")[1].split(",")))
for model in sys.argv[2:]:
    med = {mode: statistics.median(rates[(model, mode)]) for (m, mode) in rates if m == model}
    print(f"{model}: steps/s (median of {len(rates[(model, 'lockstep')])} rounds) and ratios")
    known = ("lockstep", "views", "static", "norebuild", "norecorder", "detail", "mpi", "python", "naive", "nocomm",
             "barrier-mpi", "gradop", "fullshard", "noshard", "gradop-mpi", "fullshard-mpi", "python-fsdp")
    # Every contender measured: the known ones in this order, then the rest (powersgd, ...).
    for mode in [m for m in known if m in med] + sorted(m for m in med if m not in known):
        above = ""
        if base[(model, mode)]:
            above = f" ({statistics.median(rss[(model, mode)]) - statistics.median(base[(model, mode)]):.1f} above the process before the model)"
        print(f"  {mode:13s} {med[mode]:8.2f} steps/s   lockstep/{mode} = {med['lockstep'] / med[mode]:.3f}   "
              f"peak RSS per rank {statistics.median(rss[(model, mode)]):.1f} MiB{above}")
    for mine, peer in (("mpi", "python"), ("mpi", "nocomm"), ("mpi-ompi", "nocomm"), ("mpi", "mpi-ompi"),
                       ("mpi", "barrier-mpi"), ("barrier-mpi", "nocomm")):
        if mine in med and peer in med:
            print(f"  {mine}/{peer} = {med[mine] / med[peer]:.3f}")
    # Sharded data parallelism against DDP on the same backend, and against PyTorch's FSDP.
    for mine, peer in (("lockstep", "lockstep-tcp"), ("lockstep-tcp", "python"), ("powersgd", "nocomm"),
                       ("powersgd-tcp", "nocomm"), ("powersgd-views", "nocomm"), ("powersgd-views", "powersgd"),
                       ("powersgd", "lockstep"), ("deterministic", "lockstep"),
                       ("fullshard-deterministic", "fullshard"),
                       ("gradop", "lockstep"), ("fullshard", "lockstep"), ("noshard", "lockstep"),
                       ("gradop-mpi", "mpi"), ("fullshard-mpi", "mpi"), ("fullshard", "python-fsdp"),
                       ("lockstep+bf16", "python+bf16"), ("fullshard+bf16", "python-fsdp+bf16"),
                       ("lockstep+bf16", "lockstep"), ("fullshard+bf16", "fullshard"), ("python+bf16", "python"),
                       ("checkpointed", "lockstep"), ("fullshard-checkpointed", "fullshard"),
                       ("fullshard-checkpointed", "lockstep")):
        if mine in med and peer in med:
            print(f"  {mine}/{peer} = {med[mine] / med[peer]:.3f}   peak RSS {mine}/{peer} = "
                  f"{statistics.median(rss[(model, mine)]) / statistics.median(rss[(model, peer)]):.3f}")
PY
rm -f "$out" "$out.pair"
