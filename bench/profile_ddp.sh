#!/usr/bin/env bash
# Where a DDP step's CPU time goes: both ranks of each MODE of
# lockstep-bench-ddp under `perf record -a`, on the whole machine, with the
# CPU time per step summed over its cores and sorted into kinds of work
# (matrix products, the BLAS's packing, each elementwise kernel, memmove,
# lockstep's own functions, the scheduler, idle cores).
#
#   bench/profile_ddp.sh MODEL STEPS MODE...
#   bench/profile_ddp.sh mlp 300 nocomm mpi lockstep views powersgd
#
# Each MODE runs twice, STEPS and 3 x STEPS steps; the difference of the
# two, divided by 2 x STEPS, is a step's, without the start, the warm-up and
# the exit. A MODE's column against nocomm's says what communicating costs
# the cores that compute. Needs perf and a built tree (scripts/build.sh) of
# the configuration LOCKSTEP_TORCH names; runs as 2 ranks of one core each,
# as bench/run_ddp_bench.sh does, with its glibc thresholds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
model=${1:?usage: bench/profile_ddp.sh MODEL STEPS MODE...}
steps=${2:?usage: bench/profile_ddp.sh MODEL STEPS MODE...}
shift 2
(($# > 0)) || { echo "usage: bench/profile_ddp.sh MODEL STEPS MODE..." >&2; exit 2; }
command -v perf >/dev/null || { echo "profile_ddp: perf is not installed (apt-get install linux-perf)" >&2; exit 2; }
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-33554432}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4294967296}
frequency=999
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run_ranks() { # MODE STEPS
  if [ "$1" = mpi ] || [ "${1%-mpi}" != "$1" ]; then
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 --bind-to none -x OMP_NUM_THREADS=1 \
      "$build_dir/lockstep-bench-ddp" "$1" "$model" "$2" >/dev/null
    return
  fi
  local port=$((20000 + RANDOM % 12000)) pids=()
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      OMP_NUM_THREADS=1 "$build_dir/lockstep-bench-ddp" "$1" "$model" "$2" >/dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"
}
for mode in "$@"; do
  for n in "$steps" $((3 * steps)); do
    perf record -q -a -F "$frequency" -o "$work/perf.data" -- bash -c "$(declare -f run_ranks); \
      build_dir=$build_dir model=$model; run_ranks $mode $n" 2>/dev/null
    perf report -i "$work/perf.data" --no-children --sort dso,sym -q -n -g none 2>/dev/null >"$work/$mode.$n.txt"
  done
done
python3 - "$work" "$steps" "$frequency" "$@" <<'EOF'
import re, sys
work, steps, frequency, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
kinds = [  # (kind, pattern over "dso symbol"), the first that matches
    ("idle (a core with nothing to run)", r"safe_halt|default_idle|cpuidle|poll_idle|intel_idle"),
    ("matrix products: the BLAS's kernels", r"gemm.*kernel|gemv|sgemm_pst|mscale|gemm_beta"),
    ("matrix products: the BLAS's packing", r"scopy|oncopy|otcopy|itcopy|incopy"),
    ("memmove and memcpy", r"memmove|memcpy|copy_mc|erms"),
    ("lockstep's own code", r"lockstep::"),
    ("scheduler, futexes and yields", r"schedule|task_switch|sched_yield|futex|switch_to|pick_next|enqueue|dequeue|"
                                      r"update_curr|ttwu|try_to_wake|select_task"),
]
elementwise = re.compile(r"native::(?:[A-Za-z0-9_]+::)*\(anonymous namespace\)::([a-z_0-9]+)|native::[A-Za-z0-9_]+::(direct_copy_kernel)")
def tally(path):
    out = {}
    for line in open(path):
        fields = line.split(None, 3)
        if len(fields) < 4 or not fields[1].isdigit():
            continue
        samples, rest = int(fields[1]), fields[3]
        kind = next((k for k, p in kinds if re.search(p, rest)), None)
        if kind is None:
            m = elementwise.search(rest)
            kind = f"elementwise: {m.group(1) or m.group(2)}" if m else "everything else"
        out[kind] = out.get(kind, 0) + samples
    return out
per_step = {}
for mode in modes:
    short, long = tally(f"{work}/{mode}.{steps}.txt"), tally(f"{work}/{mode}.{3 * steps}.txt")
    per_step[mode] = {k: (long.get(k, 0) - short.get(k, 0)) * 1000.0 / frequency / (2 * steps)
                      for k in set(short) | set(long)}
rows = sorted({k for d in per_step.values() for k in d}, key=lambda k: -max(d.get(k, 0) for d in per_step.values()))
print(f"CPU ms per step, both ranks' cores together, {' '.join(modes)}:")
print("| kind | " + " | ".join(modes) + " |")
print("|---|" + "---|" * len(modes))
for k in rows:
    values = [per_step[m].get(k, 0.0) for m in modes]
    if max(abs(v) for v in values) >= 0.05:
        print(f"| {k} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
print("| total | " + " | ".join(f"{sum(per_step[m].values()):.2f}" for m in modes) + " |")
EOF
