#!/usr/bin/env bash
# For a machine with two or more GPUs, which no Lockstep session has had: the
# *_MultiCUDA tests, then lockstep-train on two GPUs (one rank each, over
# NCCL) under DDP and under FullShard, each ending with every rank's
# parameters compared to the bit ("the same on all 2 ranks"). Logs in OUT.
#
#   scripts/multi_gpu_check.sh [OUT]   # after scripts/build.sh (a CUDA build of LibTorch: the current
#                                      # configuration), from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh
out=${1:-multi_gpu_check}
mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "multi_gpu_check: needs 2 or more GPUs; nvidia-smi lists ${gpus:-0}. Run it where there are two." >&2
  exit 2
fi
build=${LOCKSTEP_BUILD_DIR:-$build_dir}
[ -x "$build/lockstep-train" ] || { echo "multi_gpu_check: no $build/lockstep-train; run scripts/build.sh first." >&2; exit 2; }
failed=0
echo "multi_gpu_check: $gpus GPUs, build $build"
ctest --test-dir "$build" -R MultiCUDA --output-on-failure >"$out/multi_cuda.log" 2>&1 || failed=1
grep -E "tests passed|tests failed" "$out/multi_cuda.log" || true
for sharding in "" full; do
  name=ddp${sharding:+_fsdp_$sharding}
  "$build/lockstep-run" --nproc-per-node 2 "$build/lockstep-train" --synthetic --train-samples 6000 \
    --test-samples 1000 --epochs 2 ${sharding:+--sharding "$sharding"} --out "$out/$name" >"$out/$name.log" 2>&1 || failed=1
  if grep -q "nccl" "$out/$name.log" && grep -q "the same on all 2 ranks" "$out/$name.log"; then
    echo "multi_gpu_check: $name over NCCL: $(grep -o 'final parameters.*' "$out/$name.log" | head -1)"
  else
    echo "multi_gpu_check: $name did not end on two GPUs with equal parameters; see $out/$name.log"
    failed=1
  fi
done
exit $failed
