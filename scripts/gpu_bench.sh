#!/usr/bin/env bash
# Transformers on one GPU at world size 1, bf16 autocast, AdamW: Lockstep's
# wrappers against the bare module, and against PyTorch's DDP and FSDP2 from
# the same wheel, each contender a process of its own
# (bench/bench_transformer.cpp, bench/transformer_python.py). For each of the
# GPT (GPT-2 small's shape, sequences of 512) and the ViT (width 384, 12
# blocks): tokens or samples a second, peak GPU memory and MFU; a table on
# stdout and in OUT/gpu_bench.md.
#
#   scripts/gpu_bench.sh run OUT [SECONDS]  # on the GPU machine, from the repository root, after
#                                           # scripts/gpu_check.sh prepare here (.devcheck/ carried along):
#                                           # builds lockstep-bench-transformer with every core, then times
#   scripts/gpu_bench.sh cpu OUT            # the same logic on the CPU at a tiny size, with the build in
#                                           # GPU_BENCH_BUILD (default build/) and .venv's Python
#
# MFU is the model's training FLOPs a second over the card's dense bf16 peak:
# scripts/gpu_peak.sh's (989 TFLOPS for an H100 or H200 SXM, 756 for an H100
# PCIe, 835 for an NVL, 312 for an A100); GPU_PEAK_TFLOPS sets another.
# Goals (docs/performance.md): each wrapper within 3% of the bare module, and
# at least 1.0x its Python twin.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
out=${2:?usage: scripts/gpu_bench.sh run|cpu OUT [SECONDS]}
mkdir -p "$out"
deadline=$((SECONDS + ${3:-280}))
left() { local n=$((deadline - SECONDS)); echo $((n > 5 ? n : 5)); }

case "$mode" in
  run)
    source scripts/devcheck_build.sh
    build=/tmp/lockstep # gpu_check.sh's build: after it, only the benchmark's own file compiles
    build_start=$SECONDS
    devcheck_configure "$build" "$out/configure.log" -DLOCKSTEP_BUILD_BENCH=ON
    cmake --build "$build" --target lockstep-bench-transformer >"$out/build.log" 2>&1 ||
      { grep -E -A12 "error|FAILED" "$out/build.log" | head -40; exit 1; }
    echo "gpu_bench: built in $((SECONDS - build_start)) s"
    python=python3
    flags=(--device cuda --size full --steps "${GPU_BENCH_STEPS:-20}")
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    ;;
  cpu)
    build=${GPU_BENCH_BUILD:-build}
    python=${GPU_BENCH_PYTHON:-.venv/bin/python}
    flags=(--device cpu --size tiny --steps 2)
    card="CPU ($(lscpu | sed -n 's/^Model name: *//p' | head -1))"
    ;;
  *)
    echo "usage: scripts/gpu_bench.sh run OUT [SECONDS] | cpu OUT" >&2
    exit 2
    ;;
esac
peak=$(bash scripts/gpu_peak.sh "$card") # from the repository root, where this runs
peak=${GPU_PEAK_TFLOPS:-$peak}

lines=$out/lines.txt
: >"$lines"
for model in gpt vit; do
  for contender in bare dataparallel ddp fullshard fullshard-checkpointed; do
    timeout -k 5 "$(left)" "$build/lockstep-bench-transformer" "$contender" "$model" "${flags[@]}" \
      >>"$lines" 2>>"$out/errors.log" || echo "gpu_bench: $contender $model failed (errors.log)"
  done
  for contender in python-ddp python-fsdp2 python-fsdp2-checkpointed; do
    timeout -k 5 "$(left)" "$python" bench/transformer_python.py "$contender" "$model" "${flags[@]}" \
      >>"$lines" 2>>"$out/errors.log" || echo "gpu_bench: $contender $model failed (errors.log)"
  done
done
status=0
"$python" - "$lines" "$peak" "$card" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  >"$out/gpu_bench.md" <<'EOF' || status=$?
import sys
lines, peak, card, commit = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = {}
for line in open(lines):
    name, model, *fields = line.split()
    rows[(model, name)] = dict(f.split("=") for f in fields)
twins = {"ddp": "python-ddp", "fullshard": "python-fsdp2", "fullshard-checkpointed": "python-fsdp2-checkpointed"}
order = ["bare", "dataparallel", "ddp", "fullshard", "fullshard-checkpointed",
         "python-ddp", "python-fsdp2", "python-fsdp2-checkpointed"]
print(f"{card}, commit {commit}, world size 1, bf16 autocast, AdamW\n")
print("| model | contender | items/s | ÷ bare | ÷ Python twin | peak memory (MiB) | MFU |")
print("|---|---|---|---|---|---|---|")
missing = 0
for model in ("gpt", "vit"):
    bare = rows.get((model, "bare"))
    for name in order:
        r = rows.get((model, name))
        if r is None:
            missing += 1
            print(f"| {model} | {name} | failed | | | | |")
            continue
        rate = float(r["items_per_s"])
        vs_bare = f"{rate / float(bare['items_per_s']):.3f}" if bare else ""
        twin = rows.get((model, twins.get(name, "")))
        vs_twin = f"{rate / float(twin['items_per_s']):.3f}" if twin else ""
        mfu = f"{100 * float(r['flops_per_s']) / (peak * 1e12):.1f}%" if peak > 0 else "n/a"
        print(f"| {model} | {name} | {rate:,.0f} {r['unit']}/s | {vs_bare} | {vs_twin} | {float(r['peak_mem_mb']):,.0f} | {mfu} |")
sys.exit(1 if missing else 0)
EOF
cat "$out/gpu_bench.md"
exit $status
